"""GPU (Pallas -> Triton) FusedLoRA / FusedMultiLoRA training kernels (LoRAFusion §4.1).

All kernels run on the tile layout of `fused_lora_layout` (every row tile belongs to one adapter
slot; per-tile table passed as whole int32/float32 arrays, since Triton has no scalar prefetch)
and take whole-array refs indexed with `pl.ds`. x / dY are read and y / dX written in the
caller's row order: row tile t covers caller rows tile_row0[t] .. + tile_nrows[t] - 1, loaded and
stored with row masks, so no gathered copy of x, y, dY or dX is ever made. The first tile_skip[t]
rows of a tile's range are not its own (block-aligned layouts for the Mosaic GPU GEMMs): they
read as zero and are never written. The small S / dS
[T * block_m, R] live in the padded tile layout (row t * block_m + i). Columns arrive padded:
k to whole k blocks, n to whole n blocks, the rank axis R (>= 16, a power of two) is one block.
Each kernel has its own blocks / warps / stages (`FusedLoRAConfig.kernel(name)`); a kernel's
row block divides the layout's block_m (a row tile is split into sub-tiles of one slot).

Forward
  D  `shrink`:  S[t] = (mask * x[t]) @ A[slot_t] / (1 - p_t), columns >= rank_t zeroed.
                grid (row sub-tiles,); loop over k blocks. S (x.dtype) is stored and re-read.
  E  `base_expand`: y[t, j] = x[t] @ W[:, j] + s_t * S[t] @ B[slot_t][:, j] in one accumulator
                (the LoRA term is the GEMM's epilogue). 1-D grid in grouped (swizzled) order
                over (row blocks, n blocks); loop over k blocks.
Backward
  I  `grad_s_b`: one read of dY[t, j] per block feeds both the dS partial of column block j,
                dY[t, j] @ B[:, j]^T, and the per-tile dB partial s_t * S[t]^T @ dY[t, j].
                grid (T, n / block_n); each program loops over its tile's row sub-blocks. dS
                partials [n / block_n, T * block_m, R] and dB partials [T, R, n] (float32) are
                summed outside (no float atomics).
  K  `grad_a`:  dA_e = sum over the tiles of segment e of (mask * x[t])^T @ dS[t] / (1 - p).
                grid (E segments, k / block_k, splits); each program sums a contiguous share of
                its segment's tiles; the shares are added outside.
  L  `grad_x`:  dX[t, i] = dY[t] @ W[i, :]^T + mask * (dS[t] @ A[slot_t][i, :]^T) / (1 - p).
                1-D grouped grid over (row blocks, k blocks); loop over n blocks.
Dead tiles (past the used ones) skip all work; their outputs are never read.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.fused_lora_layout import FusedLoRAConfig, TileLayout, dropout_keep, fit_block

_F32 = jnp.float32
_I32 = jnp.int32


def _params(cfg: FusedLoRAConfig):
    return plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _table(layout: TileLayout):
    return (layout.tile_slot, layout.tile_rank, layout.tile_scale, layout.tile_threshold,
            layout.tile_inv_keep, layout.tile_row0, layout.tile_nrows, layout.tile_live,
            layout.tile_skip)


_NT = 9  # arrays in `_table`


class _Tile:
    """The lookup-table entry of tile t (refs of `_table`, read as scalars)."""

    def __init__(self, refs, t):
        slot_ref, rank_ref, scale_ref, thr_ref, inv_ref, row0_ref, nrows_ref, live_ref, skip_ref = refs
        slot = slot_ref[t]
        self.skip = skip_ref[t]
        self.rank, self.scale, self.thr, self.inv = rank_ref[t], scale_ref[t], thr_ref[t], inv_ref[t]
        self.row0, self.nrows = row0_ref[t], nrows_ref[t]
        self.live = live_ref[t] > 0
        self.active = self.live & (slot >= 0) & (self.rank > 0)
        self.slot = jnp.maximum(slot, 0)


def _row_mask(nskip, nvalid, shape):
    """[bm, w] mask of the block's rows nskip <= i < nvalid."""
    rows = lax.broadcasted_iota(_I32, (shape[0], 1), 0)
    return jnp.broadcast_to((rows >= nskip) & (rows < nvalid), shape)


def _load_rows(ref, row_start, nskip, nvalid, col0, shape):
    """ref[row_start + i, col0 + c] for the block `shape`; rows i < nskip or >= nvalid read 0."""
    return plt.load(ref.at[pl.ds(row_start, shape[0]), pl.ds(col0, shape[1])],
                    mask=_row_mask(nskip, nvalid, shape), other=0)


def _store_rows(ref, row_start, nskip, nvalid, col0, value):
    plt.store(ref.at[pl.ds(row_start, value.shape[0]), pl.ds(col0, value.shape[1])], value,
              mask=_row_mask(nskip, nvalid, value.shape))


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


