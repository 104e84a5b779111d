"""Stateless building blocks of the Llama family: RMSNorm, RoPE (with Llama-3 scaling), GQA attention."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.models.config import LlamaConfig


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., d] normalised in float32, scaled by weight [d], returned in x's dtype (as HF does)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope_inverse_frequencies(config: LlamaConfig) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies, with Llama-3 scaling if configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling
    if scaling is not None:
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
