"""Loads a HF model directory: `config.json`, `model.safetensors` or sharded safetensors + index."""

from __future__ import annotations

import concurrent.futures
import json
import os
from typing import Callable

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jaxlora.jsonfile import read_json_file
from jaxlora.nn.model_config import ConfigError, LlamaConfig, config_from_hf
from jaxlora.weights.errors import WeightsError
from jaxlora.weights.layout import on_host, stack_weights


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


def _open(file: str):
    try:
        return safe_open(file, framework="numpy")
    except Exception as err:  # safetensors raises its own error types for truncated/corrupt files
        raise WeightsError(f"{file}: cannot read safetensors (truncated or corrupt?): {err}") from err


# Tensors read (and on a GPU/TPU copied to the device) ahead of the one being assembled, by this
# many threads: one reader read 16 GB of an 8B checkpoint at ~1 GB/s (a copy out of the page cache,
# then a staged host -> device copy, one tensor after the other: 16 s of a 32 s warm start on an
# H200; issue 35).
READ_THREADS = 8
READ_AHEAD = 32


def load_hf_weights(path: str, config: LlamaConfig, dtype) -> dict[str, np.ndarray]:
    """Reads all weights of a HF directory into the model's stacked layout, in `dtype`."""
    handles = {file: _open(file) for file in safetensors_files(path)}
    owner = {name: file for file, handle in handles.items() for name in handle.keys()}

    def read(name: str) -> np.ndarray:
        try:
            return handles[owner[name]].get_tensor(name)
        except Exception as err:
            raise WeightsError(f"{owner[name]}: cannot read tensor {name}: {err}") from err

    names = sorted(owner)
    to_device = None if on_host() else jnp.asarray  # the assembly runs where the tensors are
    with ReadAhead(names, read, to_device) as reader:
        return stack_weights(config, names, reader, dtype, source=path, file_of=owner.__getitem__)


class ReadAhead:
    """`read(name)` of `names`, asked for in that order (names may be skipped), from `READ_THREADS`
    threads, at most `READ_AHEAD` tensors ahead of the one asked for; `to_device` (e.g.
    `jnp.asarray`) runs in the thread too, so reads and host -> device copies overlap. A read's
    error is raised when its tensor is asked for. A context manager: leaving it drops what is left."""

    def __init__(self, names: list[str], read: Callable, to_device: Callable | None = None):
        self._names, self._next = list(names), 0
        self._read, self._to_device = read, to_device
        self._pending: dict[str, concurrent.futures.Future] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="jaxlora-read")

    def _load(self, name: str):
        tensor = self._read(name)
        return tensor if self._to_device is None else self._to_device(tensor)

    def _fill(self, position: int) -> None:
        """Submits the reads of the names up to READ_AHEAD past `position`."""
        while self._next < len(self._names) and self._next <= position + READ_AHEAD:
            name = self._names[self._next]
            self._pending[name] = self._pool.submit(self._load, name)
            self._next += 1

    def __call__(self, name: str):
        position = self._names.index(name) if name in self._names else None
        if position is None:
            return self._load(name)
        self._fill(position)
        for skipped in self._names[:position]:  # names the caller passed over: not kept
            future = self._pending.pop(skipped, None)
            if future is not None:
                future.cancel()
        del self._names[:position + 1]
        self._next -= position + 1
        return self._pending.pop(name).result()

    def __enter__(self) -> "ReadAhead":
        return self

    def __exit__(self, *exc) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)
