"""GPU (Pallas -> Triton) LoRA kernels over paged adapter rows (S-LoRA unified paging, its
MBGMV/MBGMM over non-contiguous memory).

An adapter of rank r is r rows of an A-row pool a_rows [R, k] and of a B-row pool b_rows [R, n]
(rank row j of adapter e: A[:, j] as a row, B[j, :]), found through a row table: rank row j of
entry e is row `row_offset + row_table[e, j]`, live for j < slot_rank[e] (S-LoRA's a_start /
a_len / a_loc). The rows need not be contiguous (they come from a free list): the kernels read
them `RANK_CHUNK` (16) at a time, a chunk's row ids loaded from the table as a vector and its rows
gathered in one load (a [16, block] tile of pointers: Triton's gather), rows past the rank masked.
Chunks are static (table width / 16) and those past an adapter's rank are skipped under
`lax.cond`, so a rank-8 adapter reads one chunk, a rank-32 one two (S-LoRA MBGMV/MBGMM: no max-
rank padding is read). SGMV multiplies tiles with `dot` ([rows, k] x [16, k]^T, then [rows, 16] x
[16, n]: MMA shapes); BGMV (one row) broadcast-multiplies and reduces in float32. v stays float32
from the shrink to the expand (rounded to B's dtype for the SGMV expand's dot).

Metadata arrives as whole int32/float32 arrays (Triton has no scalar prefetch, as the other GPU
kernels here), offsets as int32 [2] (row_offset, entry_offset: the stacked pools of the serving
engine's layer scan, layer * rows and layer * slots, so no layer slice is copied).

- `bgmv_paged_shrink_gpu` / `bgmv_paged_expand_gpu` (decode, one row per request): grid (rows,
  k_splits) writing float32 split-K partials [k_splits, B, w], then (rows, column blocks) summing
  them, y aliased to the output (rows of slot -1 untouched).
- `sgmv_paged_shrink_gpu` / `sgmv_paged_expand_gpu` (segments): one program per work item, a (row
  tile, segment) pair of `TileRouting`'s work list, storing the segment's rows of the tile (masked
  stores; the expand's y is aliased, so rows of no active segment keep it).

Inputs come padded by the dispatcher (`pallas_kernels.paged_lora`): k to block_k, n to block_n,
rows to block_rows, the table width w to a power of two >= RANK_CHUNK.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

_F32 = jnp.float32
_PARAMS = plt.CompilerParams(num_warps=4, num_stages=2)
RANK_CHUNK = 16  # rank rows per gathered tile (Triton dot dims >= 16)


def _entry(slot, table_ref, rank_ref, offsets_ref):
    """(entry, rank clipped to [0, w], active) of adapter slot `slot` (-1: none)."""
    entry = jnp.maximum(slot, 0) + offsets_ref[1]
    rank = jnp.clip(rank_ref[entry], 0, table_ref.shape[1])
    return entry, rank, (slot >= 0) & (rank > 0)


def _chunk_rows(table_ref, offsets_ref, entry, rank, c: int):
    """(pool rows [RANK_CHUNK] of rank chunk c of `entry`, live [RANK_CHUNK]: rank row < rank)."""
    ranks = c * RANK_CHUNK + lax.broadcasted_iota(jnp.int32, (RANK_CHUNK,), 0)
    rows = offsets_ref[0] + table_ref[entry, pl.ds(c * RANK_CHUNK, RANK_CHUNK)]
    return rows, ranks < rank


def _num_chunks(table_ref) -> int:
    return table_ref.shape[1] // RANK_CHUNK


def _chunked(accs, rank, active, update):
    """accs with `update(c, accs[c])` applied for every static rank chunk c the rank reaches."""
    return tuple(lax.cond(active & (c * RANK_CHUNK < rank), functools.partial(update, c), lambda acc: acc, acc)
                 for c, acc in enumerate(accs))


def _k_range(split, num_k_blocks: int, k_splits: int):
    per_split = -(-num_k_blocks // k_splits)
    lo = split * per_split
    return lo, jnp.minimum(lo + per_split, num_k_blocks)


# ---- BGMV (decode) -----------------------------------------------------------------------------

def _bgmv_shrink_kernel(slot_ref, table_ref, rank_ref, offsets_ref, x_ref, a_ref, out_ref, *,
                        block_k: int, num_k_blocks: int, k_splits: int):
    b, split = pl.program_id(0), pl.program_id(1)
    entry, rank, active = _entry(slot_ref[b], table_ref, rank_ref, offsets_ref)
    kb_lo, kb_hi = _k_range(split, num_k_blocks, k_splits)

    def chunk(c, acc):
        rows, live = _chunk_rows(table_ref, offsets_ref, entry, rank, c)

        def k_body(kb, total):
            k0 = pl.multiple_of(kb * block_k, block_k)
            x_blk = x_ref[b, pl.ds(k0, block_k)].astype(_F32)
            a_tile = a_ref[rows, pl.ds(k0, block_k)].astype(_F32)  # [RANK_CHUNK, block_k]
            return total + jnp.sum(x_blk[None, :] * a_tile, axis=1)

        return jnp.where(live, lax.fori_loop(kb_lo, kb_hi, k_body, acc), 0.0)

    zeros = tuple(jnp.zeros((RANK_CHUNK,), _F32) for _ in range(_num_chunks(table_ref)))
    for c, acc in enumerate(_chunked(zeros, rank, active, chunk)):
        out_ref[split, b, pl.ds(c * RANK_CHUNK, RANK_CHUNK)] = acc


def bgmv_paged_shrink_gpu(x, a_rows, row_slot, row_table, slot_rank, offsets, *, block_k: int,
                          k_splits: int, interpret):
    """Split-K partials of v[b, j] = x[b] . A_rows[row of rank row j of slot b] (0 past its rank
    and for slot -1): x [B, k], a_rows [R, k] -> [k_splits, B, w] float32."""
    batch, k = x.shape
    kernel = functools.partial(_bgmv_shrink_kernel, block_k=block_k, num_k_blocks=k // block_k,
                               k_splits=k_splits)
    return pl.pallas_call(
        kernel, name="bgmv_paged_shrink",
        out_shape=jax.ShapeDtypeStruct((k_splits, batch, row_table.shape[1]), _F32),
        grid=(batch, k_splits), compiler_params=_PARAMS, interpret=interpret,
    )(row_slot, row_table, slot_rank, offsets, x, a_rows)


def _v_chunk(v_ref, rows, c: int):
    """v[rows, chunk c] summed over the split-K parts of v_ref [parts, T, w] (float32)."""
    cols = pl.ds(c * RANK_CHUNK, RANK_CHUNK)
    v = v_ref[0, rows, cols]
    for part in range(1, v_ref.shape[0]):
        v = v + v_ref[part, rows, cols]
    return v


def _bgmv_expand_kernel(slot_ref, table_ref, rank_ref, scale_ref, offsets_ref, y_ref, v_ref, b_ref,
                        out_ref, *, block_n: int):
    b, col_block = pl.program_id(0), pl.program_id(1)
    entry, rank, active = _entry(slot_ref[b], table_ref, rank_ref, offsets_ref)
    cols = pl.ds(pl.multiple_of(col_block * block_n, block_n), block_n)

    def chunk(c, delta):
        rows, live = _chunk_rows(table_ref, offsets_ref, entry, rank, c)
        v = jnp.where(live, _v_chunk(v_ref, b, c), 0.0)
        b_tile = jnp.where(live[:, None], b_ref[rows, cols].astype(_F32), 0.0)  # [RANK_CHUNK, block_n]
        return delta + jnp.sum(v[:, None] * b_tile, axis=0)

    @pl.when(active)
    def _():
        deltas = _chunked(tuple(jnp.zeros((block_n,), _F32) for _ in range(_num_chunks(table_ref))), rank, active,
                          chunk)
        out = y_ref[b, cols].astype(_F32) + scale_ref[entry] * functools.reduce(jnp.add, deltas)
        out_ref[b, cols] = out.astype(out_ref.dtype)


def bgmv_paged_expand_gpu(y, v, b_rows, row_slot, row_table, slot_rank, slot_scale, offsets, *,
                          block_n: int, interpret):
    """y[b] += scale * sum_j v[b, j] B_rows[row j of slot b], in place (y aliased; rows of slot -1
    untouched): y [B, n], v [parts, B, w] float32, b_rows [R, n] -> [B, n] (y.dtype)."""
    batch, n = y.shape
    kernel = functools.partial(_bgmv_expand_kernel, block_n=block_n)
    return pl.pallas_call(
        kernel, name="bgmv_paged_expand",
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=(batch, n // block_n), input_output_aliases={5: 0},
        compiler_params=_PARAMS, interpret=interpret,
    )(row_slot, row_table, slot_rank, slot_scale, offsets, y, v, b_rows)


# ---- SGMV (prefill segments) ---------------------------------------------------------------------

def _segment(seg, starts_ref, seg_slot_ref, table_ref, rank_ref, offsets_ref, num_rows: int):
    """(start, end, entry, rank, active) of segment `seg`."""
    start = jnp.clip(starts_ref[seg], 0, num_rows)
    end = jnp.clip(starts_ref[seg + 1], 0, num_rows)
    entry, rank, active = _entry(seg_slot_ref[seg], table_ref, rank_ref, offsets_ref)
    return start, end, entry, rank, active & (end > start)


def _in_segment(row0, block_rows: int, start, end):
    """[block_rows, 1] bool: the tile's row is in [start, end)."""
    rows = row0 + lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
    return (rows >= start) & (rows < end)


