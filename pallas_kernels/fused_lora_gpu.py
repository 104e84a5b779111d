"""GPU (Pallas -> Triton) FusedLoRA / FusedMultiLoRA training kernels (LoRAFusion §4.1).

All kernels run on the tile layout of `fused_lora_layout` (every row tile belongs to one adapter
slot; per-tile table passed as whole int32/float32 arrays, since Triton has no scalar prefetch)
and take whole-array refs indexed with `pl.ds`. Shapes arrive padded: rows to T * block_m, k to
a multiple of block_k, n of block_n, the rank axis R (>= 16, a power of two) is one block.

Forward
  D  `shrink`:  S[t] = (mask * x[t]) @ A[slot_t] / (1 - p_t), columns >= rank_t zeroed.
                grid (T,); loop over k blocks. S (x.dtype) is stored and re-read.
  E  `base_expand`: y[t, j] = x[t] @ W[:, j] + s_t * S[t] @ B[slot_t][:, j] in one accumulator.
                grid (T, n / block_n); loop over k blocks.
Backward
  I  `grad_s_b`: one read of dY[t, j] per block feeds both dS[t] += dY[t, j] @ B[:, j]^T and the
                per-tile partial dB_t[:, j] = s_t * S[t]^T @ dY[t, j]. grid (T,); loop over n.
                dS = s_t * (...) masked to rank; dB partials are reduced per slot outside
                (no float atomics).
  K  `grad_a`:  dA_e = sum over the tiles of segment e of (mask * x[t])^T @ dS[t] / (1 - p).
                grid (E segments, k / block_k); each program loops over its segment's tiles
                (they are contiguous), so it owns its output block: no atomics, no partials.
  L  `grad_x`:  dX[t, i] = dY[t] @ W[i, :]^T + mask * (dS[t] @ A[slot_t][i, :]^T) / (1 - p).
                grid (T, k / block_k); loop over n blocks.
Dead tiles (past the used ones) skip all work; their outputs are never read.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.fused_lora_layout import FusedLoRAConfig, TileLayout, dropout_keep

_F32 = jnp.float32
_I32 = jnp.int32


def _params(cfg: FusedLoRAConfig):
    return plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _table(layout: TileLayout):
    return (layout.tile_slot, layout.tile_rank, layout.tile_scale, layout.tile_threshold,
            layout.tile_inv_keep, layout.tile_row0, layout.tile_live)


def _tile(t, slot_ref, rank_ref, scale_ref, thr_ref, inv_ref, row0_ref, live_ref):
    """(slot >= 0, rank, scale, threshold, inv_keep, row0, live, active) of tile t."""
    slot, rank, live = slot_ref[t], rank_ref[t], live_ref[t] > 0
    active = live & (slot >= 0) & (rank > 0)
    return (jnp.maximum(slot, 0), rank, scale_ref[t], thr_ref[t], inv_ref[t], row0_ref[t], live,
            active)


def _masked(x_blk, seed, row0, col0, threshold):
    """Dropout (mask only; the 1/(1-p) is applied to the f32 product) of an x block."""
    def apply(v):
        rows = row0 + lax.broadcasted_iota(_I32, (v.shape[0], 1), 0)
        cols = col0 + lax.broadcasted_iota(_I32, (1, v.shape[1]), 1)
        keep = dropout_keep(seed, rows, cols, threshold)
        return jnp.where(keep, v, jnp.zeros((), v.dtype))
    return lax.cond(threshold > 0, apply, lambda v: v, x_blk)


def _rank_cols(width, rank):
    return lax.broadcasted_iota(_I32, (1, width), 1) < rank


def _nt(a, b):
    """a @ b^T (contract the last dims), f32 accumulation."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def _tn(a, b):
    """a^T @ b (contract the first dims), f32 accumulation."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=_F32)


# --- D: S = dropout(x) @ A -------------------------------------------------------------------

def _shrink_kernel(slot_ref, rank_ref, scale_ref, thr_ref, inv_ref, row0_ref, live_ref,
                   seed_ref, x_ref, a_ref, s_ref, *, bm: int, bk: int, nk: int):
    t = pl.program_id(0)
    slot, rank, _, thr, inv, row0, _, active = _tile(t, slot_ref, rank_ref, scale_ref, thr_ref,
                                                     inv_ref, row0_ref, live_ref)
    seed = seed_ref[0]
    r = s_ref.shape[1]

    @pl.when(active)
    def _compute():
        def body(kb, acc):
            x_blk = _masked(x_ref[pl.ds(t * bm, bm), pl.ds(kb * bk, bk)], seed, row0, kb * bk,
                            thr)
            a_blk = a_ref[slot, pl.ds(kb * bk, bk), :]
            return acc + jnp.dot(x_blk, a_blk, preferred_element_type=_F32)

        acc = lax.fori_loop(0, nk, body, jnp.zeros((bm, r), _F32))
        s = jnp.where(_rank_cols(r, rank), acc * inv, 0.0)
        s_ref[pl.ds(t * bm, bm), :] = s.astype(s_ref.dtype)

    @pl.when(jnp.logical_not(active))
    def _zero():
        s_ref[pl.ds(t * bm, bm), :] = jnp.zeros((bm, r), s_ref.dtype)


def shrink_gpu(x, lora_a, layout: TileLayout, seed, cfg: FusedLoRAConfig, bk: int, interpret):
    """D: x [M, k], lora_a [P, k, R] -> S [M, R] (x.dtype)."""
    num_rows, k = x.shape
    bm = layout.block_m
    kernel = functools.partial(_shrink_kernel, bm=bm, bk=bk, nk=k // bk)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, lora_a.shape[2]), x.dtype),
        grid=(layout.num_tiles,),
        compiler_params=_params(cfg),
        interpret=interpret,
    )(*_table(layout), seed, x, lora_a)


# --- E: y = x @ W + s * S @ B ------------------------------------------------------------------

def _base_expand_kernel(slot_ref, rank_ref, scale_ref, thr_ref, inv_ref, row0_ref, live_ref,
                        x_ref, w_ref, s_ref, b_ref, y_ref, *, bm: int, bk: int, bn: int,
                        nk: int):
    t, j = pl.program_id(0), pl.program_id(1)
    slot, _, scale, _, _, _, live, active = _tile(t, slot_ref, rank_ref, scale_ref, thr_ref,
                                                  inv_ref, row0_ref, live_ref)

    @pl.when(live)
    def _compute():
        def body(kb, acc):
            x_blk = x_ref[pl.ds(t * bm, bm), pl.ds(kb * bk, bk)]
            w_blk = w_ref[pl.ds(kb * bk, bk), pl.ds(j * bn, bn)]
            return acc + jnp.dot(x_blk, w_blk, preferred_element_type=_F32)

        acc = lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), _F32))

        def add_lora(acc):
            s_blk = s_ref[pl.ds(t * bm, bm), :]
            b_blk = b_ref[slot, :, pl.ds(j * bn, bn)]
            return acc + scale * jnp.dot(s_blk, b_blk, preferred_element_type=_F32)

        acc = lax.cond(active, add_lora, lambda acc: acc, acc)
        y_ref[pl.ds(t * bm, bm), pl.ds(j * bn, bn)] = acc.astype(y_ref.dtype)


def base_expand_gpu(x, w, s, lora_b, layout: TileLayout, cfg: FusedLoRAConfig, bk: int, bn: int,
                    interpret):
    """E: x [M, k], w [k, n], S [M, R], lora_b [P, R, n] -> y [M, n] (x.dtype)."""
    num_rows, k = x.shape
    n = w.shape[1]
    bm = layout.block_m
    kernel = functools.partial(_base_expand_kernel, bm=bm, bk=bk, bn=bn, nk=k // bk)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, n), x.dtype),
        grid=(layout.num_tiles, n // bn),
        compiler_params=_params(cfg),
        interpret=interpret,
    )(*_table(layout), x, w, s, lora_b)


# --- I: dS = s * dY B^T and dB partials = s * S^T dY, one read of dY ----------------------------

def _grad_s_b_kernel(slot_ref, rank_ref, scale_ref, thr_ref, inv_ref, row0_ref, live_ref,
                     dy_ref, s_ref, b_ref, ds_ref, dbp_ref, *, bm: int, bn: int, nn: int):
    t = pl.program_id(0)
    slot, rank, scale, _, _, _, _, active = _tile(t, slot_ref, rank_ref, scale_ref, thr_ref,
                                                  inv_ref, row0_ref, live_ref)
    r = s_ref.shape[1]

    @pl.when(active)
    def _compute():
        s_blk = s_ref[pl.ds(t * bm, bm), :]

        def body(j, acc):
            dy_blk = dy_ref[pl.ds(t * bm, bm), pl.ds(j * bn, bn)]
            b_blk = b_ref[slot, :, pl.ds(j * bn, bn)]
            dbp_ref[t, :, pl.ds(j * bn, bn)] = scale * _tn(s_blk, dy_blk)
            return acc + _nt(dy_blk, b_blk)

        acc = lax.fori_loop(0, nn, body, jnp.zeros((bm, r), _F32))
        ds = jnp.where(_rank_cols(r, rank), scale * acc, 0.0)
        ds_ref[pl.ds(t * bm, bm), :] = ds.astype(ds_ref.dtype)

    @pl.when(jnp.logical_not(active))
    def _zero():
        ds_ref[pl.ds(t * bm, bm), :] = jnp.zeros((bm, r), ds_ref.dtype)


def grad_s_b_gpu(dy, s, lora_b, layout: TileLayout, cfg: FusedLoRAConfig, bn: int, interpret):
    """I: dY [M, n], S [M, R], lora_b [P, R, n] -> (dS [M, R] (dY.dtype), dB per-tile partials
    [T, R, n] float32; rows of inactive tiles are not written: mask with tile_active)."""
    num_rows, n = dy.shape
    r = s.shape[1]
    bm = layout.block_m
    kernel = functools.partial(_grad_s_b_kernel, bm=bm, bn=bn, nn=n // bn)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((num_rows, r), dy.dtype),
                   jax.ShapeDtypeStruct((layout.num_tiles, r, n), _F32)),
        grid=(layout.num_tiles,),
        compiler_params=_params(cfg),
        interpret=interpret,
    )(*_table(layout), dy, s, lora_b)


# --- K: dA = xhat^T dS (per segment) -----------------------------------------------------------

def _grad_a_kernel(slot_ref, rank_ref, scale_ref, thr_ref, inv_ref, row0_ref, live_ref,
                   seg_slot_ref, seg_lo_ref, seg_hi_ref, seed_ref, x_ref, ds_ref, da_ref, *,
                   bm: int, bk: int):
    e, kb = pl.program_id(0), pl.program_id(1)
    seed = seed_ref[0]
    r = ds_ref.shape[1]
    lo = seg_lo_ref[e]
    hi = jnp.where(seg_slot_ref[e] >= 0, seg_hi_ref[e], lo)

    def body(t, acc):
        _, _, _, thr, inv, row0, _, active = _tile(t, slot_ref, rank_ref, scale_ref, thr_ref,
                                                   inv_ref, row0_ref, live_ref)

        def add(acc):
            x_blk = _masked(x_ref[pl.ds(t * bm, bm), pl.ds(kb * bk, bk)], seed, row0, kb * bk,
                            thr)
            return acc + inv * _tn(x_blk, ds_ref[pl.ds(t * bm, bm), :])

        return lax.cond(active, add, lambda acc: acc, acc)

    acc = lax.fori_loop(lo, hi, body, jnp.zeros((bk, r), _F32))
    da_ref[e, pl.ds(kb * bk, bk), :] = acc


def grad_a_gpu(x, ds, layout: TileLayout, seed, cfg: FusedLoRAConfig, bk: int, interpret):
    """K: x [M, k], dS [M, R] -> dA per segment [E, k, R] float32 (zero for inactive ones)."""
    k = x.shape[1]
    r = ds.shape[1]
    num_segments = layout.seg_slot.shape[0]
    kernel = functools.partial(_grad_a_kernel, bm=layout.block_m, bk=bk)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_segments, k, r), _F32),
        grid=(num_segments, k // bk),
        compiler_params=_params(cfg),
        interpret=interpret,
    )(*_table(layout), layout.seg_slot, layout.seg_tile_lo, layout.seg_tile_hi, seed, x, ds)


# --- L: dX = dY W^T + mask * (dS A^T) / (1 - p) --------------------------------------------------

def _grad_x_kernel(slot_ref, rank_ref, scale_ref, thr_ref, inv_ref, row0_ref, live_ref,
                   seed_ref, dy_ref, w_ref, ds_ref, a_ref, dx_ref, *, bm: int, bk: int, bn: int,
                   nn: int):
    t, i = pl.program_id(0), pl.program_id(1)
    slot, _, _, thr, inv, row0, live, active = _tile(t, slot_ref, rank_ref, scale_ref, thr_ref,
                                                     inv_ref, row0_ref, live_ref)
    seed = seed_ref[0]

    @pl.when(live)
    def _compute():
        def body(j, acc):
            dy_blk = dy_ref[pl.ds(t * bm, bm), pl.ds(j * bn, bn)]
            w_blk = w_ref[pl.ds(i * bk, bk), pl.ds(j * bn, bn)]
            return acc + _nt(dy_blk, w_blk)

        acc = lax.fori_loop(0, nn, body, jnp.zeros((bm, bk), _F32))

        def add_lora(acc):
            lora = _nt(ds_ref[pl.ds(t * bm, bm), :], a_ref[slot, pl.ds(i * bk, bk), :]) * inv
            return acc + _masked(lora, seed, row0, i * bk, thr)

        acc = lax.cond(active, add_lora, lambda acc: acc, acc)
        dx_ref[pl.ds(t * bm, bm), pl.ds(i * bk, bk)] = acc.astype(dx_ref.dtype)


def grad_x_gpu(dy, w, ds, lora_a, layout: TileLayout, seed, cfg: FusedLoRAConfig, bk: int,
               bn: int, interpret):
    """L: dY [M, n], w [k, n], dS [M, R], lora_a [P, k, R] -> dX [M, k] (dY.dtype)."""
    num_rows, n = dy.shape
    k = w.shape[0]
    kernel = functools.partial(_grad_x_kernel, bm=layout.block_m, bk=bk, bn=bn, nn=n // bn)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, k), dy.dtype),
        grid=(layout.num_tiles, k // bk),
        compiler_params=_params(cfg),
        interpret=interpret,
    )(*_table(layout), seed, dy, w, ds, lora_a)
