"""GPU (Pallas -> Triton) BGMV kernels for decode: one row per request, each its own adapter.

Memory-bound GEMV (the A/B reads dominate): one program per row x split-K programs for
shrink, one per row x column block for expand, so a batch of 64 requests launches hundreds of
programs and keeps enough loads in flight. A single row is below Triton's 16-row dot minimum,
so the products are broadcast-multiply + reduce in f32.

The shrink writes f32 split-K partial sums [k_splits, B, r_max]; the expand sums them as it
loads v (`bgmv_expand_gpu` takes v as [parts, B, r] or [B, r]), so shrink -> expand
(`ops.bgmv_lora`) is two launches and no reduction pass. Rows with slot -1 (base model only)
get a zero trip count in the shrink and are neither read nor written by the expand (y is
aliased to the output, so it already holds them).

Mixed ranks: the first `rank_chunk`-wide chunk of A/B runs unconditionally, later chunks under
`lax.cond(chunk_start < rank)`, so a row never reads A/B columns beyond its rank chunk.
Per-row metadata arrives as whole int32/f32 arrays and is clipped inside the kernels.

Stacked pools (the serving engine's layer scan): with `slot_offset` (int32 [1]) given, row b
uses entry `slot[b] + slot_offset` of A/B [P, ., .] (P = layers x slots, the pool's stack
reshaped, so no layer slice is copied) and reads its rank and scale from per-entry tables
rank/scale [P] at that entry instead of per-row arrays (no lookup pass before the kernels).

(The TPU path has no separate BGMV kernel: the dispatcher runs the TPU SGMV kernel with one
segment per row and 8-row tiles; the MXU pads M anyway, so that is the same A/B traffic.)
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.tiles import TileConfig

_F32 = jnp.float32


def _params(cfg: TileConfig):
    return plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _row(row, slot_ref, offset_ref, rank_ref, r_max: int, by_entry: bool):
    """(A/B entry, rank clipped to [0, r_max], active) of request `row`: entry = slot clamped to
    >= 0 (+ offset_ref[0] for a stacked pool, whose rank table is indexed by entry, not row)."""
    slot = slot_ref[row]
    entry = jnp.maximum(slot, 0) + offset_ref[0]
    rank = jnp.clip(rank_ref[entry if by_entry else row], 0, r_max)
    return entry, rank, (slot >= 0) & (rank > 0)


def _offset(slot_offset):
    """(int32 [1] entry offset, by_entry) for a kernel call (offset 0: per-row tables)."""
    if slot_offset is None:
        return jnp.zeros((1,), jnp.int32), False
    return jnp.reshape(slot_offset, (1,)).astype(jnp.int32), True


def _k_block_range(split, num_k_blocks: int, k_splits: int):
    """[lo, hi) of the k blocks that split-K program `split` reduces."""
    per_split = -(-num_k_blocks // k_splits)
    lo = split * per_split
    return lo, jnp.minimum(lo + per_split, num_k_blocks)


def _shrink_chunk(x_blk, a_ref, entry, k0, c: int, bk: int, rc: int):
    """[rc] partial of x_blk [bk] @ A[entry, k0:k0+bk, rank chunk c] (float32)."""
    a_blk = a_ref[entry, pl.ds(k0, bk), pl.ds(c * rc, rc)].astype(_F32)
    return jnp.sum(x_blk[:, None] * a_blk, axis=0)


def _load_v(v_ref, row, rank, v_col0, c: int, rc: int):
    """[rc] float32: rank chunk c of v[row] (v_ref [parts, B, ...], the chunk's columns from
    v_col0 on) summed over its split-K parts, masked to the row's rank. Loaded once per program
    and reused for all of its column blocks."""
    ranks = c * rc + lax.broadcasted_iota(jnp.int32, (rc,), 0)
    cols = pl.ds(v_col0 + c * rc, rc)
    v = v_ref[0, row, cols].astype(_F32)
    for part in range(1, v_ref.shape[0]):
        v = v + v_ref[part, row, cols].astype(_F32)
    return jnp.where(ranks < rank, v, 0.0)


def _expand_chunk(v, b_ref, entry, rank, col0, c: int, bn: int, rc: int):
    """[bn] of v (rank chunk c, from `_load_v`) @ B[entry, chunk c, col0:col0+bn] (float32),
    B masked to the row's rank."""
    ranks = c * rc + lax.broadcasted_iota(jnp.int32, (rc,), 0)
    b_blk = b_ref[entry, pl.ds(c * rc, rc), pl.ds(col0, bn)].astype(_F32)
    b_blk = jnp.where(ranks[:, None] < rank, b_blk, 0.0)
    return jnp.sum(v[:, None] * b_blk, axis=0)


