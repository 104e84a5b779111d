"""GPU (Pallas -> Triton) fused BGMV for decode: shrink and expand of each row in one launch.

`bgmv_gpu` runs a decode row's LoRA as two launches (split-K shrink partials, then an expand that
sums them), so a decode step of the 8B model launches 2 kernels per projection group and layer:
256 small kernels whose cost is mostly latency (bench/NOTES_serve.md: +2.2 ms a step with ~35
distinct adapters against a 0.73 ms bytes floor). Here one program per (row, column group) of one
projection computes the row's whole shrink v = x[row] @ A[entry] (k reduced in `block_k` blocks,
float32, rank-masked), then writes `col_blocks` `block_n`-wide column blocks of
y[row] + scale * v @ B[entry]. The programs of one row recompute the same shrink: A (k x r, 128 KB
at k=4096, r=16 in bf16) is read from HBM once and from L2 by the others, so column groups should
be wide (1024+ columns) to keep those re-reads few. G projections of one input (q/k/v, gate/up)
share one launch: program ids past projection g's column groups belong to g+1.

Measured (bench/bgmv_fused.py, H200, jax 0.11.2, 2026-11-27; 64 rows, 37 with distinct adapters,
microseconds per layer, against the pair in the same run): o 17.9 vs 20.2, q/k/v 21.3 vs 20.7,
gate/up 34.1 vs 22.9, down 38.3 vs 18.1 (111.5 vs 82.0 in all): the recomputed shrink costs more
than the launch it saves wherever k or n is large (down: A is 14336 x 16; gate/up: 28672 columns).
So no serving backend uses it; it is kept, tested, for the next design (bench/NOTES_serve.md).

Rows with slot -1 or rank 0 are neither read nor written (y is aliased to the output). Mixed
ranks: A/B chunks past the row's rank chunk are skipped (`lax.cond`), as in `bgmv_gpu`.
Stacked pools only (entry = slot + slot_offset; rank/scale tables [P])."""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.bgmv_gpu import _F32, _offset, _params, _row, _shrink_chunk, write_columns
from pallas_kernels.tiles import TileConfig


def _row_shrink(x_ref, a_ref, row, entry, rank, active, cfg: TileConfig, num_chunks: int, num_k_blocks: int):
    """[num_chunks] float32 [rank_chunk] vectors: x[row] @ A[entry], masked to `rank` (for an
    `active` row: the caller's pl.when; Triton needs the loop's bounds of one type, so static)."""
    bk, rc = cfg.block_k, cfg.rank_chunk

    def k_body(kb, accs):
        k0 = pl.multiple_of(kb * bk, bk)
        x_blk = x_ref[row, pl.ds(k0, bk)].astype(_F32)
        out = [accs[0] + _shrink_chunk(x_blk, a_ref, entry, k0, 0, bk, rc)]
        for c in range(1, num_chunks):
            add = functools.partial(lambda acc, c: acc + _shrink_chunk(x_blk, a_ref, entry, k0, c, bk, rc), c=c)
            out.append(lax.cond(c * rc < rank, add, lambda acc: acc, accs[c]))
        return tuple(out)

    zeros = tuple(jnp.zeros((rc,), _F32) for _ in range(num_chunks))
    accs = lax.fori_loop(0, num_k_blocks, k_body, zeros)  # static bounds: the caller runs it only when active
    ranks = lambda c: c * rc + lax.broadcasted_iota(jnp.int32, (rc,), 0)
    return [jnp.where(ranks(c) < rank, accs[c], 0.0) for c in range(num_chunks)]


def _fused_kernel(*refs, cfg: TileConfig, num_chunks: int, num_k_blocks: int, block_starts: tuple):
    groups = len(block_starts) - 1
    slot_ref, offset_ref, *refs = refs
    rank_refs, scale_refs = refs[:groups], refs[groups:2 * groups]
    x_ref, y_refs = refs[2 * groups], refs[2 * groups + 1:3 * groups + 1]
    a_refs, b_refs = refs[3 * groups + 1:4 * groups + 1], refs[4 * groups + 1:5 * groups + 1]
    out_refs = refs[5 * groups + 1:]
    row, col_group = pl.program_id(0), pl.program_id(1)
    r_max = b_refs[0].shape[1]

    def run(g):
        entry, rank, active = _row(row, slot_ref, offset_ref, rank_refs[g], r_max, True)

        @pl.when(active)
        def _():
            vs = _row_shrink(x_ref, a_refs[g], row, entry, rank, active, cfg, num_chunks, num_k_blocks)
            write_columns(vs, b_refs[g], y_refs[g], out_refs[g], row, entry, rank, scale_refs[g][entry],
                           (col_group - block_starts[g]) * cfg.col_blocks, cfg, num_chunks)

    for g in range(groups):  # the projection whose column groups this program covers
        pl.when((col_group >= block_starts[g]) & (col_group < block_starts[g + 1]))(functools.partial(run, g))


def bgmv_fused_gpu(ys, x, lora_as, lora_bs, row_slot, slot_offset, slot_ranks, slot_scales, cfg: TileConfig,
                   interpret: bool):
    """ys[g][b] += scale_g[e] * (x[b] @ A_g[e]) @ B_g[e], e = row_slot[b] + slot_offset, for G
    projections of one input in one launch, each y in place (aliased; rows with slot -1 or rank 0
    untouched).

    ys: G arrays [B, n_g] (n_g multiples of block_n * col_blocks); x [B, k] (k a multiple of
    block_k); lora_as: G stacked pools [P, k, r]; lora_bs: G [P, r, n_g] (r a multiple of
    rank_chunk); row_slot int32 [B]; slot_offset int32 scalar or [1]; slot_ranks int32 /
    slot_scales float32: G tables [P]. -> tuple of G arrays [B, n_g]."""
    groups, batch = len(ys), ys[0].shape[0]
    block_starts = [0]
    for y in ys:
        block_starts.append(block_starts[-1] + y.shape[1] // (cfg.block_n * cfg.col_blocks))
    offset, _ = _offset(slot_offset)
    kernel = functools.partial(_fused_kernel, cfg=cfg, num_chunks=lora_bs[0].shape[1] // cfg.rank_chunk,
                               num_k_blocks=x.shape[1] // cfg.block_k, block_starts=tuple(block_starts))
    first_y = 2 + 2 * groups + 1
    return pl.pallas_call(
        kernel,
        name="bgmv_fused",
        out_shape=tuple(jax.ShapeDtypeStruct(y.shape, y.dtype) for y in ys),
        grid=(batch, block_starts[-1]),
        input_output_aliases={first_y + g: g for g in range(groups)},
        compiler_params=_params(cfg),
        interpret=interpret,
    )(row_slot, offset, *slot_ranks, *slot_scales, x, *ys, *lora_as, *lora_bs)
