"""Loads a HF model directory: `config.json`, `model.safetensors` or sharded safetensors + index."""

from __future__ import annotations

import json
import os

import jax

from jaxlora.jsonfile import read_json_file
from jaxlora.nn.model_config import ConfigError, LlamaConfig, config_from_hf
from jaxlora.weights.errors import WeightsError
from jaxlora.weights.layout import Planned, plan_weights
from jaxlora.weights.parallel_read import read_weights
from jaxlora.weights.safetensors_file import TensorRef, read_header


def read_hf_config(path: str, parse=config_from_hf) -> LlamaConfig:
    """`parse(config.json's dict, source=its path)` of a HF directory (default: the `LlamaConfig`);
    WeightsError if the file is missing, unreadable or not a config `parse` accepts."""
    config_file = os.path.join(path, "config.json")
    raw = read_json_file(config_file, WeightsError, f"is {path} a HF model directory?")
    try:
        return parse(raw, source=config_file)
    except ConfigError as err:
        raise WeightsError(str(err)) from err


def safetensors_files(path: str) -> list[str]:
    """The weight files of a HF directory, from the shard index if there is one."""
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index_file):
        with open(index_file) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, shard) for shard in shards]
    else:
        files = [os.path.join(path, "model.safetensors")]
    for file in files:
        if not os.path.exists(file):
            raise WeightsError(f"{file}: weight file not found")
    return files


def load_hf_weights(path: str, config: LlamaConfig, dtype) -> dict[str, jax.Array]:
    """Reads all weights of a HF directory into the model's stacked layout, in `dtype`: the
    headers first (`plan_hf_weights`: every shape checked, nothing read yet), then the tensors by
    threads (`jaxlora.weights.parallel_read`)."""
    return read_weights(plan_hf_weights(path, config), dtype)


def plan_hf_weights(path: str, config: LlamaConfig) -> dict[str, Planned]:
    """The model weights of a HF directory as `TensorRef`s (`layout.plan_weights`) from the
    safetensors headers alone; WeightsError naming the file for a corrupt or truncated one, a
    tensor the config does not imply, a wrong shape or a missing weight."""
    refs: dict[str, TensorRef] = {}
    for file in safetensors_files(path):
        refs.update(read_header(file))
    return plan_weights(config, sorted(refs), refs.__getitem__, source=path, file_of=lambda name: refs[name].file)