def _div(a, b):
    """a // b for non-negative int32 scalars (lax.div: jnp's floor division does not lower to
    Triton in jax 0.11)."""
    return lax.div(jnp.asarray(a, _I32), jnp.asarray(b, _I32))


def _rem(a, b):
    return lax.rem(jnp.asarray(a, _I32), jnp.asarray(b, _I32))


def _grouped(pid, num_m: int, num_n: int, group: int):
    """Swizzled (row block, column block) of a 1-D program id: `group` row blocks sweep the
    columns together, so their x rows and W columns stay in L2."""
    per_group = group * num_n
    first_m = _div(pid, per_group) * group
    size = jnp.minimum(num_m - first_m, group)
    within = _rem(pid, per_group)
    return first_m + _rem(within, size), _div(within, size)


def _fit(target: int, dim: int) -> int:
    block = fit_block("gpu", target, dim)
    if dim % block:
        raise ValueError(f"dimension {dim} is not padded to a multiple of block {block}")
    return block


def _sub_rows(layout_bm: int, cfg: FusedLoRAConfig) -> int:
    bm = min(cfg.block_m, layout_bm)
    if layout_bm % bm:
        raise ValueError(f"kernel block_m {bm} must divide the layout's {layout_bm}")
    return bm


# --- D: S = dropout(x) @ A -------------------------------------------------------------------

def _shrink_kernel(*refs, bm: int, ratio: int, bk: int, nk: int):
    table, (seed_ref, x_ref, a_ref, s_ref) = refs[:_NT], refs[_NT:]
    p = pl.program_id(0)
    t, sub = _div(p, ratio), _rem(p, ratio)
    tile = _Tile(table, t)
    seed = seed_ref[0]
    r = s_ref.shape[1]
    row_start = tile.row0 + sub * bm
    nvalid = tile.nrows - sub * bm

    @pl.when(tile.active & (nvalid > 0))
    def _compute():
        def body(kb, acc):
            x_blk = _load_rows(x_ref, row_start, tile.skip - sub * bm, nvalid, kb * bk, (bm, bk))
            x_blk = _masked(x_blk, seed, row_start, kb * bk, tile.thr)
            a_blk = a_ref[tile.slot, pl.ds(kb * bk, bk), :]
            return acc + jnp.dot(x_blk, a_blk, preferred_element_type=_F32)

        acc = lax.fori_loop(0, nk, body, jnp.zeros((bm, r), _F32))
        s = jnp.where(_rank_cols(r, tile.rank), acc * tile.inv, 0.0)
        s_ref[pl.ds(p * bm, bm), :] = s.astype(s_ref.dtype)

    @pl.when(tile.live & jnp.logical_not(tile.active & (nvalid > 0)))
    def _zero():
        s_ref[pl.ds(p * bm, bm), :] = jnp.zeros((bm, r), s_ref.dtype)


def shrink_gpu(x, lora_a, layout: TileLayout, seed, cfg: FusedLoRAConfig, interpret):
    """D: x [m, k] (caller rows), lora_a [P, k, R] -> S [T * block_m, R] (x.dtype)."""
    k = x.shape[1]
    kcfg = cfg.kernel("shrink")
    bm = _sub_rows(layout.block_m, kcfg)
    bk = _fit(kcfg.block_k, k)
    ratio = layout.block_m // bm
    kernel = functools.partial(_shrink_kernel, bm=bm, ratio=ratio, bk=bk, nk=k // bk)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((layout.num_tiles * layout.block_m, lora_a.shape[2]),
                                       x.dtype),
        grid=(layout.num_tiles * ratio,),
        compiler_params=_params(kcfg),
        interpret=interpret,
    )(*_table(layout), seed, x, lora_a)


# --- E: y = x @ W + s * S @ B ------------------------------------------------------------------

def _base_expand_kernel(*refs, bm: int, ratio: int, bk: int, bn: int, nk: int, num_m: int,
                        num_n: int, group: int):
    table, (x_ref, w_ref, s_ref, b_ref, y_ref) = refs[:_NT], refs[_NT:]
    pm, j = _grouped(pl.program_id(0), num_m, num_n, group)
    t, sub = _div(pm, ratio), _rem(pm, ratio)
    tile = _Tile(table, t)
    row_start = tile.row0 + sub * bm
    nskip, nvalid = tile.skip - sub * bm, tile.nrows - sub * bm

    @pl.when(tile.live & (nvalid > 0))
    def _compute():
        def body(kb, acc):
            x_blk = _load_rows(x_ref, row_start, nskip, nvalid, kb * bk, (bm, bk))
            w_blk = w_ref[pl.ds(kb * bk, bk), pl.ds(j * bn, bn)]
            return acc + jnp.dot(x_blk, w_blk, preferred_element_type=_F32)

        acc = lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), _F32))

        def add_lora(acc):
            s_blk = s_ref[pl.ds(pm * bm, bm), :]
            b_blk = b_ref[tile.slot, :, pl.ds(j * bn, bn)]
            return acc + tile.scale * jnp.dot(s_blk, b_blk, preferred_element_type=_F32)

        acc = lax.cond(tile.active, add_lora, lambda acc: acc, acc)
        _store_rows(y_ref, row_start, nskip, nvalid, j * bn, acc.astype(y_ref.dtype))


