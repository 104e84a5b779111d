"""TPU (Pallas -> Mosaic) SGMV kernels: shrink, expand and the per-segment outer product.

Megablox `gmm` style: the segment metadata and the routing work list (`TileRouting.work_tile`,
`work_seg`, `work_out_seg`) are scalar-prefetched into SMEM and drive the BlockSpec index maps.
The grid walks the work list sequentially; the (tile, segment) items of one row tile are
consecutive, so the output tile stays in a VMEM f32 accumulator while it is revisited: zeroed
(or loaded from y) on the first visit, written on the last. Rows outside the item's segment
are masked, so tiles may straddle segment boundaries.

Mixed ranks (S-LoRA MBGMM): the rank axis is a grid axis of `rank_chunk`-wide blocks; blocks
at or beyond a segment's rank skip their matmul, and their index maps clamp to the last live
block so the pipeline issues no new DMA for them.

Inputs arrive padded by the dispatcher (rows, k, n, r_max to multiples of their blocks). Only
checked in interpret mode here; Mosaic needs block_rows % 8 == 0 and lane blocks that are
multiples of 128 or the full dimension (the TPU tile heuristic picks such blocks).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.routing import TileRouting
from pallas_kernels.tiles import TileConfig

_F32 = jnp.float32


def _params(*semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _segment(s, starts, slots, ranks):
    """(start, end, slot clamped to >= 0, rank, active) of segment s (s >= 0)."""
    start, end, slot = starts[s], starts[s + 1], slots[s]
    return start, end, jnp.maximum(slot, 0), ranks[s], (slot >= 0) & (end > start)


def _item_segment(w, work_seg):
    seg = work_seg[w]
    return jnp.maximum(seg, 0), seg >= 0


def _live_rank_block(j, rank, rank_block):
    """Rank block to fetch at grid step j: j clamped to the last block below rank."""
    last = jnp.maximum((rank + rank_block - 1) // rank_block - 1, 0)
    return jnp.minimum(j, last)


def _visit_bounds(w, owner, num_items):
    """(first, last): is item w the first / last consecutive item with owner[w]?"""
    prev = owner[jnp.maximum(w - 1, 0)]
    nxt = owner[jnp.minimum(w + 1, num_items - 1)]
    return (w == 0) | (prev != owner[w]), (w == num_items - 1) | (nxt != owner[w])


def _mask(shape, row0, start, end, col0=0, col_limit=None):
    rows = row0 + lax.broadcasted_iota(jnp.int32, shape, 0)
    mask = (rows >= start) & (rows < end)
    if col_limit is not None:
        mask &= (col0 + lax.broadcasted_iota(jnp.int32, shape, 1)) < col_limit
    return mask


def _shrink_kernel(starts, slots, ranks, work_tile, work_seg, x_ref, a_ref, out_ref, acc_ref,
                   *, cfg: TileConfig, num_items: int, num_k_blocks: int):
    j, w, kk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    s, has_seg = _item_segment(w, work_seg)
    start, end, _, rank, active = _segment(s, starts, slots, ranks)
    first, last = _visit_bounds(w, work_tile, num_items)

    @pl.when(first & (kk == 0))
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(has_seg & active & (j * cfg.rank_chunk < rank))
    def _accumulate():
        prod = jnp.dot(x_ref[...], a_ref[...], preferred_element_type=_F32)
        mask = _mask(prod.shape, work_tile[w] * cfg.block_rows, start, end,
                     j * cfg.rank_chunk, rank)
        acc_ref[...] += jnp.where(mask, prod, 0.0)

    @pl.when(last & (kk == num_k_blocks - 1))
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def sgmv_shrink_tpu(x, lora_a, seg_starts, seg_slot, seg_rank, routing: TileRouting,
                    cfg: TileConfig, interpret: bool):
    """v = x @ A[slot] per segment. x [T, k], lora_a [slots, k, r] -> v [T, r] (x.dtype)."""
    num_rows, k = x.shape
    r_max = lora_a.shape[-1]
    bm, bk, rb = cfg.block_rows, cfg.block_k, cfg.rank_chunk
    num_items = routing.work_tile.shape[0]

    def x_map(j, w, kk, starts, slots, ranks, work_tile, work_seg):
        return work_tile[w], kk

    def a_map(j, w, kk, starts, slots, ranks, work_tile, work_seg):
        s, _ = _item_segment(w, work_seg)
        return jnp.maximum(slots[s], 0), kk, _live_rank_block(j, ranks[s], rb)

    def out_map(j, w, kk, starts, slots, ranks, work_tile, work_seg):
        return work_tile[w], j

    kernel = functools.partial(_shrink_kernel, cfg=cfg, num_items=num_items,
                               num_k_blocks=k // bk)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, r_max), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(r_max // rb, num_items, k // bk),
            in_specs=[pl.BlockSpec((bm, bk), x_map), pl.BlockSpec((None, bk, rb), a_map)],
            out_specs=pl.BlockSpec((bm, rb), out_map),
            scratch_shapes=[pltpu.VMEM((bm, rb), _F32)],
        ),
        compiler_params=_params("parallel", "arbitrary", "arbitrary"),
        interpret=interpret,
    )(seg_starts, seg_slot, seg_rank, routing.work_tile, routing.work_seg, x, lora_a)


def _expand_kernel(starts, slots, ranks, scales, work_tile, work_seg, y_ref, v_ref, b_ref,
                   out_ref, acc_ref, *, cfg: TileConfig, num_items: int, num_rank_blocks: int):
    jn, w, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    s, has_seg = _item_segment(w, work_seg)
    start, end, _, rank, active = _segment(s, starts, slots, ranks)
    first, last = _visit_bounds(w, work_tile, num_items)
    rc = cfg.rank_chunk

    @pl.when(first & (j == 0))
    def _load_y():
        acc_ref[...] = y_ref[...].astype(_F32)

    @pl.when(has_seg & active & (j * rc < rank))
    def _accumulate():
        v_blk = jnp.where(_mask(v_ref.shape, 0, 0, v_ref.shape[0], j * rc, rank), v_ref[...], 0)
        b_rows = (j * rc + lax.broadcasted_iota(jnp.int32, b_ref.shape, 0)) < rank
        b_blk = jnp.where(b_rows, b_ref[...], 0)
        delta = jnp.dot(v_blk, b_blk, preferred_element_type=_F32)
        rows = _mask(delta.shape, work_tile[w] * cfg.block_rows, start, end)
        acc_ref[...] += jnp.where(rows, scales[s] * delta, 0.0)

    @pl.when(last & (j == num_rank_blocks - 1))
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def sgmv_expand_tpu(y, v, lora_b, seg_starts, seg_slot, seg_rank, seg_scale,
                    routing: TileRouting, cfg: TileConfig, interpret: bool):
    """y += scale * v @ B[slot] per segment, in place (y aliased to the output).

    y [T, n], v [T, r], lora_b [slots, r, n] -> [T, n] (y.dtype).
    """
    n = y.shape[1]
    bm, bn, rb = cfg.block_rows, cfg.block_n, cfg.rank_chunk
    num_items = routing.work_tile.shape[0]
    num_rank_blocks = lora_b.shape[1] // rb

    def y_map(jn, w, j, starts, slots, ranks, scales, work_tile, work_seg):
        return work_tile[w], jn

    def v_map(jn, w, j, starts, slots, ranks, scales, work_tile, work_seg):
        s, _ = _item_segment(w, work_seg)
        return work_tile[w], _live_rank_block(j, ranks[s], rb)

    def b_map(jn, w, j, starts, slots, ranks, scales, work_tile, work_seg):
        s, _ = _item_segment(w, work_seg)
        return jnp.maximum(slots[s], 0), _live_rank_block(j, ranks[s], rb), jn

    kernel = functools.partial(_expand_kernel, cfg=cfg, num_items=num_items,
                               num_rank_blocks=num_rank_blocks)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(n // bn, num_items, num_rank_blocks),
            in_specs=[
                pl.BlockSpec((bm, bn), y_map),
                pl.BlockSpec((bm, rb), v_map),
                pl.BlockSpec((None, rb, bn), b_map),
            ],
            out_specs=pl.BlockSpec((bm, bn), y_map),
            scratch_shapes=[pltpu.VMEM((bm, bn), _F32)],
        ),
        input_output_aliases={6: 0},
        compiler_params=_params("parallel", "arbitrary", "arbitrary"),
        interpret=interpret,
    )(seg_starts, seg_slot, seg_rank, seg_scale, routing.work_tile, routing.work_seg, y, v, lora_b)


def _outer_kernel(starts, slots, ranks, work_tile, work_seg, work_out_seg, lhs_ref, rhs_ref,
                  out_ref, acc_ref, *, cfg: TileConfig, num_items: int, rank_axis: int):
    ip, iq, w = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    s, has_seg = _item_segment(w, work_seg)
    start, end, _, rank, active = _segment(s, starts, slots, ranks)
    first, last = _visit_bounds(w, work_out_seg, num_items)
    rank_block_start = (ip * cfg.block_k, iq * cfg.block_n)[rank_axis]

    @pl.when(first)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(has_seg & active & (rank_block_start < rank))
    def _accumulate():
        row0 = work_tile[w] * cfg.block_rows
        if rank_axis == 0:
            rows = _mask(lhs_ref.shape, row0, start, end, ip * cfg.block_k, rank)
            rhs = rhs_ref[...]
        else:
            rows = _mask(lhs_ref.shape, row0, start, end)
            rhs_live = _mask(rhs_ref.shape, 0, 0, rhs_ref.shape[0], iq * cfg.block_n, rank)
            rhs = jnp.where(rhs_live, rhs_ref[...], 0)
        lhs = jnp.where(rows, lhs_ref[...], 0)
        acc_ref[...] += lax.dot_general(lhs, rhs, (((0,), (0,)), ((), ())),
                                        preferred_element_type=_F32)

    @pl.when(last)
    def _store():
        out_ref[...] = acc_ref[...]


def segment_outer_tpu(lhs, rhs, seg_starts, seg_slot, seg_rank, rank_axis: int,
                      routing: TileRouting, cfg: TileConfig, interpret: bool):
    """out[s] = lhs[seg s]^T @ rhs[seg s] (f32); zero for slot -1 / empty segments and at
    indices >= the segment's rank along `rank_axis` (0: p, 1: q; whole blocks there are skipped).

    lhs [T, p], rhs [T, q] -> [S, p, q] float32.
    """
    p, q = lhs.shape[1], rhs.shape[1]
    bm, bp, bq = cfg.block_rows, cfg.block_k, cfg.block_n
    num_items = routing.work_tile.shape[0]

    def lhs_map(ip, iq, w, starts, slots, ranks, work_tile, work_seg, work_out_seg):
        return work_tile[w], ip

    def rhs_map(ip, iq, w, starts, slots, ranks, work_tile, work_seg, work_out_seg):
        return work_tile[w], iq

    def out_map(ip, iq, w, starts, slots, ranks, work_tile, work_seg, work_out_seg):
        return work_out_seg[w], ip, iq

    kernel = functools.partial(_outer_kernel, cfg=cfg, num_items=num_items, rank_axis=rank_axis)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((seg_slot.shape[0], p, q), _F32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(p // bp, q // bq, num_items),
            in_specs=[pl.BlockSpec((bm, bp), lhs_map), pl.BlockSpec((bm, bq), rhs_map)],
            out_specs=pl.BlockSpec((None, bp, bq), out_map),
            scratch_shapes=[pltpu.VMEM((bp, bq), _F32)],
        ),
        compiler_params=_params("parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(seg_starts, seg_slot, seg_rank, routing.work_tile, routing.work_seg, routing.work_out_seg,
      lhs, rhs)
    # Segments that no work item visits (e.g. empty ones) were never written.
    visited = (seg_slot >= 0) & (seg_starts[1:] > seg_starts[:-1])
    return jnp.where(visited[:, None, None], out, 0.0)
