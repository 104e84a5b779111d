"""Pure-jnp reference of the fused (multi-)LoRA linear layer, in the caller's row layout.

y[i] = x[i] @ W + s_i * (dropout_i(x[i]) @ A_i[:, :r_i]) @ B_i[:r_i]   (slot -1: y = x @ W)

with adapter i = seg_slot of the segment holding row i (rows outside every segment: base only)
and the same (seed, row, column) dropout hash as the kernels, so the masks agree exactly.
Differentiable with plain JAX autodiff: its gradients are the reference for the kernels'
custom_vjp. Roundings mirror the kernels: f32 accumulation, S = dropout(x) @ A rounded to
x.dtype, y rounded once.
"""

import jax.numpy as jnp

from pallas_kernels.fused_lora_layout import dropout_inv_keep, dropout_keep, dropout_threshold

_F32 = jnp.float32
_I32 = jnp.int32


def row_slots(seg_starts, seg_slot, num_rows: int):
    """Adapter slot of every row ([num_rows] int32, -1 outside segments or for slot -1)."""
    num_segments = seg_slot.shape[0]
    rows = jnp.arange(num_rows, dtype=_I32)
    starts = jnp.clip(seg_starts.astype(_I32), 0, num_rows)
    seg = jnp.searchsorted(starts, rows, side="right").astype(_I32) - 1
    inside = (seg >= 0) & (seg < num_segments)
    slot = seg_slot.astype(_I32)[jnp.clip(seg, 0, num_segments - 1)]
    return jnp.where(inside, slot, -1)


def fused_lora_linear_reference(x, w, lora_a, lora_b, seg_starts, seg_slot, slot_rank,
                                slot_scale, slot_dropout, seed):
    """x [m, k], w [k, n], lora_a [P, k, r], lora_b [P, r, n] -> y [m, n] (x.dtype)."""
    m, k = x.shape
    num_slots, _, r_max = lora_a.shape
    dtype = x.dtype
    slot = row_slots(seg_starts, seg_slot, m)
    safe = jnp.clip(slot, 0, num_slots - 1)
    rank = jnp.where(slot >= 0, slot_rank.astype(_I32)[safe], 0)
    scale = jnp.where(slot >= 0, slot_scale.astype(_F32)[safe], 0.0)
    p = jnp.where(slot >= 0, slot_dropout.astype(_F32)[safe], 0.0)

    rows = jnp.arange(m, dtype=_I32)[:, None]
    cols = jnp.arange(k, dtype=_I32)[None, :]
    keep = dropout_keep(jnp.asarray(seed, _I32), rows, cols, dropout_threshold(p)[:, None])
    x_masked = jnp.where(keep, x, jnp.zeros((), dtype))

    a_flat = jnp.transpose(lora_a.astype(dtype), (1, 0, 2)).reshape(k, num_slots * r_max)
    s_all = jnp.dot(x_masked, a_flat, preferred_element_type=_F32).reshape(m, num_slots, r_max)
    s = jnp.take_along_axis(s_all, safe[:, None, None], axis=1)[:, 0]
    live = (jnp.arange(r_max, dtype=_I32)[None, :] < rank[:, None]) & (slot >= 0)[:, None]
    s = jnp.where(live, s * dropout_inv_keep(p)[:, None], 0.0).astype(dtype)

    onehot = (jnp.arange(num_slots, dtype=_I32)[None, :] == slot[:, None]).astype(dtype)
    s_routed = (onehot[:, :, None] * s[:, None, :]).reshape(m, num_slots * r_max)
    delta = jnp.dot(s_routed, lora_b.astype(dtype).reshape(num_slots * r_max, -1),
                    preferred_element_type=_F32)
    base = jnp.dot(x, w.astype(dtype), preferred_element_type=_F32)
    return (base + scale[:, None] * delta).astype(dtype)


def fused_lora_linear_single_reference(x, w, a, b, scale, dropout, seed):
    """Single adapter: x [m, k], a [k, r], b [r, n] (all rows use it)."""
    m = x.shape[0]
    return fused_lora_linear_reference(
        x, w, a[None], b[None], jnp.array([0, m], _I32), jnp.zeros((1,), _I32),
        jnp.array([a.shape[1]], _I32), jnp.reshape(jnp.asarray(scale, _F32), (1,)),
        jnp.reshape(jnp.asarray(dropout, _F32), (1,)), seed)