def _expand_columns(v_ref, b_ref, y_ref, out_ref, row, entry, rank, scale, v_col0, first_block,
                    cfg: TileConfig, num_chunks: int, y_offset: int = 0):
    """out[row, blocks first_block .. first_block + col_blocks) = y + scale * v @ B[entry] over
    those block_n-wide column blocks (y, out: from column `y_offset`); v (its split-K parts summed)
    is loaded once for all of them (`col_blocks` > 1 divides the v traffic of the expand by col_blocks)."""
    vs = [_load_v(v_ref, row, rank, v_col0, c, cfg.rank_chunk) for c in range(num_chunks)]
    write_columns(vs, b_ref, y_ref, out_ref, row, entry, rank, scale, first_block, cfg, num_chunks, y_offset)


def write_columns(vs, b_ref, y_ref, out_ref, row, entry, rank, scale, first_block, cfg: TileConfig,
                  num_chunks: int, y_offset: int = 0):
    """out[row, col_blocks column blocks from first_block] = y + scale * v @ B[entry], v given as
    its rank chunks `vs` (float32 [rank_chunk] each, masked to the row's rank); chunks past the
    rank are skipped (`lax.cond`). y and out's columns start `y_offset` (a multiple of block_n)
    after B's: a projection's columns in a packed output. Shared by the split expand and the fused
    kernel (`bgmv_fused_gpu`)."""
    bn, rc = cfg.block_n, cfg.rank_chunk
    for j in range(cfg.col_blocks):
        col0 = pl.multiple_of((first_block + j) * bn, bn)
        delta = _expand_chunk(vs[0], b_ref, entry, rank, col0, 0, bn, rc)
        for c in range(1, num_chunks):
            def add(d, c=c, col0=col0):
                return d + _expand_chunk(vs[c], b_ref, entry, rank, col0, c, bn, rc)

            delta = lax.cond(c * rc < rank, add, lambda d: d, delta)
        y_col = pl.multiple_of(col0 + y_offset, bn)
        y_blk = y_ref[row, pl.ds(y_col, bn)]
        out = y_blk.astype(_F32) + scale * delta
        out_ref[row, pl.ds(y_col, bn)] = out.astype(out_ref.dtype)


def _shrink_kernel(slot_ref, offset_ref, rank_ref, x_ref, a_ref, out_ref, *, cfg: TileConfig,
                   num_chunks: int, num_k_blocks: int, by_entry: bool):
    row, split = pl.program_id(0), pl.program_id(1)
    bk, rc = cfg.block_k, cfg.rank_chunk
    slot, rank, active = _row(row, slot_ref, offset_ref, rank_ref, a_ref.shape[-1], by_entry)
    kb_lo, kb_hi = _k_block_range(split, num_k_blocks, cfg.k_splits)

    def k_body(kb, accs):
        k0 = pl.multiple_of(kb * bk, bk)
        x_blk = x_ref[row, pl.ds(k0, bk)].astype(_F32)

        def add(acc, c):
            return acc + _shrink_chunk(x_blk, a_ref, slot, k0, c, bk, rc)

        out = [add(accs[0], 0)]
        for c in range(1, num_chunks):
            out.append(lax.cond(c * rc < rank, functools.partial(add, c=c), lambda acc: acc,
                                accs[c]))
        return tuple(out)

    zeros = tuple(jnp.zeros((rc,), _F32) for _ in range(num_chunks))
    accs = lax.fori_loop(kb_lo, jnp.where(active, kb_hi, kb_lo), k_body, zeros)
    for c in range(num_chunks):
        cols = c * rc + lax.broadcasted_iota(jnp.int32, (rc,), 0)
        out_ref[split, row, pl.ds(c * rc, rc)] = jnp.where(cols < rank, accs[c], 0.0)


