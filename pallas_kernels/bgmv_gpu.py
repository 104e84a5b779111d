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


def _shrink_kernel(slot_ref, offset_ref, rank_ref, x_ref, a_ref, out_ref, *, cfg: TileConfig,
                   num_chunks: int, num_k_blocks: int, by_entry: bool):
    row, split = pl.program_id(0), pl.program_id(1)
    bk, rc = cfg.block_k, cfg.rank_chunk
    slot, rank, active = _row(row, slot_ref, offset_ref, rank_ref, a_ref.shape[-1], by_entry)
    per_split = -(-num_k_blocks // cfg.k_splits)
    kb_lo = split * per_split
    kb_hi = jnp.minimum(kb_lo + per_split, num_k_blocks)

    def k_body(kb, accs):
        k0 = pl.multiple_of(kb * bk, bk)
        x_blk = x_ref[row, pl.ds(k0, bk)].astype(_F32)

        def add(acc, c):
            a_blk = a_ref[slot, pl.ds(k0, bk), pl.ds(c * rc, rc)].astype(_F32)
            return acc + jnp.sum(x_blk[:, None] * a_blk, axis=0)

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
    row, col_block = pl.program_id(0), pl.program_id(1)
    bn, rc = cfg.block_n, cfg.rank_chunk
    col0 = pl.multiple_of(col_block * bn, bn)
    slot, rank, active = _row(row, slot_ref, offset_ref, rank_ref, b_ref.shape[1], by_entry)
    scale = scale_ref[slot if by_entry else row]

    def add(d, c):
        ranks = c * rc + lax.broadcasted_iota(jnp.int32, (rc,), 0)
        v = v_ref[0, row, pl.ds(c * rc, rc)].astype(_F32)
        for part in range(1, v_ref.shape[0]):
            v = v + v_ref[part, row, pl.ds(c * rc, rc)].astype(_F32)
        v = jnp.where(ranks < rank, v, 0.0)
        b_blk = b_ref[slot, pl.ds(c * rc, rc), pl.ds(col0, bn)].astype(_F32)
        b_blk = jnp.where(ranks[:, None] < rank, b_blk, 0.0)
        return d + jnp.sum(v[:, None] * b_blk, axis=0)

    @pl.when(active)
    def _():
        delta = add(jnp.zeros((bn,), _F32), 0)
        for c in range(1, num_chunks):
            delta = lax.cond(c * rc < rank, functools.partial(add, c=c), lambda d: d, delta)
        y_blk = y_ref[row, pl.ds(col0, bn)]
        out = y_blk.astype(_F32) + scale * delta
        out_ref[row, pl.ds(col0, bn)] = out.astype(out_ref.dtype)


def bgmv_expand_gpu(y, v, lora_b, row_slot, row_rank, row_scale, cfg: TileConfig,
                    interpret: bool, slot_offset=None):
    """y[b] += scale[b] * v[b] @ B[slot[b]], in place (y aliased to the output; rows with
    slot -1 or rank 0 are not touched).

    y [B, n], v [B, r] or split-K partials [parts, B, r] (summed here), lora_b [slots, r, n]
    -> [B, n] (y.dtype). row_rank/row_scale [B]; with slot_offset (stacked pool, see the
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
        grid=(batch, n // cfg.block_n),
        input_output_aliases={4: 0},
        compiler_params=_params(cfg),
        interpret=interpret,
    )(row_slot, offset, row_rank, row_scale, y, v, lora_b)
