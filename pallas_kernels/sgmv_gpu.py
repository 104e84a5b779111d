"""GPU (Pallas -> Triton) SGMV kernels: shrink, expand and the per-segment outer product.

Layout: one program per row tile (x split-K programs for shrink / column blocks for expand).
Each program loops over the segments overlapping its tile (`TileRouting.tile_seg_lo/hi`) and
masks the rows outside the current segment, so tiles may straddle segment boundaries and x/y
are never relaid out. Metadata is passed as whole int32 arrays (Triton has no scalar prefetch)
and clipped inside the kernels (no XLA pre-pass: each extra launch costs microseconds).

Shrink (Punica/vLLM split-K): grid (row tiles, k_splits); each program reduces its share of
the k blocks and writes f32 partial sums [k_splits, T, r_max]. The expand sums the partials
while it loads v (`sgmv_expand_gpu` takes v as [parts, T, r] or [T, r]), so the fused
shrink -> expand pipeline (`ops.sgmv_lora`) is two launches and no reduction pass.
Inactive segments (slot -1, empty, rank 0) get a zero trip count instead of a branch, and the
first rank chunk runs unconditionally, so the k loop of a uniform-rank pool (rank_chunk ==
r_max) has no branch in it and Triton can software-pipeline its loads (num_stages).

Mixed ranks (S-LoRA MBGMM): the rank axis is cut into static chunks of `rank_chunk` (>= 16,
Triton dot dims) and chunks after the first run under `lax.cond(chunk_start < rank)`, so a
rank-8 segment in an r_max=64 pool reads and multiplies one 16-wide chunk of A/B, not 64.

Expand writes y in place (input/output aliasing): under jit with y produced in the same
computation (the base projection) or donated, no copy of y is made.

Stacked pools (the serving engine's layer scan): with `slot_offset` (int32 [1]) given, segment
s uses entry `seg_slot[s] + slot_offset` of A/B [P, ., .] (P = layers x slots, the pool's stack
reshaped, so no layer slice is copied) and reads its rank and scale from per-entry tables
[P] at that entry instead of per-segment arrays.

Inputs arrive padded by the dispatcher: rows to a multiple of block_rows, k/n to multiples of
block_k/block_n, r_max to a multiple of rank_chunk.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.routing import TileRouting
from pallas_kernels.tiles import TileConfig

_F32 = jnp.float32


def _params(cfg: TileConfig):
    return plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _segment(seg, starts_ref, slot_ref, rank_ref, num_rows: int, r_max: int, offset_ref=None):
    """(start, end, A/B entry, rank clipped to [0, r_max], active) of `seg`: entry = slot clamped
    to >= 0 (+ offset_ref[0] for a stacked pool, whose rank table is indexed by entry)."""
    start = jnp.clip(starts_ref[seg], 0, num_rows)
    end = jnp.clip(starts_ref[seg + 1], 0, num_rows)
    slot = slot_ref[seg]
    entry = jnp.maximum(slot, 0) + (0 if offset_ref is None else offset_ref[0])
    rank = jnp.clip(rank_ref[seg if offset_ref is None else entry], 0, r_max)
    return start, end, entry, rank, (slot >= 0) & (end > start) & (rank > 0)


def _offset_args(slot_offset):
    """(extra kernel inputs, by_entry): the int32 [1] entry offset of a stacked pool, or none."""
    if slot_offset is None:
        return (), False
    return (jnp.reshape(slot_offset, (1,)).astype(jnp.int32),), True


def _row_mask(row0, block_rows, start, end):
    rows = row0 + lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
    return (rows >= start) & (rows < end)


def _col_mask(col0, width, rank):
    return (col0 + lax.broadcasted_iota(jnp.int32, (1, width), 1)) < rank


def _split_range(split, num_k_blocks: int, k_splits: int):
    per_split = -(-num_k_blocks // k_splits)
    kb_lo = split * per_split
    return kb_lo, jnp.minimum(kb_lo + per_split, num_k_blocks)


def _shrink_kernel(*refs, cfg: TileConfig, num_chunks: int, num_k_blocks: int, by_entry: bool):
    starts_ref, slot_ref, rank_ref, lo_ref, hi_ref, x_ref, a_ref, *offset_ref, out_ref = refs
    offset_ref = offset_ref[0] if by_entry else None
    tile, split = pl.program_id(0), pl.program_id(1)
    bm, bk, rc = cfg.block_rows, cfg.block_k, cfg.rank_chunk
    num_rows, r_max = x_ref.shape[0], a_ref.shape[-1]
    row0 = pl.multiple_of(tile * bm, bm)
    kb_lo, kb_hi = _split_range(split, num_k_blocks, cfg.k_splits)

    def seg_body(seg, accs):
        start, end, slot, rank, active = _segment(seg, starts_ref, slot_ref, rank_ref,
                                                  num_rows, r_max, offset_ref)

        def k_body(kb, chunk_accs):
            k0 = pl.multiple_of(kb * bk, bk)
            x_blk = x_ref[pl.ds(row0, bm), pl.ds(k0, bk)]

            def add(acc, c):
                a_blk = a_ref[slot, pl.ds(k0, bk), pl.ds(c * rc, rc)]
                return acc + jnp.dot(x_blk, a_blk, preferred_element_type=_F32)

            out = [add(chunk_accs[0], 0)]  # every active segment has rank >= 1
            for c in range(1, num_chunks):
                out.append(lax.cond(c * rc < rank, functools.partial(add, c=c),
                                    lambda acc: acc, chunk_accs[c]))
            return tuple(out)

        zeros = tuple(jnp.zeros((bm, rc), _F32) for _ in range(num_chunks))
        seg_accs = lax.fori_loop(kb_lo, jnp.where(active, kb_hi, kb_lo), k_body, zeros)
        rows = _row_mask(row0, bm, start, end)
        return tuple(
            acc + jnp.where(rows & _col_mask(c * rc, rc, rank), seg_accs[c], 0.0)
            for c, acc in enumerate(accs)
        )

    init = tuple(jnp.zeros((bm, rc), _F32) for _ in range(num_chunks))
    accs = lax.fori_loop(lo_ref[tile], hi_ref[tile], seg_body, init)
    for c in range(num_chunks):
        out_ref[split, pl.ds(row0, bm), pl.ds(c * rc, rc)] = accs[c]


def sgmv_shrink_gpu(x, lora_a, seg_starts, seg_slot, seg_rank, routing: TileRouting,
                    cfg: TileConfig, interpret: bool, slot_offset=None):
    """Split-K partial sums of v = x @ A[slot] per segment (rank-masked; 0 for rows of no
    active segment).

    x [T, k], lora_a [slots, k, r] -> [k_splits, T, r] float32 (sum over axis 0 is v).
    seg_rank [S]; with slot_offset (stacked pool, see the module doc): a rank table [P].
    """
    num_rows, k = x.shape
    r_max = lora_a.shape[-1]
    offset, by_entry = _offset_args(slot_offset)
    kernel = functools.partial(_shrink_kernel, cfg=cfg, num_chunks=r_max // cfg.rank_chunk,
                               num_k_blocks=k // cfg.block_k, by_entry=by_entry)
    return pl.pallas_call(
        kernel,
        name="sgmv_shrink",
        out_shape=jax.ShapeDtypeStruct((cfg.k_splits, num_rows, r_max), _F32),
        grid=(num_rows // cfg.block_rows, cfg.k_splits),
        compiler_params=_params(cfg),
        interpret=interpret,
    )(seg_starts, seg_slot, seg_rank, routing.tile_seg_lo, routing.tile_seg_hi, x, lora_a, *offset)


def _expand_kernel(*refs, cfg: TileConfig, num_chunks: int, by_entry: bool):
    starts_ref, slot_ref, rank_ref, scale_ref, lo_ref, hi_ref, y_ref, v_ref, b_ref, *offset_ref, out_ref = refs
    offset_ref = offset_ref[0] if by_entry else None
    tile, col_group = pl.program_id(0), pl.program_id(1)
    bm, bn, rc = cfg.block_rows, cfg.block_n, cfg.rank_chunk
    num_rows, r_max, num_parts = y_ref.shape[0], b_ref.shape[1], v_ref.shape[0]
    row0 = pl.multiple_of(tile * bm, bm)

    def load_v(c):  # sum of the shrink's split-K partials (one part for a plain v)
        v = v_ref[0, pl.ds(row0, bm), pl.ds(c * rc, rc)].astype(_F32)
        for part in range(1, num_parts):
            v = v + v_ref[part, pl.ds(row0, bm), pl.ds(c * rc, rc)].astype(_F32)
        return v

    def column_block(j, carry):
        col0 = pl.multiple_of((col_group * cfg.col_blocks + j) * bn, bn)

        def seg_body(seg, acc):
            start, end, slot, rank, active = _segment(seg, starts_ref, slot_ref, rank_ref,
                                                      num_rows, r_max, offset_ref)
            scale = scale_ref[slot if by_entry else seg]

            def add(d, c):
                v_blk = jnp.where(_col_mask(c * rc, rc, rank), load_v(c), 0.0)
                b_blk = b_ref[slot, pl.ds(c * rc, rc), pl.ds(col0, bn)]
                b_rows = (c * rc + lax.broadcasted_iota(jnp.int32, (rc, 1), 0)) < rank
                b_blk = jnp.where(b_rows, b_blk, 0)
                return d + jnp.dot(v_blk.astype(b_blk.dtype), b_blk,
                                   preferred_element_type=_F32)

            delta = add(jnp.zeros((bm, bn), _F32), 0)
            for c in range(1, num_chunks):
                delta = lax.cond(c * rc < rank, functools.partial(add, c=c), lambda d: d,
                                 delta)
            rows = _row_mask(row0, bm, start, end) & active
            return acc + jnp.where(rows, scale * delta, 0.0)

        y_blk = y_ref[pl.ds(row0, bm), pl.ds(col0, bn)]
        acc = lax.fori_loop(lo_ref[tile], hi_ref[tile], seg_body, y_blk.astype(_F32))
        out_ref[pl.ds(row0, bm), pl.ds(col0, bn)] = acc.astype(out_ref.dtype)
        return carry

    if cfg.col_blocks == 1:
        column_block(0, 0)
    else:
        lax.fori_loop(0, cfg.col_blocks, column_block, 0)


def sgmv_expand_gpu(y, v, lora_b, seg_starts, seg_slot, seg_rank, seg_scale,
                    routing: TileRouting, cfg: TileConfig, interpret: bool, slot_offset=None):
    """y += scale * v @ B[slot] per segment, in place (y aliased to the output).

    y [T, n], v [T, r] or split-K partials [parts, T, r] (summed here), lora_b [slots, r, n]
    -> [T, n] (y.dtype). seg_rank/seg_scale [S]; with slot_offset (stacked pool, see the module
    doc): rank/scale tables [P].
    """
    num_rows, n = y.shape
    if v.ndim == 2:
        v = v[None]
    offset, by_entry = _offset_args(slot_offset)
    kernel = functools.partial(_expand_kernel, cfg=cfg,
                               num_chunks=lora_b.shape[1] // cfg.rank_chunk, by_entry=by_entry)
    return pl.pallas_call(
        kernel,
        name="sgmv_expand",
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=(num_rows // cfg.block_rows, n // (cfg.block_n * cfg.col_blocks)),
        input_output_aliases={6: 0},
        compiler_params=_params(cfg),
        interpret=interpret,
    )(seg_starts, seg_slot, seg_rank, seg_scale, routing.tile_seg_lo, routing.tile_seg_hi,
      y, v, lora_b, *offset)


def _outer_kernel(starts_ref, slot_ref, rank_ref, lhs_ref, rhs_ref, out_ref, *,
                  cfg: TileConfig, rank_axis: int):
    seg, p_block, q_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bm, bp, bq = cfg.block_rows, cfg.block_k, cfg.block_n
    r_max = (lhs_ref.shape[1], rhs_ref.shape[1])[rank_axis]
    start, end, _, rank, active = _segment(seg, starts_ref, slot_ref, rank_ref,
                                           lhs_ref.shape[0], r_max)
    rank_block_start = (p_block * bp, q_block * bq)[rank_axis]
    active = active & (rank_block_start < rank)

    def tile_body(tile, acc):
        lhs = lhs_ref[pl.ds(tile * bm, bm), pl.ds(p_block * bp, bp)]
        rhs = rhs_ref[pl.ds(tile * bm, bm), pl.ds(q_block * bq, bq)]
        lhs = jnp.where(_row_mask(tile * bm, bm, start, end), lhs, 0)
        if rank_axis == 0:
            lhs = jnp.where(_col_mask(p_block * bp, bp, rank), lhs, 0)
        else:
            rhs = jnp.where(_col_mask(q_block * bq, bq, rank), rhs, 0)
        return acc + lax.dot_general(lhs, rhs, (((0,), (0,)), ((), ())),
                                     preferred_element_type=_F32)

    # lax.div, not //: jnp's floor division does not lower to Triton on jax 0.11.
    first = jnp.where(active, lax.div(start, bm), 0)
    last = jnp.where(active, lax.div(end + bm - 1, bm), 0)
    acc = lax.fori_loop(first, last, tile_body, jnp.zeros((bp, bq), _F32))
    out_ref[seg, pl.ds(p_block * bp, bp), pl.ds(q_block * bq, bq)] = acc


def segment_outer_gpu(lhs, rhs, seg_starts, seg_slot, seg_rank, rank_axis: int,
                      cfg: TileConfig, interpret: bool):
    """out[s] = lhs[seg s]^T @ rhs[seg s] (f32); zero for slot -1 / empty segments and at
    indices >= the segment's rank along `rank_axis` (0: p, 1: q; whole blocks there are skipped).

    lhs [T, p], rhs [T, q] -> [S, p, q] float32.
    """
    num_segments = seg_slot.shape[0]
    p, q = lhs.shape[1], rhs.shape[1]
    kernel = functools.partial(_outer_kernel, cfg=cfg, rank_axis=rank_axis)
    return pl.pallas_call(
        kernel,
        name="sgmv_segment_outer",
        out_shape=jax.ShapeDtypeStruct((num_segments, p, q), _F32),
        grid=(num_segments, p // cfg.block_k, q // cfg.block_n),
        compiler_params=_params(cfg),
        interpret=interpret,
    )(seg_starts, seg_slot, seg_rank, lhs, rhs)
