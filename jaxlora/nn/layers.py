"""Stateless building blocks of the Llama family: RMSNorm (Llama's, or Gemma's 1 + weight), the MLP
activations, RoPE (llama3 / linear / dynamic / yarn scaling, per-layer bases), soft-capping, GQA
attention (masked, with sliding windows, or flash inside packed segments)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.nn.model_config import LlamaConfig
from pallas_kernels.attention import flash_supported, flash_takes_window, segment_attention
from pallas_kernels.dispatch import kernel_style


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """x [..., d] normalised in float32, scaled by weight [d], returned in x's dtype (as HF does).
    offset != 0 (Gemma): scaled by (offset + weight) in float32 before the cast, as HF's Gemma norms."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


# The MLP gate's activation by HF name (`LlamaConfig.hidden_act`).
ACTIVATION_FUNCTIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True)}


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's soft-capping of scores and logits); x unchanged for None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


@jax.custom_vjp
def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., k] @ w [k, n], accumulated and returned in float32.

    The backward casts the cotangent to the inputs' dtype before its GEMMs (dX = g @ w^T,
    dW = x^T g, both accumulated in float32), as PyTorch's bf16 training does: differentiating a
    plain `jnp.dot(..., preferred_element_type=float32)` would multiply a float32 cotangent by the
    bf16 weight upcast to float32, a TF32 GEMM at half the bf16 rate. For float32 inputs the two
    are the same. The cast is its own fusion (an optimization barrier): otherwise XLA may fuse it
    into the dX GEMM as a Triton prologue instead of calling cuBLAS."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def _dense_forward(x, w):
    return dense(x, w), (x, w)