_NT = (((1,), (1,)), ((), ()))  # dot_general: [m, k] x [n, k] -> [m, n]


def _item(item, seg_ref, tile_ref, starts_ref, seg_slot_ref, table_ref, rank_ref, offsets_ref, num_rows: int,
          block_rows: int):
    """(tile rows, in_seg [block_rows, 1], entry, rank, active) of work item `item`: one (row tile,
    segment) pair of the routing's work list (segment -1: nothing to do)."""
    seg = seg_ref[item]
    start, end, entry, rank, active = _segment(jnp.maximum(seg, 0), starts_ref, seg_slot_ref, table_ref, rank_ref,
                                               offsets_ref, num_rows)
    row0 = pl.multiple_of(tile_ref[item] * block_rows, block_rows)
    return pl.ds(row0, block_rows), _in_segment(row0, block_rows, start, end), entry, rank, active & (seg >= 0)


def _sgmv_shrink_kernel(starts_ref, seg_slot_ref, table_ref, rank_ref, offsets_ref, tile_ref, seg_ref,
                        x_ref, a_ref, out_ref, *, block_rows: int, block_k: int, num_k_blocks: int,
                        k_splits: int):
    item, split = pl.program_id(0), pl.program_id(1)
    kb_lo, kb_hi = _k_range(split, num_k_blocks, k_splits)
    tile_rows, in_seg, entry, rank, active = _item(item, seg_ref, tile_ref, starts_ref, seg_slot_ref, table_ref,
                                                   rank_ref, offsets_ref, x_ref.shape[0], block_rows)
    for c in range(_num_chunks(table_ref)):
        @pl.when(active & (c * RANK_CHUNK < rank))
        def _(c=c):
            rows, live = _chunk_rows(table_ref, offsets_ref, entry, rank, c)

            def k_body(kb, part):
                k0 = pl.multiple_of(kb * block_k, block_k)
                x_blk = x_ref[tile_rows, pl.ds(k0, block_k)]
                a_tile = a_ref[rows, pl.ds(k0, block_k)].astype(x_blk.dtype)  # [RANK_CHUNK, block_k]
                return part + lax.dot_general(x_blk, a_tile, _NT, preferred_element_type=_F32)

            part = lax.fori_loop(kb_lo, kb_hi, k_body, jnp.zeros((block_rows, RANK_CHUNK), _F32))
            part = jnp.where(live[None, :], part, 0.0)
            plt.store(out_ref.at[split, tile_rows, pl.ds(c * RANK_CHUNK, RANK_CHUNK)], part,
                      mask=jnp.broadcast_to(in_seg, part.shape))


