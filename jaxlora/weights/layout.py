"""Maps HF tensor names to the model's stacked weight names and assembles the stacked arrays
(Phi-3's fused qkv_proj / gate_up_proj split into the q/k/v and gate/up kernels).

On a GPU/TPU each tensor goes to the device as the file holds it (HF's [out, in], the checkpoint's
dtype) and the stacking over layers, the transpose to the model's [in, out] and the cast run there
as one fused copy per weight: on an 8B checkpoint the host's strided bfloat16 transposes and casts
were most of a 67 s load on an H200 machine (issue 35). On a CPU (where XLA's bfloat16 transposes
are slower than numpy's) the host assembles them."""

from __future__ import annotations

import functools
import re
from typing import Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.nn.model_config import LlamaConfig, fused_parts
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
) -> dict[str, jax.Array]:
    """Reads every HF-named tensor with `read(name)` and returns the model's flat weight dict (on
    the default device, in `dtype`).

    Checks that each tensor has the shape the config implies and that none is missing; errors
    name `file_of(tensor name)` (default: `source`)."""
    host = on_host()
    plan = plan_weights(config, tensor_names, read, source, file_of, place=None if host else jnp.asarray)
    weights: dict[str, jax.Array] = {}
    for name in list(plan):  # one name at a time: its pieces are freed before the next is stacked
        pieces, transpose, stack = plan.pop(name)
        weights[name] = _assemble(pieces, transpose, dtype, host, stack)
    return weights


class Planned(NamedTuple):
    """A model weight's pieces as `read` gave them (one, or one per layer in layer order when
    `stacked`) and whether the model's layout is their transpose."""

    pieces: list
    transpose: bool
    stacked: bool


def plan_weights(config: LlamaConfig, tensor_names: Iterable[str], read: Callable, source: str,
                 file_of: Callable[[str], str] | None = None, place: Callable | None = None) -> dict[str, Planned]:
    """{model weight name: `Planned`} of the HF-named tensors, each got with `read(name)` (an array,
    or anything with `.shape` and row slices, e.g. a `safetensors_file.TensorRef`: nothing is read
    then) and passed through `place` if given (a layer's piece); WeightsError for a tensor the
    config does not imply, a wrong shape, a layer out of range or a missing weight, naming
    `file_of(tensor name)` (default: `source`)."""
    file_of = file_of or (lambda _: source)
    expected = weight_shapes(config)
    single: dict[str, Planned] = {}
    layers: dict[str, dict[int, tuple]] = {}  # name -> layer -> (tensor, transposed)
    for hf_name in tensor_names:
        mapped = hf_to_model_name(hf_name)
        if mapped is None or (mapped[0] == "lm_head" and config.tie_word_embeddings):
            continue
        for name, layer, tensor, transpose in _checked_tensors(config, expected, hf_name, mapped, read, file_of):
            if layer is None:
                single[name] = Planned([tensor], transpose, False)
                continue
            if not 0 <= layer < config.num_layers:
                raise WeightsError(f"{file_of(hf_name)}: tensor {hf_name} names layer {layer}, "
                                   f"but the config has {config.num_layers} layers")
            layers.setdefault(name, {})[layer] = (tensor if place is None else place(tensor), transpose)
    _check_complete(expected, {**single, **layers}, {name: set(got) for name, got in layers.items()},
                    config.num_layers, source)
    return single | {name: Planned([got[layer][0] for layer in range(config.num_layers)], got[0][1], True)
                     for name, got in layers.items()}


def on_host() -> bool:
    """Where the weights' stacking, transposes and casts run (module doc): the host on a CPU."""
    return jax.default_backend() == "cpu"


def _assemble(tensors: list, transpose: bool, dtype, on_host: bool, stack: bool) -> jax.Array:
    """tensors (one, or one per layer with `stack`) as the model's array: each transposed if the
    model's layout is its transpose, stacked over layers, in `dtype`. on_host: numpy writes the
    result (one copy), then it goes to the device; else the tensors are device arrays and one
    jitted copy does it all there."""
    if not on_host:
        return _device_assemble(tuple(tensors), transpose, jnp.dtype(dtype), stack)
    layout = [t.T if transpose else t for t in tensors]
    out = np.empty(((len(layout),) if stack else ()) + layout[0].shape, np.dtype(jnp.dtype(dtype)))
    for i, tensor in enumerate(layout):
        out[i if stack else ...] = tensor
    return jnp.asarray(out)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _device_assemble(tensors: tuple, transpose: bool, dtype, stack: bool) -> jax.Array:
    """`_assemble` on the device: [a, b] pieces -> [L, a, b] ([L, b, a] transposed), or one piece."""
    out = jnp.stack(tensors) if stack else tensors[0]
    return (jnp.swapaxes(out, -1, -2) if transpose else out).astype(dtype)


def _checked_tensors(config, expected, hf_name, mapped, read, file_of):
    """[(model name, layer, tensor as read or a row range of it, whether the model's layout is its
    transpose)] of one HF tensor: itself, or the parts of a fused projection (rows split in
    `fused_parts` order)."""
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
        return [(name, layer, tensor, transpose)]
    bounds = np.cumsum([0] + [size for _, size in parts])
    return [(f"layers.{part}.kernel", layer, tensor[start:stop], True)
            for (part, _), start, stop in zip(parts, bounds[:-1], bounds[1:])]


def _check_complete(expected, stacked, seen, num_layers, source):
    missing = [name for name in expected if name not in stacked]
    for name, layers in seen.items():
        if len(layers) != num_layers:
            gaps = sorted(set(range(num_layers)) - layers)
            missing.append(f"{name} for layers {gaps[:5]}{'...' if len(gaps) > 5 else ''}")
    if missing:
        raise WeightsError(f"{source}: missing weights: {', '.join(missing)}")