def _dense_backward(saved, grad):
    x, w = saved
    grad = jax.lax.optimization_barrier(grad.astype(x.dtype))
    grad_x = jnp.dot(grad, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
    rows, grad_rows = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
    grad_w = jnp.dot(rows.T, grad_rows, preferred_element_type=jnp.float32).astype(w.dtype)
    return _sum_over_extra_axes(grad_x, x), _sum_over_extra_axes(grad_w, w)


def _sum_over_extra_axes(grad: jax.Array, primal: jax.Array) -> jax.Array:
    """Inside shard_map: a cotangent varying over mesh axes its primal does not vary over is summed
    over them (what the automatic transpose of the implicit broadcast does)."""
    extra = tuple(sorted(_varying_axes(grad) - _varying_axes(primal)))
    return jax.lax.psum(grad, extra) if extra else grad


def _varying_axes(x: jax.Array) -> frozenset:
    """The shard_map mesh axes x varies over (`aval.mat.varying` in jax >= 0.12, `aval.vma` before)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "mat", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


dense.defvjp(_dense_forward, _dense_backward)


def _default_frequencies(theta: float, dim: int) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def rope_inverse_frequencies(config: LlamaConfig) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies of the global (full-attention) layers, with
    llama3, linear or yarn scaling if configured. 'dynamic' depends on the positions of the call:
    `rope_frequencies`."""
    dim, scaling = config.head_dim, config.rope_scaling
    inv_freq = _default_frequencies(config.rope_theta, dim)
    if scaling is not None and scaling.rope_type == "linear":  # position interpolation
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None and scaling.rope_type == "yarn":
        inv_freq = _yarn_frequencies(inv_freq, config.rope_theta, dim, scaling)
    elif scaling is not None and scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def _yarn_frequencies(inv_freq: np.ndarray, theta: float, dim: int, scaling) -> np.ndarray:
    """transformers' `_compute_yarn_parameters`: extrapolated (high) and interpolated (low)
    frequencies blended by a linear ramp over the dimensions between the beta_fast/beta_slow
    correction dims."""
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return inv_freq / scaling.factor * (1 - extrapolation) + inv_freq * extrapolation


def rope_frequencies(config: LlamaConfig, positions: jax.Array, layer_index=None) -> tuple[jax.Array, float]:
    """(inverse frequencies [head_dim // 2], cos/sin scale) of one layer for a call at `positions`.

    Gemma 3's sliding layers use `local_rope_theta` unscaled (layer_index: int or traced int32;
    needed only when the layers differ). 'dynamic' (NTK) recomputes the base from the longest
    position of the call, as transformers does for each forward: theta * (factor * seq /
    original - (factor - 1)) ** (dim / (dim - 2)), seq = max(positions) + 1 but at least original."""
    scaling, dim = config.rope_scaling, config.head_dim
    attention_factor = 1.0 if scaling is None else scaling.attention_factor
    inv_freq = jnp.asarray(rope_inverse_frequencies(config))
    if scaling is not None and scaling.rope_type == "dynamic":
        original = scaling.original_max_position_embeddings
        seq = jnp.maximum(jnp.max(positions) + 1, original).astype(jnp.float32)
        base = config.rope_theta * (scaling.factor * seq / original - (scaling.factor - 1)) ** (dim / (dim - 2))
        inv_freq = 1.0 / base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    if config.local_rope_theta is None or "sliding_attention" not in (config.layer_types or ()):
        return inv_freq, attention_factor
    local = jnp.asarray(_default_frequencies(config.local_rope_theta, dim).astype(np.float32))
    if set(config.layer_types) == {"sliding_attention"}:
        return local, 1.0
    sliding = jnp.asarray(np.array([kind == "sliding_attention" for kind in config.layer_types]))
    return jnp.where(sliding[_required(layer_index)], local, inv_freq), 1.0


def _required(layer_index):
    if layer_index is None:
        raise ValueError("this model's layers differ (sliding windows / RoPE bases): pass layer_index")
    return layer_index


NO_WINDOW = np.iinfo(np.int32).max  # a traced window that masks nothing (a full-attention layer)


def layer_window(config: LlamaConfig, layer_index=None) -> int | jax.Array | None:
    """The attention window of a layer: None (full attention on every layer), an int (the same on
    every layer), or a traced int32 picked by `layer_index` (NO_WINDOW for full layers)."""
    windows = config.layer_windows()
    if len(set(windows)) == 1:
        return windows[0]
    table = jnp.asarray(np.array([NO_WINDOW if w is None else w for w in windows], np.int32))
    return table[_required(layer_index)]


class AttentionSpec(NamedTuple):
    """How a layer forms its attention scores: q.k * scale, soft-capped (None: not), and the
    window (None: every earlier key; else key position > query position - window)."""

    scale: float
    softcap: float | None = None
    window: int | jax.Array | None = None


def window_mask(q_pos: jax.Array, k_pos: jax.Array, window) -> jax.Array | bool:
    """[B, T, S] bool: key within the window of the query (True when window is None).
    q_pos [B, T], k_pos [B or 1, S] int positions."""
    if window is None:
        return True
    return (q_pos[:, :, None] - k_pos[:, None, :]) < window


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq, scale: float = 1.0) -> jax.Array:
    """Rotary embedding in HF's half-split layout. x [B, T, H, Dh]; positions [B, T];
    inv_freq [Dh/2]; scale multiplies cos and sin (yarn's attention factor)."""
    angles = positions.astype(jnp.float32)[:, :, None] * inv_freq  # [B, T, Dh/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, spec: AttentionSpec | None = None
              ) -> jax.Array:
    """Grouped-query attention.

    Args:
      q: [B, T, H, Dh]; k, v: [B, S, Hkv, Dh] with H a multiple of Hkv.
      mask: [B, T, S] bool, True where query t may attend to key s (the window already in it).
      spec: the scores' scale and soft-cap (None: head_dim ** -0.5, no cap).

    Returns:
      [B, T, H, Dh] in q's dtype. A query with no allowed key gets a uniform average (never NaN).
    """
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    grouped = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", grouped, k, preferred_element_type=jnp.float32)
    spec = spec or AttentionSpec(head_dim**-0.5)
    scores = softcap(scores * spec.scale, spec.softcap)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(batch, length, heads, head_dim).astype(q.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedSegments:
    """Attention of packed rows given by segment ids instead of a [B, T, S] mask: query t attends to
    key s iff s <= t within the same segment. `attend` runs it with a flash kernel.

    segment_ids: [B, T] int32; impl: the kernel dispatch (`pallas_kernels.attention`)."""

    segment_ids: jax.Array
    impl: str | None = dataclasses.field(default=None, metadata={"static": True})


ATTENTION_IMPLS = ("auto", "masked", "flash")


def packed_attention(segment_ids: jax.Array, head_dim: int, impl: str = "auto", *, windowed: bool = False,
                     softcapped: bool = False) -> jax.Array | PackedSegments:
    """What `attend` needs for packed rows (segment_ids [B, T]): a flash `PackedSegments` or the
    [B, T, T] bool mask. impl "auto": flash on GPU/TPU where the kernel takes the shape and the
    model (windowed: only the GPU "spans" kernel takes a window; softcapped scores: no kernel),
    else masked; "flash" forces the kernel (interpret mode on CPU); "masked" the XLA softmax over a
    full mask."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    length = segment_ids.shape[1]
    if impl == "flash" and softcapped:
        raise ValueError("attention='flash': the flash kernels do not soft-cap scores (attn_logit_softcapping); "
                         "use 'masked' or 'auto'")
    if impl == "auto":
        style = kernel_style(off_accelerator=None)
        takes_model = not softcapped and (not windowed or (style == "gpu" and flash_takes_window()))
        impl = "flash" if style is not None and takes_model and flash_supported(length, head_dim) else "masked"
    if impl == "flash":
        return PackedSegments(segment_ids.astype(jnp.int32), kernel_style())
    causal = jnp.tril(jnp.ones((length, length), bool))[None]
    return causal & (segment_ids[:, :, None] == segment_ids[:, None, :])


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | PackedSegments,
           spec: AttentionSpec | None = None) -> jax.Array:
    """`attention` with a bool mask [B, T, S] (the window already in it), or the flash kernel for
    `PackedSegments` (which applies spec's window itself)."""
    if isinstance(mask, PackedSegments):
        spec = spec or AttentionSpec(q.shape[-1] ** -0.5)
        return segment_attention(q, k, v, mask.segment_ids, impl=mask.impl, sm_scale=spec.scale, window=spec.window)
    return attention(q, k, v, mask, spec)
