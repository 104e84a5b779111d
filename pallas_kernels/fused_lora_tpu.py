"""TPU (Pallas -> Mosaic) FusedLoRA / FusedMultiLoRA training kernels (LoRAFusion §4.1).

Same five kernels as `fused_lora_gpu` (D, E, I, K, L; see there for the math) on the same tile
layout, written for Mosaic: the per-tile table (slot, rank, scale, dropout threshold and
1/(1-p), first caller row, live flag, segment) and the seed are scalar-prefetched into SMEM
(`pltpu.PrefetchScalarGridSpec`) and drive the BlockSpec index maps, so the A/B blocks of a
tile's adapter are DMA'd by the pipeline; contractions are sequential ("arbitrary") grid axes
with a VMEM f32 accumulator.

Accumulation across row tiles (dA, dB) uses the sequential grid instead of atomics: the tiles
of one segment are consecutive, so a per-segment output block stays resident in VMEM while the
segment's tiles are visited; it is zeroed on the segment's first tile and written back when the
block index changes. Segments that no tile visits are never written: the dispatcher masks them
with `TileLayout.seg_active`.

  D  grid (T, k/bk):           S[t] += (mask * x[t, kb]) @ A[slot][kb]
  E  grid (T, n/bn, k/bk):     acc += x[t, kb] @ W[kb, j]; last kb: + s * S[t] @ B[slot][:, j]
  I  grid (T, n/bn):           dS[t] += dY[t, j] @ B[slot][:, j]^T and
                               dB[seg_t][:, j] += s * S[t]^T @ dY[t, j]   (one dY block read)
  K  grid (k/bk, T):           dA[seg_t][kb] += (mask * x[t, kb])^T @ dS[t] / (1 - p)
  L  grid (T, k/bk, n/bn):     acc += dY[t, j] @ W[kb, j]^T; last j: + mask * dS[t] @ A^T / (1-p)

Only checked in interpret mode here. Mosaic needs block_m % 8 == 0 (16 for bf16) and lane blocks
(block_k, block_n, R) that are multiples of 128 or the whole dimension.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.fused_lora_layout import TileLayout, dropout_keep

_F32 = jnp.float32
_I32 = jnp.int32
_NUM_PREFETCH = 9


def _params(*semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _prefetch(layout: TileLayout, seed):
    return (layout.tile_slot, layout.tile_rank, layout.tile_scale, layout.tile_threshold,
            layout.tile_inv_keep, layout.tile_row0, layout.tile_live, layout.tile_seg, seed)


class _Table:
    """Scalar-prefetched per-tile table (SMEM refs), in `_prefetch` order."""

    def __init__(self, refs):
        (self.slot, self.rank, self.scale, self.thr, self.inv, self.row0, self.live, self.seg,
         self.seed) = refs

    def slot_of(self, t):
        return jnp.maximum(self.slot[t], 0)

    def active(self, t):
        return (self.live[t] > 0) & (self.slot[t] >= 0) & (self.rank[t] > 0)

    def first_of_segment(self, t):
        return (t == 0) | (self.seg[jnp.maximum(t - 1, 0)] != self.seg[t])


def _split(refs):
    return _Table(refs[:_NUM_PREFETCH]), refs[_NUM_PREFETCH:]


def _masked(v, table: _Table, t, col0):
    rows = table.row0[t] + lax.broadcasted_iota(_I32, v.shape, 0)
    cols = col0 + lax.broadcasted_iota(_I32, v.shape, 1)
    keep = dropout_keep(table.seed[0], rows, cols, table.thr[t])
    return jnp.where(keep, v, jnp.zeros((), v.dtype))


def _rank_cols(shape, rank):
    return lax.broadcasted_iota(_I32, shape, 1) < rank


def _nt(a, b):
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def _tn(a, b):
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=_F32)


def _call(kernel, layout, seed, grid, in_specs, out_specs, out_shape, scratch, semantics,
          interpret, *args):
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=_NUM_PREFETCH, grid=grid, in_specs=in_specs,
            out_specs=out_specs, scratch_shapes=scratch),
        compiler_params=_params(*semantics),
        interpret=interpret,
    )(*_prefetch(layout, seed), *args)


# Index maps get (*grid indices, *prefetch refs); the prefetch refs are wrapped in a _Table.
def _imap(fn, num_grid):
    def index_map(*args):
        return fn(*args[:num_grid], _Table(args[num_grid:]))
    return index_map


# --- D ---------------------------------------------------------------------------------------

def _shrink_kernel(*refs, nk: int):
    table, (x_ref, a_ref, s_ref, acc_ref) = _split(refs)
    t, kb = pl.program_id(0), pl.program_id(1)
    active = table.active(t)

    @pl.when(kb == 0)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(active)
    def _accumulate():
        x_blk = _masked(x_ref[...], table, t, kb * x_ref.shape[1])
        acc_ref[...] += jnp.dot(x_blk, a_ref[...], preferred_element_type=_F32)

    @pl.when(kb == nk - 1)
    def _store():
        s = jnp.where(_rank_cols(acc_ref.shape, table.rank[t]), acc_ref[...] * table.inv[t], 0.0)
        s_ref[...] = s.astype(s_ref.dtype)


def shrink_tpu(x, lora_a, layout: TileLayout, seed, bk: int, interpret):
    """D: x [M, k], lora_a [P, k, R] -> S [M, R] (x.dtype)."""
    num_rows, k = x.shape
    r = lora_a.shape[2]
    bm, nk = layout.block_m, k // bk
    return _call(
        functools.partial(_shrink_kernel, nk=nk), layout, seed, (layout.num_tiles, nk),
        [pl.BlockSpec((bm, bk), _imap(lambda t, kb, tb: (t, kb), 2)),
         pl.BlockSpec((None, bk, r), _imap(lambda t, kb, tb: (tb.slot_of(t), kb, 0), 2))],
        pl.BlockSpec((bm, r), _imap(lambda t, kb, tb: (t, 0), 2)),
        jax.ShapeDtypeStruct((num_rows, r), x.dtype), [pltpu.VMEM((bm, r), _F32)],
        ("parallel", "arbitrary"), interpret, x, lora_a)


# --- E ---------------------------------------------------------------------------------------

def _base_expand_kernel(*refs, nk: int):
    table, (x_ref, w_ref, s_ref, b_ref, y_ref, acc_ref) = _split(refs)
    t, kb = pl.program_id(0), pl.program_id(2)
    live = table.live[t] > 0

    @pl.when(kb == 0)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(live)
    def _accumulate():
        acc_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=_F32)

    @pl.when((kb == nk - 1) & table.active(t))
    def _lora():
        acc_ref[...] += table.scale[t] * jnp.dot(s_ref[...], b_ref[...],
                                                 preferred_element_type=_F32)

    @pl.when(kb == nk - 1)
    def _store():
        y_ref[...] = acc_ref[...].astype(y_ref.dtype)


def base_expand_tpu(x, w, s, lora_b, layout: TileLayout, seed, bk: int, bn: int, interpret):
    """E: x [M, k], w [k, n], S [M, R], lora_b [P, R, n] -> y [M, n] (x.dtype)."""
    num_rows, k = x.shape
    n = w.shape[1]
    r = s.shape[1]
    bm, nk = layout.block_m, k // bk
    return _call(
        functools.partial(_base_expand_kernel, nk=nk), layout, seed,
        (layout.num_tiles, n // bn, nk),
        [pl.BlockSpec((bm, bk), _imap(lambda t, j, kb, tb: (t, kb), 3)),
         pl.BlockSpec((bk, bn), _imap(lambda t, j, kb, tb: (kb, j), 3)),
         pl.BlockSpec((bm, r), _imap(lambda t, j, kb, tb: (t, 0), 3)),
         pl.BlockSpec((None, r, bn), _imap(lambda t, j, kb, tb: (tb.slot_of(t), 0, j), 3))],
        pl.BlockSpec((bm, bn), _imap(lambda t, j, kb, tb: (t, j), 3)),
        jax.ShapeDtypeStruct((num_rows, n), x.dtype), [pltpu.VMEM((bm, bn), _F32)],
        ("parallel", "parallel", "arbitrary"), interpret, x, w, s, lora_b)


# --- I ---------------------------------------------------------------------------------------

def _grad_s_b_kernel(*refs, nn: int, bn: int):
    table, (dy_ref, s_ref, b_ref, ds_ref, db_ref, acc_ref) = _split(refs)
    t, j = pl.program_id(0), pl.program_id(1)
    active = table.active(t)

    @pl.when(j == 0)
    def _zero_ds():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(table.first_of_segment(t) & (j == 0))
    def _zero_db():
        db_ref[...] = jnp.zeros_like(db_ref)

    @pl.when(active)
    def _accumulate():
        dy_blk = dy_ref[...]
        acc_ref[...] += _nt(dy_blk, b_ref[...])
        cols = pl.ds(pl.multiple_of(j * bn, bn), bn)
        db_ref[:, cols] += table.scale[t] * _tn(s_ref[...], dy_blk)

    @pl.when(j == nn - 1)
    def _store():
        ds = jnp.where(_rank_cols(acc_ref.shape, table.rank[t]), table.scale[t] * acc_ref[...],
                       0.0)
        ds_ref[...] = ds.astype(ds_ref.dtype)


def grad_s_b_tpu(dy, s, lora_b, layout: TileLayout, seed, bn: int, interpret):
    """I: dY [M, n], S [M, R], lora_b [P, R, n] -> (dS [M, R] (dY.dtype), dB per segment
    [E, R, n] float32; segments without active tiles are not written)."""
    num_rows, n = dy.shape
    r = s.shape[1]
    bm, nn = layout.block_m, n // bn
    num_segments = layout.seg_slot.shape[0]
    return _call(
        functools.partial(_grad_s_b_kernel, nn=nn, bn=bn), layout, seed, (layout.num_tiles, nn),
        [pl.BlockSpec((bm, bn), _imap(lambda t, j, tb: (t, j), 2)),
         pl.BlockSpec((bm, r), _imap(lambda t, j, tb: (t, 0), 2)),
         pl.BlockSpec((None, r, bn), _imap(lambda t, j, tb: (tb.slot_of(t), 0, j), 2))],
        [pl.BlockSpec((bm, r), _imap(lambda t, j, tb: (t, 0), 2)),
         pl.BlockSpec((None, r, n), _imap(lambda t, j, tb: (tb.seg[t], 0, 0), 2))],
        (jax.ShapeDtypeStruct((num_rows, r), dy.dtype),
         jax.ShapeDtypeStruct((num_segments, r, n), _F32)),
        [pltpu.VMEM((bm, r), _F32)], ("arbitrary", "arbitrary"), interpret, dy, s, lora_b)


# --- K ---------------------------------------------------------------------------------------

def _grad_a_kernel(*refs):
    table, (x_ref, ds_ref, da_ref) = _split(refs)
    kb, t = pl.program_id(0), pl.program_id(1)

    @pl.when(table.first_of_segment(t))
    def _zero():
        da_ref[...] = jnp.zeros_like(da_ref)

    @pl.when(table.active(t))
    def _accumulate():
        x_blk = _masked(x_ref[...], table, t, kb * x_ref.shape[1])
        da_ref[...] += table.inv[t] * _tn(x_blk, ds_ref[...])


def grad_a_tpu(x, ds, layout: TileLayout, seed, bk: int, interpret):
    """K: x [M, k], dS [M, R] -> dA per segment [E, k, R] float32 (unvisited segments unset)."""
    k = x.shape[1]
    r = ds.shape[1]
    bm = layout.block_m
    num_segments = layout.seg_slot.shape[0]
    return _call(
        _grad_a_kernel, layout, seed, (k // bk, layout.num_tiles),
        [pl.BlockSpec((bm, bk), _imap(lambda kb, t, tb: (t, kb), 2)),
         pl.BlockSpec((bm, r), _imap(lambda kb, t, tb: (t, 0), 2))],
        pl.BlockSpec((None, bk, r), _imap(lambda kb, t, tb: (tb.seg[t], kb, 0), 2)),
        jax.ShapeDtypeStruct((num_segments, k, r), _F32), [],
        ("parallel", "arbitrary"), interpret, x, ds)


# --- L ---------------------------------------------------------------------------------------

def _grad_x_kernel(*refs, nn: int):
    table, (dy_ref, w_ref, ds_ref, a_ref, dx_ref, acc_ref) = _split(refs)
    t, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(j == 0)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(table.live[t] > 0)
    def _accumulate():
        acc_ref[...] += _nt(dy_ref[...], w_ref[...])

    @pl.when((j == nn - 1) & table.active(t))
    def _lora():
        lora = _nt(ds_ref[...], a_ref[...]) * table.inv[t]
        acc_ref[...] += _masked(lora, table, t, i * dx_ref.shape[1])

    @pl.when(j == nn - 1)
    def _store():
        dx_ref[...] = acc_ref[...].astype(dx_ref.dtype)


def grad_x_tpu(dy, w, ds, lora_a, layout: TileLayout, seed, bk: int, bn: int, interpret):
    """L: dY [M, n], w [k, n], dS [M, R], lora_a [P, k, R] -> dX [M, k] (dY.dtype)."""
    num_rows, n = dy.shape
    k = w.shape[0]
    r = ds.shape[1]
    bm, nn = layout.block_m, n // bn
    return _call(
        functools.partial(_grad_x_kernel, nn=nn), layout, seed, (layout.num_tiles, k // bk, nn),
        [pl.BlockSpec((bm, bn), _imap(lambda t, i, j, tb: (t, j), 3)),
         pl.BlockSpec((bk, bn), _imap(lambda t, i, j, tb: (i, j), 3)),
         pl.BlockSpec((bm, r), _imap(lambda t, i, j, tb: (t, 0), 3)),
         pl.BlockSpec((None, bk, r), _imap(lambda t, i, j, tb: (tb.slot_of(t), i, 0), 3))],
        pl.BlockSpec((bm, bk), _imap(lambda t, i, j, tb: (t, i), 3)),
        jax.ShapeDtypeStruct((num_rows, k), dy.dtype), [pltpu.VMEM((bm, bk), _F32)],
        ("parallel", "parallel", "arbitrary"), interpret, dy, w, ds, lora_a)
