"""GPU (Pallas -> Triton) BGMV kernels for decode: one row per request, each its own adapter.

Memory-bound GEMV: one program per row (x split-K programs for shrink, x column blocks for
expand). A single row is below Triton's 16-row dot minimum, so the products are
broadcast-multiply + reduce in f32. Mixed ranks: static `rank_chunk`-wide chunks of A/B run
under `lax.cond(chunk_start < rank)`, so a row never reads A/B columns beyond its rank chunk.
Per-row metadata arrives as whole int32/f32 arrays.

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


def _shrink_kernel(slot_ref, rank_ref, x_ref, a_ref, out_ref, *, cfg: TileConfig,
                   num_chunks: int, num_k_blocks: int):
    row, split = pl.program_id(0), pl.program_id(1)
    bk, rc = cfg.block_k, cfg.rank_chunk
    slot, rank = slot_ref[row], rank_ref[row]
    active = slot >= 0
    slot = jnp.maximum(slot, 0)
    per_split = -(-num_k_blocks // cfg.k_splits)
    kb_lo = split * per_split
    kb_hi = jnp.minimum(kb_lo + per_split, num_k_blocks)

    def k_body(kb, accs):
        x_blk = x_ref[row, pl.ds(kb * bk, bk)].astype(_F32)
        out = []
        for c in range(num_chunks):
            def add(acc, c=c):
                a_blk = a_ref[slot, pl.ds(kb * bk, bk), pl.ds(c * rc, rc)].astype(_F32)
                return acc + jnp.sum(x_blk[:, None] * a_blk, axis=0)
            out.append(lax.cond(active & (c * rc < rank), add, lambda acc: acc, accs[c]))
        return tuple(out)

    zeros = tuple(jnp.zeros((rc,), _F32) for _ in range(num_chunks))
    accs = lax.fori_loop(kb_lo, kb_hi, k_body, zeros)
    for c in range(num_chunks):
        cols = c * rc + lax.broadcasted_iota(jnp.int32, (rc,), 0)
        out_ref[split, row, pl.ds(c * rc, rc)] = jnp.where(cols < rank, accs[c], 0.0)


def bgmv_shrink_gpu(x, lora_a, row_slot, row_rank, cfg: TileConfig, interpret: bool):
    """v[b] = x[b] @ A[slot[b]] (rank-masked). x [B, k], lora_a [slots, k, r] -> [B, r]."""
    batch, k = x.shape
    r_max = lora_a.shape[-1]
    kernel = functools.partial(_shrink_kernel, cfg=cfg, num_chunks=r_max // cfg.rank_chunk,
                               num_k_blocks=k // cfg.block_k)
    partial_sums = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((cfg.k_splits, batch, r_max), _F32),
        grid=(batch, cfg.k_splits),
        compiler_params=_params(cfg),
        interpret=interpret,
    )(row_slot, row_rank, x, lora_a)
    return partial_sums.sum(axis=0).astype(x.dtype)


def _expand_kernel(slot_ref, rank_ref, scale_ref, y_ref, v_ref, b_ref, out_ref, *,
                   cfg: TileConfig, num_chunks: int):
    row, col_block = pl.program_id(0), pl.program_id(1)
    bn, rc = cfg.block_n, cfg.rank_chunk
    col0 = col_block * bn
    slot, rank = slot_ref[row], rank_ref[row]
    active = slot >= 0
    slot = jnp.maximum(slot, 0)
    delta = jnp.zeros((bn,), _F32)
    for c in range(num_chunks):
        def add(d, c=c):
            ranks = c * rc + lax.broadcasted_iota(jnp.int32, (rc,), 0)
            v_blk = jnp.where(ranks < rank, v_ref[row, pl.ds(c * rc, rc)].astype(_F32), 0.0)
            b_blk = b_ref[slot, pl.ds(c * rc, rc), pl.ds(col0, bn)].astype(_F32)
            b_blk = jnp.where(ranks[:, None] < rank, b_blk, 0.0)
            return d + jnp.sum(v_blk[:, None] * b_blk, axis=0)
        delta = lax.cond(active & (c * rc < rank), add, lambda d: d, delta)
    y_blk = y_ref[row, pl.ds(col0, bn)]
    out = y_blk.astype(_F32) + jnp.where(active, scale_ref[row], 0.0) * delta
    out_ref[row, pl.ds(col0, bn)] = jnp.where(active, out.astype(y_blk.dtype), y_blk)


def bgmv_expand_gpu(y, v, lora_b, row_slot, row_rank, row_scale, cfg: TileConfig,
                    interpret: bool):
    """y[b] += scale[b] * v[b] @ B[slot[b]], in place (y aliased to the output).

    y [B, n], v [B, r], lora_b [slots, r, n] -> [B, n] (y.dtype).
    """
    batch, n = y.shape
    kernel = functools.partial(_expand_kernel, cfg=cfg,
                               num_chunks=lora_b.shape[1] // cfg.rank_chunk)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=(batch, n // cfg.block_n),
        input_output_aliases={3: 0},
        compiler_params=_params(cfg),
        interpret=interpret,
    )(row_slot, row_rank, row_scale, y, v, lora_b)
