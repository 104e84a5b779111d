"""Differentiable segmented LoRA delta: delta[seg] = scale * (x[seg] @ A[slot]) @ B[slot].

Forward: SGMV shrink then expand (into zeros). Backward (custom_vjp; a pallas_call has no
transpose rule), all with the same kernels:
    dv_u = g @ B[slot]^T            (shrink over the transposed B pool, rank-masked)
    dv   = scale * dv_u
    dx   = dv @ A[slot]^T           (expand over the transposed A pool, scale 1)
    dA[slot] += x[seg]^T dv[seg]    (segment_outer, then scatter-add segments to slots)
    dB[slot] += scale * v[seg]^T g[seg]
    dscale[seg] = sum over seg rows of <v, dv_u>
The transposed pools are copies ([slots, k, r_max] and [slots, r_max, n]); the per-segment
gradients are materialised as [S, k, r_max] / [S, r_max, n] f32 before the scatter.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch, reference
from pallas_kernels.routing import row_segments
from pallas_kernels.tiles import TileConfig


class _Choice(NamedTuple):
    impl: str
    tiles: TileConfig | None


def sgmv_lora_delta(x, lora_a, lora_b, seg_starts, seg_slot, seg_rank, seg_scale, *,
                    impl=None, tiles=None):
    """delta[seg] = scale * (x[seg] @ A[slot]) @ B[slot] (rank-masked; 0 for slot -1/padding).

    x [T, k], lora_a [slots, k, r_max], lora_b [slots, r_max, n], seg_starts int32 [S+1],
    seg_slot/seg_rank int32 [S], seg_scale float32 [S] -> [T, n] (x.dtype).
    Differentiable in x, lora_a, lora_b and seg_scale.
    """
    style, _ = dispatch.resolve_impl(impl)
    if style == "reference":
        return reference.sgmv_lora_delta_ref(x, lora_a, lora_b, seg_starts, seg_slot, seg_rank,
                                             seg_scale)
    return _lora_delta(x, lora_a, lora_b, seg_starts, seg_slot, seg_rank, seg_scale,
                       _Choice(style, tiles))


def _forward(x, lora_a, lora_b, seg_starts, seg_slot, seg_rank, seg_scale, choice):
    kw = dict(impl=choice.impl, tiles=choice.tiles)
    v = dispatch.sgmv_shrink(x, lora_a, seg_starts, seg_slot, seg_rank, **kw)
    y = jnp.zeros((x.shape[0], lora_b.shape[-1]), x.dtype)
    return dispatch.sgmv_expand(y, v, lora_b, seg_starts, seg_slot, seg_rank, seg_scale, **kw), v


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _lora_delta(x, lora_a, lora_b, seg_starts, seg_slot, seg_rank, seg_scale, choice):
    return _forward(x, lora_a, lora_b, seg_starts, seg_slot, seg_rank, seg_scale, choice)[0]


def _lora_delta_fwd(x, lora_a, lora_b, seg_starts, seg_slot, seg_rank, seg_scale, choice):
    delta, v = _forward(x, lora_a, lora_b, seg_starts, seg_slot, seg_rank, seg_scale, choice)
    return delta, (x, lora_a, lora_b, v, seg_starts, seg_slot, seg_rank, seg_scale)


def _scatter_to_slots(per_segment, seg_slot, num_slots: int):
    """Sum [S, ...] per-segment gradients into [num_slots, ...]; slot -1 is dropped."""
    index = jnp.where(seg_slot >= 0, seg_slot, num_slots)
    out = jnp.zeros((num_slots,) + per_segment.shape[1:], per_segment.dtype)
    return out.at[index].add(per_segment, mode="drop")


def _scale_grad(v, dv_u, seg_starts, seg_slot):
    seg, valid = row_segments(seg_starts, v.shape[0])
    per_row = jnp.sum(v.astype(jnp.float32) * dv_u.astype(jnp.float32), axis=-1)
    per_row = jnp.where(valid, per_row, 0.0)
    grad = jax.ops.segment_sum(per_row, seg, num_segments=seg_slot.shape[0])
    return jnp.where(seg_slot >= 0, grad, 0.0)


def _lora_delta_bwd(choice, residuals, g):
    x, lora_a, lora_b, v, seg_starts, seg_slot, seg_rank, seg_scale = residuals
    kw = dict(impl=choice.impl, tiles=choice.tiles)
    meta = (seg_starts, seg_slot, seg_rank)
    g = g.astype(x.dtype)
    dv_u = dispatch.sgmv_shrink(g, jnp.swapaxes(lora_b, 1, 2), *meta, **kw)
    row_scale = reference.row_adapters(*meta, seg_scale, x.shape[0])[2]
    dv = (dv_u.astype(jnp.float32) * row_scale[:, None]).astype(x.dtype)
    ones = jnp.ones_like(seg_scale, dtype=jnp.float32)
    dx = dispatch.sgmv_expand(jnp.zeros_like(x), dv, jnp.swapaxes(lora_a, 1, 2), *meta, ones, **kw)
    da_seg = dispatch.segment_outer(x, dv, *meta, rank_axis=1, **kw)
    db_seg = dispatch.segment_outer(v, g, *meta, rank_axis=0, **kw)
    db_seg = db_seg * seg_scale.astype(jnp.float32)[:, None, None]
    num_slots = lora_a.shape[0]
    d_a = _scatter_to_slots(da_seg, seg_slot, num_slots).astype(lora_a.dtype)
    d_b = _scatter_to_slots(db_seg, seg_slot, num_slots).astype(lora_b.dtype)
    d_scale = _scale_grad(v, dv_u, seg_starts, seg_slot).astype(seg_scale.dtype)
    return dx, d_a, d_b, None, None, None, d_scale


_lora_delta.defvjp(_lora_delta_fwd, _lora_delta_bwd)
