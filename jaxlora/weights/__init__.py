"""Model loading: `load_model("default" | HF directory | .gguf file, dtype)`."""

from __future__ import annotations

import os

import jax.numpy as jnp

from jaxlora.models.config import LlamaConfig
from jaxlora.models.llama import Llama
from jaxlora.tokenizer import Tokenizer, TokenizerError, tokenizer_from_gguf_metadata, tokenizer_from_hf_dir
from jaxlora.weights.embedded import default_model_path
from jaxlora.weights.errors import WeightsError
from jaxlora.weights.gguf_file import gguf_metadata, load_gguf_weights, open_gguf, read_gguf_config
from jaxlora.weights.hf import load_hf_weights, read_hf_config

__all__ = ["WeightsError", "default_model_path", "load_model", "resolve_model_path"]


def resolve_model_path(path: str) -> str:
    return default_model_path() if path in ("default", "", None) else path


def load_model(path: str = "default", dtype=jnp.float32) -> tuple[Llama, Tokenizer]:
    """Loads a Llama-family model and its tokenizer.

    Args:
      path: "default" (the embedded SmolLM2-135M-Instruct), a HF directory, or a `.gguf` file.
      dtype: the weights' dtype (float32 for tests, bfloat16 on accelerators).
    """
    path = resolve_model_path(path)
    if os.path.isdir(path):
        config = read_hf_config(path)
        weights = load_hf_weights(path, config, dtype)
        tokenizer = _tokenizer_or_error(lambda: tokenizer_from_hf_dir(path))
    elif os.path.exists(path) or path.endswith(".gguf"):
        reader = open_gguf(path)
        metadata = gguf_metadata(reader)
        config = read_gguf_config(reader, metadata, path)
        weights = load_gguf_weights(reader, config, dtype, path)
        tokenizer = _tokenizer_or_error(lambda: tokenizer_from_gguf_metadata(metadata, path))
    else:
        raise WeightsError(f"{path}: no such model directory or file")
    return Llama(config, weights=weights, dtype=dtype), tokenizer


def load_config(path: str) -> LlamaConfig:
    path = resolve_model_path(path)
    if os.path.isdir(path):
        return read_hf_config(path)
    reader = open_gguf(path)
    return read_gguf_config(reader, gguf_metadata(reader), path)


def _tokenizer_or_error(build) -> Tokenizer:
    try:
        return build()
    except TokenizerError as err:
        raise WeightsError(str(err)) from err