def bgmv_shrink_gpu(x, lora_a, row_slot, row_rank, cfg: TileConfig, interpret: bool,
                    slot_offset=None):
    """Split-K partials of v[b] = x[b] @ A[slot[b]] (rank-masked; 0 for slot -1).

    x [B, k], lora_a [slots, k, r] -> [k_splits, B, r] float32 (sum over axis 0 is v).
    row_rank [B]; with slot_offset (stacked pool, see the module doc): rank table [P].
    """
    batch, k = x.shape
    r_max = lora_a.shape[-1]
    offset, by_entry = _offset(slot_offset)
    kernel = functools.partial(_shrink_kernel, cfg=cfg, num_chunks=r_max // cfg.rank_chunk,
                               num_k_blocks=k // cfg.block_k, by_entry=by_entry)
    return pl.pallas_call(
        kernel,
        name="bgmv_shrink",
        out_shape=jax.ShapeDtypeStruct((cfg.k_splits, batch, r_max), _F32),
        grid=(batch, cfg.k_splits),
        compiler_params=_params(cfg),
        interpret=interpret,
    )(row_slot, offset, row_rank, x, lora_a)


def _expand_kernel(slot_ref, offset_ref, rank_ref, scale_ref, y_ref, v_ref, b_ref, out_ref, *,
                   cfg: TileConfig, num_chunks: int, by_entry: bool):
    row, col_group = pl.program_id(0), pl.program_id(1)
    slot, rank, active = _row(row, slot_ref, offset_ref, rank_ref, b_ref.shape[1], by_entry)
    scale = scale_ref[slot if by_entry else row]

    @pl.when(active)
    def _():
        _expand_columns(v_ref, b_ref, y_ref, out_ref, row, slot, rank, scale, 0, col_group * cfg.col_blocks,
                        cfg, num_chunks)


def bgmv_expand_gpu(y, v, lora_b, row_slot, row_rank, row_scale, cfg: TileConfig,
                    interpret: bool, slot_offset=None):
    """y[b] += scale[b] * v[b] @ B[slot[b]], in place (y aliased to the output; rows with
    slot -1 or rank 0 are not touched).

    y [B, n], v [B, r] or split-K partials [parts, B, r] (summed here), lora_b [slots, r, n]
    -> [B, n] (y.dtype). One program per row and col_blocks column blocks (n a multiple of
    block_n * col_blocks). row_rank/row_scale [B]; with slot_offset (stacked pool, see the
    module doc): rank/scale tables [P].
    """
    batch, n = y.shape
    if v.ndim == 2:
        v = v[None]
    offset, by_entry = _offset(slot_offset)
    kernel = functools.partial(_expand_kernel, cfg=cfg,
                               num_chunks=lora_b.shape[1] // cfg.rank_chunk, by_entry=by_entry)
    return pl.pallas_call(
        kernel,
        name="bgmv_expand",
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=(batch, n // (cfg.block_n * cfg.col_blocks)),
        input_output_aliases={4: 0},
        compiler_params=_params(cfg),
        interpret=interpret,
    )(row_slot, offset, row_rank, row_scale, y, v, lora_b)


# ---- grouped: several projections of one input (q/k/v, gate/up) in one shrink + one expand ----

def _grouped_shrink_kernel(*refs, cfg: TileConfig, groups: int, num_chunks: int,
                           num_k_blocks: int):
    slot_ref, offset_ref, *refs = refs
    rank_refs, (x_ref,), a_refs, (out_ref,) = (refs[:groups], refs[groups:groups + 1],
                                               refs[groups + 1:2 * groups + 1], refs[-1:])
    row, split = pl.program_id(0), pl.program_id(1)
    bk, rc, r_max = cfg.block_k, cfg.rank_chunk, a_refs[0].shape[-1]
    entry, _, _ = _row(row, slot_ref, offset_ref, rank_refs[0], r_max, True)
    ranks = [jnp.clip(rank_ref[entry], 0, r_max) for rank_ref in rank_refs]
    active = (slot_ref[row] >= 0) & (functools.reduce(jnp.maximum, ranks) > 0)
    kb_lo, kb_hi = _k_block_range(split, num_k_blocks, cfg.k_splits)

    def k_body(kb, accs):
        k0 = pl.multiple_of(kb * bk, bk)
        x_blk = x_ref[row, pl.ds(k0, bk)].astype(_F32)

        def add(acc, g, c):
            return acc + _shrink_chunk(x_blk, a_refs[g], entry, k0, c, bk, rc)

        out = []
        for g in range(groups):  # the first chunk of every projection unconditionally
            out.append(add(accs[g * num_chunks], g, 0))
            for c in range(1, num_chunks):
                out.append(lax.cond(c * rc < ranks[g], functools.partial(add, g=g, c=c),
                                    lambda acc: acc, accs[g * num_chunks + c]))
        return tuple(out)

    zeros = tuple(jnp.zeros((rc,), _F32) for _ in range(groups * num_chunks))
    accs = lax.fori_loop(kb_lo, jnp.where(active, kb_hi, kb_lo), k_body, zeros)
    for g in range(groups):
        for c in range(num_chunks):
            cols = c * rc + lax.broadcasted_iota(jnp.int32, (rc,), 0)
            out_ref[split, row, pl.ds(g * r_max + c * rc, rc)] = jnp.where(
                cols < ranks[g], accs[g * num_chunks + c], 0.0)


def bgmv_shrink_grouped_gpu(x, lora_as, row_slot, slot_offset, slot_ranks, cfg: TileConfig,
                            interpret: bool):
    """Split-K partials of v_g[b] = x[b] @ A_g[entry b] for G projections sharing x, in one
    launch (x read once): entry b = slot[b] + slot_offset (stacked pools), rank-masked per
    projection by its table slot_ranks[g] [P]; 0 for slot -1.

    x [B, k], lora_as: G arrays [P, k, r] -> [k_splits, B, G * r] float32 (projection g in
    columns g*r:(g+1)*r; the sum over axis 0 is v).
    """
    batch, k = x.shape
    groups, r_max = len(lora_as), lora_as[0].shape[-1]
    offset, _ = _offset(slot_offset)
    kernel = functools.partial(_grouped_shrink_kernel, cfg=cfg, groups=groups,
                               num_chunks=r_max // cfg.rank_chunk, num_k_blocks=k // cfg.block_k)
    return pl.pallas_call(
        kernel,
        name="bgmv_shrink_grouped",
        out_shape=jax.ShapeDtypeStruct((cfg.k_splits, batch, groups * r_max), _F32),
        grid=(batch, cfg.k_splits),
        compiler_params=_params(cfg),
        interpret=interpret,
    )(row_slot, offset, *slot_ranks, x, *lora_as)


def _expand_groups(slot_ref, offset_ref, rank_refs, scale_refs, v_ref, b_refs, target, cfg: TileConfig,
                   num_chunks: int, block_starts: tuple):
    """The body of a grouped expand program (row, column group): projection g's columns (the one
    whose column groups this program covers) of y + scale_g * v_g @ B_g[entry]; target(g) -> (its
    y ref, its out ref, their first column)."""
    row, col_group = pl.program_id(0), pl.program_id(1)
    r_max = b_refs[0].shape[1]
    entry, _, _ = _row(row, slot_ref, offset_ref, rank_refs[0], r_max, True)

    def expand(g):
        rank = jnp.clip(rank_refs[g][entry], 0, r_max)
        y_ref, out_ref, y_offset = target(g)

        @pl.when((slot_ref[row] >= 0) & (rank > 0))
        def _():
            _expand_columns(v_ref, b_refs[g], y_ref, out_ref, row, entry, rank, scale_refs[g][entry],
                            g * r_max, (col_group - block_starts[g]) * cfg.col_blocks, cfg, num_chunks, y_offset)

    for g in range(len(block_starts) - 1):
        pl.when((col_group >= block_starts[g]) & (col_group < block_starts[g + 1]))(
            functools.partial(expand, g))


def _grouped_expand_kernel(*refs, cfg: TileConfig, num_chunks: int, block_starts: tuple):
    groups = len(block_starts) - 1
    slot_ref, offset_ref, *refs = refs
    rank_refs, scale_refs = refs[:groups], refs[groups:2 * groups]
    y_refs, v_ref = refs[2 * groups:3 * groups], refs[3 * groups]
    b_refs, out_refs = refs[3 * groups + 1:4 * groups + 1], refs[4 * groups + 1:]
    _expand_groups(slot_ref, offset_ref, rank_refs, scale_refs, v_ref, b_refs,
                   lambda g: (y_refs[g], out_refs[g], 0), cfg, num_chunks, block_starts)


def bgmv_expand_grouped_gpu(ys, v, lora_bs, row_slot, slot_offset, slot_ranks, slot_scales,
                            cfg: TileConfig, interpret: bool):
    """ys[g][b] += scale_g * v_g[b] @ B_g[entry b] for G projections in one launch, each y in
    place (aliased to its output; rows with slot -1 or rank 0 untouched); entry b = slot[b] +
    slot_offset, rank and scale of projection g from its tables [P].

    ys: G arrays [B, n_g] (n_g multiples of block_n * col_blocks), v: [B, G*r] or split-K partials
    [parts, B, G*r] from `bgmv_shrink_grouped_gpu`, lora_bs: G arrays [P, r, n_g]
    -> tuple of G arrays [B, n_g].
    """
    groups, batch = len(ys), ys[0].shape[0]
    if v.ndim == 2:
        v = v[None]
    block_starts = [0]
    for y in ys:
        block_starts.append(block_starts[-1] + y.shape[1] // (cfg.block_n * cfg.col_blocks))
    offset, _ = _offset(slot_offset)
    kernel = functools.partial(_grouped_expand_kernel, cfg=cfg,
                               num_chunks=lora_bs[0].shape[1] // cfg.rank_chunk,
                               block_starts=tuple(block_starts))
    first_y = 2 + 2 * groups
    return pl.pallas_call(
        kernel,
        name="bgmv_expand_grouped",
        out_shape=tuple(jax.ShapeDtypeStruct(y.shape, y.dtype) for y in ys),
        grid=(batch, block_starts[-1]),
        input_output_aliases={first_y + g: g for g in range(groups)},
        compiler_params=_params(cfg),
        interpret=interpret,
    )(row_slot, offset, *slot_ranks, *slot_scales, *ys, v, *lora_bs)


def _packed_expand_kernel(*refs, cfg: TileConfig, num_chunks: int, block_starts: tuple, offsets: tuple):
    groups = len(block_starts) - 1
    slot_ref, offset_ref, *refs = refs
    rank_refs, scale_refs = refs[:groups], refs[groups:2 * groups]
    y_ref, v_ref = refs[2 * groups], refs[2 * groups + 1]
    b_refs, out_ref = refs[2 * groups + 2:3 * groups + 2], refs[3 * groups + 2]
    _expand_groups(slot_ref, offset_ref, rank_refs, scale_refs, v_ref, b_refs,
                   lambda g: (y_ref, out_ref, offsets[g]), cfg, num_chunks, block_starts)


def bgmv_expand_packed_gpu(y, widths, v, lora_bs, row_slot, slot_offset, slot_ranks, slot_scales,
                           cfg: TileConfig, interpret: bool):
    """`bgmv_expand_grouped_gpu` on the G projections' outputs side by side in one array: y [B,
    sum(widths)] (projection g's columns after those of the ones before it: a packed kernel's
    output) += scale_g * v_g[b] @ B_g[entry b] in its columns, in place (aliased; rows with slot -1
    or rank 0 untouched). No projection's columns are cut out of y (a pallas_call operand that is a
    slice is a copy: 5 a layer, 0.27 ms of an 8B decode step on an H200). widths: multiples of
    block_n * col_blocks; lora_bs: G arrays [P, r, n_g] -> [B, sum(widths)]."""
    groups, batch = len(widths), y.shape[0]
    group_cols = cfg.block_n * cfg.col_blocks
    if any(n % group_cols for n in widths) or y.shape[1] != sum(widths):
        raise ValueError(f"packed widths {widths} must be multiples of {group_cols} summing to y's {y.shape[1]}")
    if v.ndim == 2:
        v = v[None]
    block_starts, offsets = [0], [0]
    for n in widths:
        block_starts.append(block_starts[-1] + n // group_cols)
        offsets.append(offsets[-1] + n)
    offset, _ = _offset(slot_offset)
    kernel = functools.partial(_packed_expand_kernel, cfg=cfg, num_chunks=lora_bs[0].shape[1] // cfg.rank_chunk,
                               block_starts=tuple(block_starts), offsets=tuple(offsets[:-1]))
    return pl.pallas_call(
        kernel,
        name="bgmv_expand_packed",
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=(batch, block_starts[-1]),
        input_output_aliases={2 + 2 * groups: 0},
        compiler_params=_params(cfg),
        interpret=interpret,
    )(row_slot, offset, *slot_ranks, *slot_scales, y, v, *lora_bs)
