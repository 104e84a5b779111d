"""Loads a HF model directory: `config.json`, `model.safetensors` or sharded safetensors + index."""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors import safe_open

from jaxlora.jsonfile import read_json_file
from jaxlora.models.config import ConfigError, LlamaConfig, config_from_hf
from jaxlora.weights.errors import WeightsError
from jaxlora.weights.layout import stack_weights


def read_hf_config(path: str) -> LlamaConfig:
    config_file = os.path.join(path, "config.json")
    raw = read_json_file(config_file, WeightsError, f"is {path} a HF model directory?")
    try:
        return config_from_hf(raw, source=config_file)
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


def _open(file: str):
    try:
        return safe_open(file, framework="numpy")
    except Exception as err:  # safetensors raises its own error types for truncated/corrupt files
        raise WeightsError(f"{file}: cannot read safetensors (truncated or corrupt?): {err}") from err


def load_hf_weights(path: str, config: LlamaConfig, dtype) -> dict[str, np.ndarray]:
    """Reads all weights of a HF directory into the model's stacked layout, in `dtype`."""
    handles = {file: _open(file) for file in safetensors_files(path)}
    owner = {name: file for file, handle in handles.items() for name in handle.keys()}

    def read(name: str) -> np.ndarray:
        try:
            return handles[owner[name]].get_tensor(name)
        except Exception as err:
            raise WeightsError(f"{owner[name]}: cannot read tensor {name}: {err}") from err

    return stack_weights(config, sorted(owner), read, dtype, source=path, file_of=owner.__getitem__)
