"""GPU (Pallas -> Triton) flash attention for packed rows that skips the blocks across samples.

A packed row holds several samples; query t attends to key s iff s <= t and both lie in the same
segment (segment_ids equal). JAX's Pallas flash kernel (`jax.experimental.pallas.ops.gpu.attention`,
which this file follows) skips only the blocks above the diagonal: in a 4096-token row of
~500-token samples it still walks every lower block, and most of them are fully masked.

Here each program first reads the span its rows can reach and loops over those blocks only:
- forward and dQ: a query block's keys start at the first position of the earliest segment among
  its rows (`first[t]` = the smallest s with segment_ids[s] == segment_ids[t]) and end at the
  diagonal;
- dK/dV: a key block's queries start at the diagonal and end at the last position of the latest
  segment among its keys (`last[s]`).
`segment_spans` derives first/last from the ids by one stable sort, so any id layout is exact
(segments need not be contiguous; they only skip more when they are).

Grouped-query attention is read in place: query head h uses key/value head h // (H // Hkv) through
the BlockSpec index maps (no repeated K/V copies); dK/dV come out per query head and are summed
over the group.

A sliding window (`window`: int32 [1], or None) also masks keys with t - s >= window (by index:
a sample's tokens are contiguous) and narrows each loop to the blocks the window reaches.

Shapes: q [B, T, H, D]; k, v [B, T, Hkv, D]; segment_ids int32 [B, T]; D a power of two and T a
multiple of the tiles. Softmax in base 2 (scores scaled by log2(e) * sm_scale); the residual lse
[B, H, T] is in that base.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_LOG2E = math.log2(math.e)


def segment_spans(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """segment_ids [B, T] -> (first, last) int32 [B, T]: the smallest and the largest position
    holding the same id as position t."""
    return jax.vmap(_spans_of_row)(segment_ids.astype(jnp.int32))


def _spans_of_row(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    length = ids.shape[0]
    order = jnp.argsort(ids, stable=True)  # positions grouped by id, ascending inside a group
    sorted_ids = ids[order]
    position = jnp.arange(length, dtype=jnp.int32)
    boundary = sorted_ids[1:] != sorted_ids[:-1]
    starts = jnp.concatenate([jnp.ones(1, bool), boundary])
    ends = jnp.concatenate([boundary, jnp.ones(1, bool)])
    group_start = lax.cummax(jnp.where(starts, position, 0))
    group_end = lax.cummin(jnp.where(ends, position, length - 1), reverse=True)
    inverse = jnp.zeros(length, jnp.int32).at[order].set(position)
    first = order[group_start][inverse]
    last = order[group_end][inverse]
    return first.astype(jnp.int32), last.astype(jnp.int32)


def _scores(q, k, q_ids, k_ids, q_span, k_span, sm_scale, window=None):
    """Base-2 scaled scores [bq, bk] of one tile with the causal + segment (+ window) mask applied."""
    qk = plt.dot(q, k.T) * (sm_scale * _LOG2E)
    mask = (q_ids[:, None] == k_ids[None, :]) & (q_span[:, None] >= k_span[None, :])
    if window is not None:
        mask = mask & (q_span[:, None] - k_span[None, :] < window)
    return jnp.where(mask, qk, MASK_VALUE)


def _window_of(refs, windowed: bool, length: int):
    """(window scalar clamped to T, or None; the remaining refs): the window ref, when there is one,
    is the last input."""
    if not windowed:
        return None, refs
    return jnp.minimum(refs[0][0], length), refs[1:]


def _forward_kernel(q_ref, k_ref, v_ref, ids_ref, first_ref, *refs, sm_scale, block_q, block_k, windowed):
    """One (query block, batch, head) program: o [block_q, D], lse [block_q]."""
    window, (o_ref, lse_ref) = _window_of(refs, windowed, k_ref.shape[0])
    start_q = pl.program_id(0)
    q_slice = pl.ds(start_q * block_q, block_q)
    q = q_ref[...]
    q_ids = ids_ref[q_slice]
    q_span = start_q * block_q + jnp.arange(block_q)

    def body(start_k, carry):
        o, m, l = carry
        k_slice = pl.ds(start_k * block_k, block_k)
        qk = _scores(q, k_ref[k_slice, :], q_ids, ids_ref[k_slice], q_span,
                     start_k * block_k + jnp.arange(block_k), sm_scale, window)
        m_next = jnp.maximum(m, jnp.max(qk, axis=-1))
        correction = jnp.exp2(m - m_next)
        p = jnp.exp2(qk - m_next[:, None])
        o = correction[:, None] * o + plt.dot(p.astype(v_ref.dtype), v_ref[k_slice, :])
        return o, m_next, correction * l + p.sum(axis=-1)

    lower = lax.div(jnp.min(first_ref[q_slice]), block_k)
    if window is not None:  # the block's first query sees keys from start - window + 1 on
        lower = jnp.maximum(lower, lax.div(jnp.maximum(start_q * block_q - window + 1, 0), block_k))
    upper = lax.div(block_q * (start_q + 1) + block_k - 1, block_k)
    init = (jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32),
            jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32))
    o, m, l = lax.fori_loop(lower, upper, body, init)
    o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log2(l)


def _kv_head_map(group: int):
    """Index map of a whole-row K/V block for grid (.., b, h) programs: key/value head h // group."""
    return lambda _, b, h: (b, 0, lax.div(h, group), 0)