def sgmv_paged_shrink_gpu(x, a_rows, seg_starts, seg_slot, row_table, slot_rank, offsets, routing, *,
                          block_rows: int, block_k: int, k_splits: int, interpret):
    """Split-K partials of v[t, j] = x[t] . A_rows[row j of t's segment's adapter] (0 past its rank):
    x [T, k], a_rows [R, k] -> [k_splits, T, w] float32 (the expand sums the parts), written for
    the rows of active segments only (the expand reads no other row).

    A program takes one work item (a row tile and one segment overlapping it: the routing's work
    list) and 1/k_splits of the k blocks, and stores the segment's rows of the tile (a masked
    store). So the segments of a tile run side by side: a tile of 16 one-row segments (decode rows
    planned as segments, `jaxlora.lora.plan.build_serving_plan`'s tail_segments) is 16 programs,
    not one looping over 16 segments (2.2 ms a step on an H200 against 0.45, 2026-11-29). Before
    the split, one program a row tile walked all of k alone (~36 us a call at k = 4096)."""
    num_rows, k = x.shape
    kernel = functools.partial(_sgmv_shrink_kernel, block_rows=block_rows, block_k=block_k,
                               num_k_blocks=k // block_k, k_splits=k_splits)
    return pl.pallas_call(
        kernel, name="sgmv_paged_shrink",
        out_shape=jax.ShapeDtypeStruct((k_splits, num_rows, row_table.shape[1]), _F32),
        grid=(routing.work_tile.shape[0], k_splits), compiler_params=_PARAMS, interpret=interpret,
    )(seg_starts, seg_slot, row_table, slot_rank, offsets, routing.work_tile, routing.work_seg, x, a_rows)


def _sgmv_expand_kernel(starts_ref, seg_slot_ref, table_ref, rank_ref, scale_ref, offsets_ref, tile_ref,
                        seg_ref, y_ref, v_ref, b_ref, out_ref, *, block_rows: int, block_n: int):
    item, col_block = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(pl.multiple_of(col_block * block_n, block_n), block_n)
    tile_rows, in_seg, entry, rank, active = _item(item, seg_ref, tile_ref, starts_ref, seg_slot_ref, table_ref,
                                                   rank_ref, offsets_ref, y_ref.shape[0], block_rows)

    def chunk(c, delta):
        rows, live = _chunk_rows(table_ref, offsets_ref, entry, rank, c)
        b_tile = b_ref[rows, cols]  # [RANK_CHUNK, block_n]
        v = jnp.where(in_seg & live[None, :], _v_chunk(v_ref, tile_rows, c), 0.0).astype(b_tile.dtype)
        b_tile = jnp.where(live[:, None], b_tile, jnp.zeros_like(b_tile))
        return delta + jnp.dot(v, b_tile, preferred_element_type=_F32)

    @pl.when(active)
    def _():
        delta = jnp.zeros((block_rows, block_n), _F32)
        for c in range(_num_chunks(table_ref)):
            delta = lax.cond(c * RANK_CHUNK < rank, functools.partial(chunk, c), lambda d: d, delta)
        out = y_ref[tile_rows, cols].astype(_F32) + scale_ref[entry] * delta
        plt.store(out_ref.at[tile_rows, cols], out.astype(out_ref.dtype), mask=jnp.broadcast_to(in_seg, out.shape))


def sgmv_paged_expand_gpu(y, v, b_rows, seg_starts, seg_slot, row_table, slot_rank, slot_scale, offsets,
                          routing, *, block_rows: int, block_n: int, interpret):
    """y[t] += scale * sum_j v[t, j] B_rows[row j of t's segment's adapter], in place (y aliased:
    rows of no active segment keep y): y [T, n], v [parts, T, w] float32, b_rows [R, n] -> [T, n]
    (y.dtype). One program per work item and column block, storing its segment's rows of the tile."""
    num_rows, n = y.shape
    kernel = functools.partial(_sgmv_expand_kernel, block_rows=block_rows, block_n=block_n)
    return pl.pallas_call(
        kernel, name="sgmv_paged_expand",
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=(routing.work_tile.shape[0], n // block_n), input_output_aliases={8: 0},
        compiler_params=_PARAMS, interpret=interpret,
    )(seg_starts, seg_slot, row_table, slot_rank, slot_scale, offsets, routing.work_tile, routing.work_seg,
      y, v, b_rows)