def base_expand_gpu(x, w, s, lora_b, layout: TileLayout, cfg: FusedLoRAConfig, interpret):
    """E: x [m, k], w [k, n], S [T * block_m, R], lora_b [P, R, n] -> y [m, n] (x.dtype)."""
    m, k = x.shape
    n = w.shape[1]
    kcfg = cfg.kernel("base_expand")
    bm = _sub_rows(layout.block_m, kcfg)
    bk, bn = _fit(kcfg.block_k, k), _fit(kcfg.block_n, n)
    ratio = layout.block_m // bm
    num_m, num_n = layout.num_tiles * ratio, n // bn
    kernel = functools.partial(_base_expand_kernel, bm=bm, ratio=ratio, bk=bk, bn=bn,
                               nk=k // bk, num_m=num_m, num_n=num_n, group=cfg.group_m)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(num_m * num_n,),
        compiler_params=_params(kcfg),
        interpret=interpret,
    )(*_table(layout), x, w, s, lora_b)


# --- I: dS = s * dY B^T and dB partials = s * S^T dY, one read of dY ----------------------------

def _grad_s_b_kernel(*refs, bm: int, ratio: int, bn: int):
    table, (dy_ref, s_ref, b_ref, dsp_ref, dbp_ref) = refs[:_NT], refs[_NT:]
    t, j = pl.program_id(0), pl.program_id(1)
    tile = _Tile(table, t)
    r = s_ref.shape[1]
    layout_bm = bm * ratio

    @pl.when(tile.active)
    def _compute():
        b_blk = b_ref[tile.slot, :, pl.ds(j * bn, bn)]
        keep_rank = _rank_cols(r, tile.rank)

        def body(sub, db):
            nvalid = tile.nrows - sub * bm
            dy_blk = _load_rows(dy_ref, tile.row0 + sub * bm, tile.skip - sub * bm, nvalid,
                                j * bn, (bm, bn))
            s_blk = s_ref[pl.ds(t * layout_bm + sub * bm, bm), :]
            ds = jnp.where(keep_rank, tile.scale * _nt(dy_blk, b_blk), 0.0)
            dsp_ref[j, pl.ds(t * layout_bm + sub * bm, bm), :] = ds
            return db + _tn(s_blk, dy_blk)

        db = lax.fori_loop(0, ratio, body, jnp.zeros((r, bn), _F32))
        dbp_ref[t, :, pl.ds(j * bn, bn)] = tile.scale * db


def grad_s_b_gpu(dy, s, lora_b, layout: TileLayout, cfg: FusedLoRAConfig, interpret):
    """I: dY [m, n], S [T * block_m, R], lora_b [P, R, n] -> (dS partials
    [n / block_n, T * block_m, R] float32 (sum them), dB per-tile partials [T, R, n] float32).
    Rows of inactive tiles are not written: mask with tile_active."""
    n = dy.shape[1]
    r = s.shape[1]
    kcfg = cfg.kernel("grad_s_b")
    bm = _sub_rows(layout.block_m, kcfg)
    bn = _fit(kcfg.block_n, n)
    kernel = functools.partial(_grad_s_b_kernel, bm=bm, ratio=layout.block_m // bm, bn=bn)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((n // bn, s.shape[0], r), _F32),
                   jax.ShapeDtypeStruct((layout.num_tiles, r, n), _F32)),
        grid=(layout.num_tiles, n // bn),
        compiler_params=_params(kcfg),
        interpret=interpret,
    )(*_table(layout), dy, s, lora_b)


# --- K: dA = xhat^T dS (per segment) -----------------------------------------------------------

