"""Model loading: `load_model("default" | HF directory | .gguf file, dtype)`."""

from __future__ import annotations

import os

import jax.numpy as jnp

from jaxlora.nn.model_config import LlamaConfig
from jaxlora.models.llama import Llama
from jaxlora.tokenizer import Tokenizer, TokenizerError, tokenizer_from_gguf_metadata, tokenizer_from_hf_dir
from jaxlora.weights.embedded import default_model_path
from jaxlora.weights.errors import WeightsError
from jaxlora.weights.gguf_file import gguf_metadata, load_gguf_weights, open_gguf, read_gguf_config
from jaxlora.weights.hf import load_hf_weights, read_hf_config

__all__ = ["WeightsError", "default_model_path", "load_llama", "load_model", "load_tokenizer", "resolve_model_path"]


def resolve_model_path(path: str) -> str:
    return default_model_path() if path in ("default", "", None) else path


def load_model(path: str = "default", dtype=jnp.float32) -> tuple[Llama, Tokenizer]:
    """Loads a Llama-family model and its tokenizer.

    Args:
      path: "default" (the embedded SmolLM2-135M-Instruct), a HF directory, or a `.gguf` file.
      dtype: the weights' dtype (float32 for tests, bfloat16 on accelerators).
    """
    return load_llama(path, dtype), load_tokenizer(path)


def load_llama(path: str = "default", dtype=jnp.float32) -> Llama:
    """Loads only the model weights (see `load_model`)."""
    path = resolve_model_path(path)
    if os.path.isdir(path):
        config = read_hf_config(path)
        return Llama(config, weights=load_hf_weights(path, config, dtype), dtype=dtype)
    reader = _gguf_reader(path)
    metadata = gguf_metadata(reader)
    config = read_gguf_config(reader, metadata, path)
    return Llama(config, weights=load_gguf_weights(reader, config, dtype, path), dtype=dtype)


def load_tokenizer(path: str = "default") -> Tokenizer:
    """Loads only the tokenizer: `tokenizer.json` of a HF directory, or built from GGUF metadata."""
    path = resolve_model_path(path)
    try:
        if os.path.isdir(path):
            return tokenizer_from_hf_dir(path)
        return tokenizer_from_gguf_metadata(gguf_metadata(_gguf_reader(path)), path)
    except TokenizerError as err:
        raise WeightsError(str(err)) from err


def _gguf_reader(path: str):
    if not os.path.exists(path):
        raise WeightsError(f"{path}: no such model directory or file")
    return open_gguf(path)


def load_config(path: str) -> LlamaConfig:
    path = resolve_model_path(path)
    if os.path.isdir(path):
        return read_hf_config(path)
    reader = open_gguf(path)
    return read_gguf_config(reader, gguf_metadata(reader), path)