def _forward(q, k, v, segment_ids, first, window, sm_scale, block_q, block_k, num_warps, num_stages, interpret):
    batch, length, heads, head_dim = q.shape
    group = heads // k.shape[2]
    row = pl.BlockSpec((None, length, None, head_dim), _kv_head_map(group))
    ids_spec = pl.BlockSpec((None, length), lambda _, b, h: (b, 0))
    kernel = functools.partial(_forward_kernel, sm_scale=sm_scale, block_q=block_q, block_k=block_k,
                               windowed=window is not None)
    extra, extra_specs = _window_inputs(window)
    return pl.pallas_call(
        kernel,
        grid=(length // block_q, batch, heads),
        in_specs=[pl.BlockSpec((None, block_q, None, head_dim), lambda i, b, h: (b, i, h, 0)),
                  row, row, ids_spec, ids_spec, *extra_specs],
        out_specs=[pl.BlockSpec((None, block_q, None, head_dim), lambda i, b, h: (b, i, h, 0)),
                   pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, heads, length), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=num_warps or (4 if head_dim <= 64 else 8),
                                           num_stages=num_stages),
        interpret=interpret,
        name="segment_flash_forward",
    )(q, k, v, segment_ids, first, *extra)


def _window_inputs(window):
    """(extra inputs, their BlockSpecs): the window [1] whole, or nothing."""
    if window is None:
        return [], []
    return [window], [pl.BlockSpec((1,), lambda *_: (0,))]