def _grad_a_kernel(*refs, bm: int, ratio: int, bk: int, splits: int):
    table = refs[:_NT]
    seg_slot_ref, seg_lo_ref, seg_hi_ref, seed_ref, x_ref, ds_ref, da_ref = refs[_NT:]
    e, kb, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seed = seed_ref[0]
    r = ds_ref.shape[1]
    lo = seg_lo_ref[e]
    hi = jnp.where(seg_slot_ref[e] >= 0, seg_hi_ref[e], lo)
    share = _div(hi - lo + (splits - 1), splits)
    first = lo + split * share
    last = jnp.minimum(first + share, hi)
    layout_bm = bm * ratio

    def body(step, acc):
        t, sub = first + _div(step, ratio), _rem(step, ratio)
        tile = _Tile(table, t)
        nvalid = tile.nrows - sub * bm

        def add(acc):
            x_blk = _load_rows(x_ref, tile.row0 + sub * bm, tile.skip - sub * bm, nvalid,
                               kb * bk, (bm, bk))
            x_blk = _masked(x_blk, seed, tile.row0 + sub * bm, kb * bk, tile.thr)
            ds_blk = ds_ref[pl.ds(t * layout_bm + sub * bm, bm), :]
            return acc + tile.inv * _tn(x_blk, ds_blk)

        return lax.cond(tile.active & (nvalid > 0), add, lambda acc: acc, acc)

    num_steps = jnp.maximum(last - first, 0) * ratio
    acc = lax.fori_loop(0, num_steps, body, jnp.zeros((bk, r), _F32))
    da_ref[split, e, pl.ds(kb * bk, bk), :] = acc


def grad_a_gpu(x, ds, layout: TileLayout, seed, cfg: FusedLoRAConfig, interpret):
    """K: x [m, k], dS [T * block_m, R] -> dA partials [splits, E, k, R] float32 (sum over
    splits; zero for inactive segments)."""
    k = x.shape[1]
    r = ds.shape[1]
    kcfg = cfg.kernel("grad_a")
    bm = _sub_rows(layout.block_m, kcfg)
    bk = _fit(kcfg.block_k, k)
    num_segments = layout.seg_slot.shape[0]
    splits = max(1, cfg.splits)
    kernel = functools.partial(_grad_a_kernel, bm=bm, ratio=layout.block_m // bm, bk=bk,
                               splits=splits)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, num_segments, k, r), _F32),
        grid=(num_segments, k // bk, splits),
        compiler_params=_params(kcfg),
        interpret=interpret,
    )(*_table(layout), layout.seg_slot, layout.seg_tile_lo, layout.seg_tile_hi, seed, x, ds)


# --- L: dX = dY W^T + mask * (dS A^T) / (1 - p) --------------------------------------------------

def _grad_x_kernel(*refs, bm: int, ratio: int, bk: int, bn: int, nn: int, num_m: int,
                   num_k: int, group: int):
    table, (seed_ref, dy_ref, w_ref, ds_ref, a_ref, dx_ref) = refs[:_NT], refs[_NT:]
    pm, i = _grouped(pl.program_id(0), num_m, num_k, group)
    t, sub = _div(pm, ratio), _rem(pm, ratio)
    tile = _Tile(table, t)
    seed = seed_ref[0]
    row_start = tile.row0 + sub * bm
    nskip, nvalid = tile.skip - sub * bm, tile.nrows - sub * bm

    @pl.when(tile.live & (nvalid > 0))
    def _compute():
        def body(j, acc):
            dy_blk = _load_rows(dy_ref, row_start, nskip, nvalid, j * bn, (bm, bn))
            w_blk = w_ref[pl.ds(i * bk, bk), pl.ds(j * bn, bn)]
            return acc + _nt(dy_blk, w_blk)

        acc = lax.fori_loop(0, nn, body, jnp.zeros((bm, bk), _F32))

        def add_lora(acc):
            ds_blk = ds_ref[pl.ds(pm * bm, bm), :]
            lora = _nt(ds_blk, a_ref[tile.slot, pl.ds(i * bk, bk), :]) * tile.inv
            return acc + _masked(lora, seed, row_start, i * bk, tile.thr)

        acc = lax.cond(tile.active, add_lora, lambda acc: acc, acc)
        _store_rows(dx_ref, row_start, nskip, nvalid, i * bk, acc.astype(dx_ref.dtype))


def grad_x_gpu(dy, w, ds, lora_a, layout: TileLayout, seed, cfg: FusedLoRAConfig, interpret):
    """L: dY [m, n], w [k, n], dS [T * block_m, R], lora_a [P, k, R] -> dX [m, k] (dY.dtype)."""
    m, n = dy.shape
    k = w.shape[0]
    kcfg = cfg.kernel("grad_x")
    bm = _sub_rows(layout.block_m, kcfg)
    bk, bn = _fit(kcfg.block_k, k), _fit(kcfg.block_n, n)
    ratio = layout.block_m // bm
    num_m, num_k = layout.num_tiles * ratio, k // bk
    kernel = functools.partial(_grad_x_kernel, bm=bm, ratio=ratio, bk=bk, bn=bn, nn=n // bn,
                               num_m=num_m, num_k=num_k, group=cfg.group_m)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, k), dy.dtype),
        grid=(num_m * num_k,),
        compiler_params=_params(kcfg),
        interpret=interpret,
    )(*_table(layout), seed, dy, w, ds, lora_a)
