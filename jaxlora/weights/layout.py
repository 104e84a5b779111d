"""Maps HF tensor names to the model's stacked weight names and assembles the stacked arrays
(Phi-3's fused qkv_proj / gate_up_proj split into the q/k/v and gate/up kernels)."""

from __future__ import annotations

import re
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

from jaxlora.models.config import LlamaConfig, fused_parts
from jaxlora.models.llama import weight_shapes
from jaxlora.weights.errors import WeightsError

_LAYER_TENSOR = re.compile(
    r"model\.layers\.(\d+)\.(?:self_attn|mlp)?\.?"
    r"(input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|post_feedforward_layernorm|q_norm|k_norm"
    r"|[a-z_]+_proj)\.?(weight|bias)?$"
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
        if mapped[0] == "lm_head" and config.tie_word_embeddings:
            continue
        for name, layer, tensor in _checked_tensors(config, expected, hf_name, mapped, read, file_of):
            _place(config, stacked, seen, expected, name, layer, tensor, np_dtype, hf_name, file_of)
    _check_complete(expected, stacked, seen, config.num_layers, source)
    return stacked


def _checked_tensors(config, expected, hf_name, mapped, read, file_of):
    """[(model name, layer, tensor in the model's layout)] of one HF tensor: itself, or the parts
    of a fused projection (rows split in `fused_parts` order)."""
    name, layer, transpose = mapped
    parts = fused_parts(config, name[len("layers."):-len(".kernel")]) if name.endswith(".kernel") else None
    if parts is None and name not in expected:
        raise WeightsError(f"{file_of(hf_name)}: tensor {hf_name} is not part of a {config.model_type} model "
                           "with this config (e.g. a bias the config does not declare)")
    tensor = read(hf_name)
    if parts is None:
        want = expected[name] if layer is None else expected[name][1:]
        want = tuple(reversed(want)) if transpose else tuple(want)
    else:
        want = (sum(size for _, size in parts), config.hidden_size)
    if tuple(tensor.shape) != want:
        raise WeightsError(f"{file_of(hf_name)}: tensor {hf_name} has shape {tuple(tensor.shape)}, "
                           f"but the config implies {want}")
    if parts is None:
        return [(name, layer, tensor.T if transpose else tensor)]
    bounds = np.cumsum([0] + [size for _, size in parts])
    return [(f"layers.{part}.kernel", layer, tensor[start:stop].T)
            for (part, _), start, stop in zip(parts, bounds[:-1], bounds[1:])]


def _place(config, stacked, seen, expected, name, layer, tensor, np_dtype, hf_name, file_of):
    """Puts one tensor into the flat dict (a layer's slice of its stack)."""
    if layer is None:
        stacked[name] = np.asarray(tensor, np_dtype)
        return
    if not 0 <= layer < config.num_layers:
        raise WeightsError(f"{file_of(hf_name)}: tensor {hf_name} names layer {layer}, "
                           f"but the config has {config.num_layers} layers")
    if name not in stacked:
        stacked[name] = np.empty(expected[name], np_dtype)
        seen[name] = set()
    stacked[name][layer] = tensor
    seen[name].add(layer)


def _check_complete(expected, stacked, seen, num_layers, source):
    missing = [name for name in expected if name not in stacked]
    for name, layers in seen.items():
        if len(layers) != num_layers:
            gaps = sorted(set(range(num_layers)) - layers)
            missing.append(f"{name} for layers {gaps[:5]}{'...' if len(gaps) > 5 else ''}")
    if missing:
        raise WeightsError(f"{source}: missing weights: {', '.join(missing)}")
