"""Maps HF tensor names to the model's stacked weight names and assembles the stacked arrays."""

from __future__ import annotations

import re
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

from jaxlora.models.config import LlamaConfig
from jaxlora.models.llama import weight_shapes
from jaxlora.weights.errors import WeightsError

_LAYER_TENSOR = re.compile(
    r"model\.layers\.(\d+)\.(?:self_attn|mlp)?\.?"
    r"(input_layernorm|post_attention_layernorm|q_norm|k_norm|[a-z_]+_proj)\.?(weight|bias)?$"
)


def hf_to_model_name(hf_name: str) -> tuple[str, int | None, bool] | None:
    """'model.layers.3.self_attn.q_proj.weight' -> ('layers.q_proj.kernel', 3, transpose=True).

    Returns None for tensors the model does not use (e.g. rotary caches)."""
    if hf_name == "model.embed_tokens.weight":
        return "embed_tokens", None, False
    if hf_name == "model.norm.weight":
        return "norm", None, False
    if hf_name == "lm_head.weight":
        return "lm_head", None, True
    match = _LAYER_TENSOR.match(hf_name)
    if not match:
        return None
    layer, module, kind = int(match.group(1)), match.group(2), match.group(3)
    if module.endswith("layernorm") or module in ("q_norm", "k_norm"):
        return f"layers.{module}", layer, False
    if kind == "weight":
        return f"layers.{module}.kernel", layer, True
    return f"layers.{module}.bias", layer, False


def stack_weights(
    config: LlamaConfig,
    tensor_names: Iterable[str],
    read: Callable[[str], np.ndarray],
    dtype,
    source: str,
    file_of: Callable[[str], str] | None = None,
) -> dict[str, np.ndarray]:
    """Reads every HF-named tensor with `read(name)` and returns the model's flat weight dict.

    Checks that each tensor has the shape the config implies and that none is missing; errors
    name `file_of(tensor name)` (default: `source`)."""
    file_of = file_of or (lambda _: source)
    expected = weight_shapes(config)
    np_dtype = ml_dtypes.bfloat16 if np.dtype(dtype) == ml_dtypes.bfloat16 else np.dtype(dtype)
    stacked: dict[str, np.ndarray] = {}
    seen: dict[str, set[int]] = {}
    for hf_name in tensor_names:
        mapped = hf_to_model_name(hf_name)
        if mapped is None:
            continue
        name, layer, transpose = mapped
        if name == "lm_head" and config.tie_word_embeddings:
            continue
        if name not in expected:
            raise WeightsError(f"{file_of(hf_name)}: tensor {hf_name} is not part of a {config.model_type} model "
                               "with this config (e.g. a bias the config does not declare)")
        tensor = read(hf_name)
        want = expected[name] if layer is None else expected[name][1:]
        want = tuple(reversed(want)) if transpose else tuple(want)
        if tuple(tensor.shape) != want:
            raise WeightsError(f"{file_of(hf_name)}: tensor {hf_name} has shape {tuple(tensor.shape)}, "
                               f"but the config implies {want}")
        tensor = tensor.T if transpose else tensor
        if layer is None:
            stacked[name] = np.asarray(tensor, np_dtype)
            continue
        if not 0 <= layer < config.num_layers:
            raise WeightsError(f"{file_of(hf_name)}: tensor {hf_name} names layer {layer}, "
                               f"but the config has {config.num_layers} layers")
        if name not in stacked:
            stacked[name] = np.empty(expected[name], np_dtype)
            seen[name] = set()
        stacked[name][layer] = tensor
        seen[name].add(layer)
    _check_complete(expected, stacked, seen, config.num_layers, source)
    return stacked


def _check_complete(expected, stacked, seen, num_layers, source):
    missing = [name for name in expected if name not in stacked]
    for name, layers in seen.items():
        if len(layers) != num_layers:
            gaps = sorted(set(range(num_layers)) - layers)
            missing.append(f"{name} for layers {gaps[:5]}{'...' if len(gaps) > 5 else ''}")
    if missing:
        raise WeightsError(f"{source}: missing weights: {', '.join(missing)}")