def _backward_kernel(q_ref, k_ref, v_ref, ids_ref, first_ref, last_ref, do_ref, lse_ref, delta_ref,
                     *refs, sm_scale, block, windowed):
    """One (batch, head, block) program: dK/dV of key block `block` (over the queries that can see
    it), then dQ of query block `block` (over the keys it can see)."""
    length = q_ref.shape[0]
    window, (dq_ref, dk_ref, dv_ref) = _window_of(refs, windowed, length)
    index = pl.program_id(2)
    here = pl.ds(index * block, block)
    span = index * block + jnp.arange(block)

    k, v, k_ids = k_ref[here, :], v_ref[here, :], ids_ref[here]

    def dkdv_body(start_q, carry):
        dk, dv = carry
        q_slice = pl.ds(start_q * block, block)
        q, do = q_ref[q_slice, :], do_ref[q_slice, :]
        qk = _scores(q, k, ids_ref[q_slice], k_ids, start_q * block + jnp.arange(block), span, sm_scale, window)
        p = jnp.exp2(qk - lse_ref[q_slice][:, None])
        dv = dv + plt.dot(p.astype(do.dtype).T, do)
        ds = p * (plt.dot(do, v.T) - delta_ref[q_slice][:, None]) * sm_scale
        return dk + plt.dot(ds.astype(q.dtype).T, q), dv

    zeros = jnp.zeros((block, q_ref.shape[-1]), jnp.float32)
    q_upper = jnp.minimum(lax.div(jnp.max(last_ref[here]), block) + 1, length // block)
    if window is not None:  # the block's last key is seen up to query index * block + block - 2 + window
        q_upper = jnp.minimum(q_upper, lax.div(index * block + block - 2 + window, block) + 1)
    dk, dv = lax.fori_loop(index, q_upper, dkdv_body, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)

    q, do, q_ids = q_ref[here, :], do_ref[here, :], ids_ref[here]
    lse, delta = lse_ref[here], delta_ref[here]

    def dq_body(start_k, dq):
        k_slice = pl.ds(start_k * block, block)
        k = k_ref[k_slice, :]
        qk = _scores(q, k, q_ids, ids_ref[k_slice], span, start_k * block + jnp.arange(block), sm_scale, window)
        p = jnp.exp2(qk - lse[:, None])
        ds = p * (plt.dot(do, v_ref[k_slice, :].T) - delta[:, None]) * sm_scale
        return dq + plt.dot(ds.astype(k.dtype), k)

    k_lower = lax.div(jnp.min(first_ref[here]), block)
    if window is not None:
        k_lower = jnp.maximum(k_lower, lax.div(jnp.maximum(index * block - window + 1, 0), block))
    dq = lax.fori_loop(k_lower, index + 1, dq_body, zeros)
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _backward(q, k, v, segment_ids, first, last, window, out, lse, do, sm_scale, block, num_warps, interpret):
    """dq [B, T, H, D]; dk, dv [B, T, Hkv, D] (per query head in the kernel, summed over the group)."""
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), do.astype(jnp.float32))
    full_row = pl.BlockSpec((None, length, None, head_dim), lambda b, h, _: (b, 0, h, 0))
    kv_row = pl.BlockSpec((None, length, None, head_dim), lambda b, h, _: (b, 0, lax.div(h, group), 0))
    ids_spec = pl.BlockSpec((None, length), lambda b, h, _: (b, 0))
    per_head = pl.BlockSpec((None, None, length), lambda b, h, _: (b, h, 0))
    tile = pl.BlockSpec((None, block, None, head_dim), lambda b, h, i: (b, i, h, 0))
    kernel = functools.partial(_backward_kernel, sm_scale=sm_scale, block=block, windowed=window is not None)
    extra, extra_specs = _window_inputs(window)
    grad_dtype = jnp.float32 if group > 1 else k.dtype
    dq, dk, dv = pl.pallas_call(
        kernel,
        grid=(batch, heads, length // block),
        in_specs=[full_row, kv_row, kv_row, ids_spec, ids_spec, ids_spec, full_row, per_head, per_head, *extra_specs],
        out_specs=[tile, tile, tile],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape, grad_dtype),
                   jax.ShapeDtypeStruct(q.shape, grad_dtype)],
        compiler_params=plt.CompilerParams(num_warps=num_warps or (4 if block < 128 else 8), num_stages=2),
        interpret=interpret,
        name="segment_flash_backward",
    )(q, k, v, segment_ids, first, last, do, lse, delta, *extra)
    if group > 1:
        fold = lambda g: g.reshape(batch, length, kv_heads, group, head_dim).sum(3).astype(k.dtype)
        dk, dv = fold(dk), fold(dv)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10, 11))
def segment_flash_gpu(q, k, v, segment_ids, window, sm_scale: float, block_q: int, block_k: int,
                      block_backward: int, num_warps: int | None, num_stages: int, interpret):
    """Causal flash attention inside packed segments (window: int32 [1] or None); shapes in the
    module docstring. Returns [B, T, H, D] in q's dtype."""
    return _vjp_forward(q, k, v, segment_ids, window, sm_scale, block_q, block_k, block_backward, num_warps,
                        num_stages, interpret)[0]


def _vjp_forward(q, k, v, segment_ids, window, sm_scale, block_q, block_k, block_backward, num_warps, num_stages,
                 interpret):
    first, last = segment_spans(segment_ids)
    out, lse = _forward(q, k, v, segment_ids, first, window, sm_scale, block_q, block_k, num_warps, num_stages,
                        interpret)
    return out, (q, k, v, segment_ids, window, first, last, out, lse)


def _vjp_backward(sm_scale, block_q, block_k, block_backward, num_warps, num_stages, interpret, saved, do):
    q, k, v, segment_ids, window, first, last, out, lse = saved
    dq, dk, dv = _backward(q, k, v, segment_ids, first, last, window, out, lse, do, sm_scale, block_backward,
                           num_warps, interpret)
    return dq, dk, dv, None, None


segment_flash_gpu.defvjp(_vjp_forward, _vjp_backward)
