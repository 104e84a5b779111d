"""Loads a GGUF file (llama.cpp format): metadata, dequantized weights and the tokenizer."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from jaxlora.nn.model_config import ConfigError, LlamaConfig, config_from_gguf
from jaxlora.weights.errors import WeightsError
from jaxlora.weights.layout import stack_weights

SUPPORTED_TYPES = {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
}

_GGUF_TO_HF = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None if unused."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    match = _BLOCK_TENSOR.match(name)
    if not match or match.group(2) not in _GGUF_TO_HF:
        return None
    module = _GGUF_TO_HF[match.group(2)]
    if module.endswith("layernorm"):
        return f"model.layers.{match.group(1)}.{module}.weight"
    return f"model.layers.{match.group(1)}.{module}.{match.group(3)}"


def open_gguf(path: str) -> GGUFReader:
    try:
        return GGUFReader(path)
    except FileNotFoundError:
        raise WeightsError(f"{path}: GGUF file not found") from None
    except Exception as err:  # gguf raises ValueError/struct/IndexError on truncated or foreign files
        raise WeightsError(f"{path}: not a readable GGUF file (truncated or corrupt?): {err}") from err


def gguf_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata as Python values (strings, numbers, lists)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def read_gguf_config(reader: GGUFReader, metadata: dict[str, Any], path: str) -> LlamaConfig:
    names = {tensor.name for tensor in reader.tensors}
    try:
        return config_from_gguf(metadata, has_output_tensor="output.weight" in names, source=path)
    except ConfigError as err:
        raise WeightsError(str(err)) from err


def _unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's interleaving of q/k rows for its rotary layout (as transformers does)."""
    rows = weight.shape[0]
    shaped = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return shaped.swapaxes(1, 2).reshape(weight.shape)


def _dequantized(tensor, path: str) -> np.ndarray:
    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise WeightsError(f"{path}: tensor {tensor.name} has GGUF type {qtype.name}, "
                           f"which jaxlora does not dequantize (supported: {supported})")
    shape = tuple(int(n) for n in reversed(tensor.shape))
    try:
        values = dequantize(np.asarray(tensor.data), qtype)
        return values.reshape(shape).astype(np.float32)
    except Exception as err:
        raise WeightsError(f"{path}: tensor {tensor.name} cannot be decoded: {err}") from err


def load_gguf_weights(reader: GGUFReader, config: LlamaConfig, dtype, path: str) -> dict[str, np.ndarray]:
    """Dequantizes every tensor into the model's stacked layout, in `dtype`."""
    by_hf_name = {}
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is not None:
            by_hf_name[hf_name] = tensor
    permute = config.model_type == "llama"

    def read(hf_name: str) -> np.ndarray:
        weight = _dequantized(by_hf_name[hf_name], path)
        if permute and hf_name.endswith("q_proj.weight"):
            weight = _unpermute_rotary(weight, config.num_heads)
        elif permute and hf_name.endswith("k_proj.weight"):
            weight = _unpermute_rotary(weight, config.num_kv_heads)
        return weight

    return stack_weights(config, sorted(by_hf_name), read, dtype, source=path)
