"""Stateless building blocks of the Llama family: RMSNorm, RoPE (with Llama-3 scaling), GQA attention
(masked, or flash inside packed segments)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.models.config import LlamaConfig
from pallas_kernels.attention import flash_supported, segment_attention
from pallas_kernels.ops import kernel_style


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., d] normalised in float32, scaled by weight [d], returned in x's dtype (as HF does)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


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


def rope_inverse_frequencies(config: LlamaConfig) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies, with Llama-3 or linear scaling if configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "linear":  # position interpolation
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None:
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


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding in HF's half-split layout. x [B, T, H, Dh]; positions [B, T]."""
    angles = positions.astype(jnp.float32)[:, :, None] * inv_freq  # [B, T, Dh/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention.

    Args:
      q: [B, T, H, Dh]; k, v: [B, S, Hkv, Dh] with H a multiple of Hkv.
      mask: [B, T, S] bool, True where query t may attend to key s.

    Returns:
      [B, T, H, Dh] in q's dtype. A query with no allowed key gets a uniform average (never NaN).
    """
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    grouped = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", grouped, k, preferred_element_type=jnp.float32)
    scores = scores * (head_dim**-0.5)
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


def packed_attention(segment_ids: jax.Array, head_dim: int, impl: str = "auto") -> jax.Array | PackedSegments:
    """What `attend` needs for packed rows (segment_ids [B, T]): a flash `PackedSegments` or the
    [B, T, T] bool mask. impl "auto": flash on GPU/TPU where the kernel takes the shape, else masked;
    "flash" forces the kernel (interpret mode on CPU); "masked" the XLA softmax over a full mask."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    length = segment_ids.shape[1]
    if impl == "auto":
        on_accelerator = kernel_style(off_accelerator=None) is not None
        impl = "flash" if on_accelerator and flash_supported(length, head_dim) else "masked"
    if impl == "flash":
        return PackedSegments(segment_ids.astype(jnp.int32), kernel_style())
    causal = jnp.tril(jnp.ones((length, length), bool))[None]
    return causal & (segment_ids[:, :, None] == segment_ids[:, None, :])


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | PackedSegments) -> jax.Array:
    """`attention` with a bool mask [B, T, S], or the flash kernel for `PackedSegments`."""
    if isinstance(mask, PackedSegments):
        return segment_attention(q, k, v, mask.segment_ids, impl=mask.impl)
    return attention(q, k, v, mask)
