"""Mosaic GPU (Hopper: wgmma + TMA) versions of the fused LoRA GEMM kernels E and L.

Same contract as `fused_lora_gpu.base_expand_gpu` / `grad_x_gpu` (tile layout of
`fused_lora_layout`, x / dY read and y / dX written in the caller's row order, S / dS in the padded
tile layout), as `plgpu.kernel`s structured like JAX's `ragged_dot_mgpu` example: a persistent
grid (one program per SM, `plgpu.nd_loop` over the output tiles in planar-snake order), each
output tile a TMA + wgmma pipeline (`plgpu.emit_pipeline`, `max_concurrent_steps` stages) over
the contraction axis into one float32 accumulator, stored through SMEM by TMA.

The LoRA term is the accumulator's initial value: one extra wgmma step of contraction R (the
rank block, >= 16) into a first accumulator (S @ B[slot] for E, dS @ A[slot]^T for L), scaled
(and, for L, dropout-masked with the (seed, row, column) hash) in registers, then
it is stored into the base GEMM's accumulator before its pipeline. So the base pipeline is a plain GEMM
and the LoRA work costs one R-deep step per output tile (R / k of the tile's MMA work) plus
one elementwise pass over the tile's registers.

Row routing (block-aligned layout, `fused_lora_layout.build_block_layout`): row tile t is the
aligned row block starting at tile_row0[t] (a multiple of block_m: TMA loads into the swizzled
wgmma operand tiles need row offsets on the tile grid, which Mosaic GPU's layout inference
checks), of which rows tile_skip[t] .. tile_nrows[t] - 1 are the tile's own (one adapter slot).
S / dS row t * block_m + i is block row i. The kernel computes the whole block and stores only
the tile's rows with a ladder of TMA stores of 2^i rows (as `ragged_dot_mgpu` does), so the
tiles of other adapters sharing the block are never overwritten. m must be a multiple of
block_m (the dispatcher pads). Dead tiles (tile_nrows == 0) do no work.

bf16 / f16 only: wgmma on float32 operands is tf32 (not f32-accurate), so float32 layers stay
on the Triton kernels (`fused_lora.gemm_backend`). D, I and K (shrink, dS/dB, dA: bandwidth
bound, rank-16 outputs) stay on the Triton kernels too.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.fused_lora_layout import (DROPOUT_BITS, FusedLoRAConfig, TileLayout,
                                              dropout_keep)

try:  # the Mosaic GPU Pallas API (jax >= 0.9 with a CUDA-capable jaxlib build)
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - depends on the installed jax
    plgpu = None

_F32 = jnp.float32
_I32 = jnp.int32
_DROP_ALL = 1 << DROPOUT_BITS  # a dropout threshold no hash reaches: every element dropped
_REQUIRED = ("kernel", "emit_pipeline", "wgmma", "wgmma_wait", "ACC", "SMEM", "BlockSpec",
             "nd_loop", "planar_snake", "copy_smem_to_gmem", "wait_smem_to_gmem",
             "commit_smem", "layout_cast", "Layout", "CompilerParams", "LoweringSemantics")


def available() -> bool:
    """Whether the installed jax has the Mosaic GPU Pallas API these kernels use."""
    return plgpu is not None and all(hasattr(plgpu, name) for name in _REQUIRED)


def interpret_params():
    """GPU interpret-mode parameters (run the kernels on CPU): `plgpu.InterpretGPUParams`
    (exported since jax 0.12; jax 0.11 has it only under jax._src)."""
    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params()


def _num_programs(num_tiles: int, interpret) -> int:
    """Persistent grid size: the SM count on a GPU (132 on an H100 / H200 SXM when lowering off
    a GPU, e.g. jax.export), a small grid in interpret mode."""
    if interpret:
        return min(num_tiles, 2)
    return min(num_tiles, getattr(jax.devices()[0], "core_count", None) or 132)


def _compiler_params():
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


class _RowTile:
    """Where row tile t's rows are: the aligned block start `start` (block_ref holds
    tile_row0 // block_m, so the offset is provably on the block grid), the tile's rows at
    offset `off` within the block, `nrows` of them (caller rows start + off ..)."""

    def __init__(self, block_ref, skip_ref, end_ref, t, bm: int):
        self.start = block_ref[t] * bm
        self.off = skip_ref[t]
        self.nrows = end_ref[t] - self.off


def _lora_product(lhs_view, rhs_view, shape, rhs_transposed: bool):
    """[bm, width] float32 = lhs_view [bm, R] @ rhs_view ([R, width], or [width, R] when
    rhs_transposed): one R-deep wgmma step into its own accumulator."""
    r = lhs_view.shape[1]
    rhs_block = (shape[1], r) if rhs_transposed else (r, shape[1])

    def scope(acc_ref):
        def step(_, lhs_smem, rhs_smem):
            rhs = rhs_smem.transpose((1, 0)) if rhs_transposed else rhs_smem
            plgpu.wgmma(acc_ref, lhs_smem, rhs)
            plgpu.wgmma_wait(0)

        plgpu.emit_pipeline(
            step, grid=(1,),
            in_specs=[plgpu.BlockSpec((shape[0], r), lambda i: (0, 0)),
                      plgpu.BlockSpec(rhs_block, lambda i: (0, 0))],
            max_concurrent_steps=1,
        )(lhs_view, rhs_view)
        return acc_ref[...]

    return pl.run_scoped(scope, plgpu.ACC(shape, _F32))


def _base_gemm(lhs_view, rhs_view, nsteps: int, blocks, rhs_transposed: bool, stages: int):
    """[bm, bw] float32 = lhs_view [bm, K] @ (rhs_view [K, bw] or its [bw, K]^T) over `nsteps`
    contraction blocks: the TMA + wgmma pipeline. blocks = (bm, bc, bw)."""
    bm, bc, bw = blocks
    rhs_spec = (plgpu.BlockSpec((bw, bc), lambda c: (0, c), delay_release=1) if rhs_transposed
                else plgpu.BlockSpec((bc, bw), lambda c: (c, 0), delay_release=1))

    def compute(acc_ref):
        def step(_, lhs_smem, rhs_smem):
            rhs = rhs_smem.transpose((1, 0)) if rhs_transposed else rhs_smem
            plgpu.wgmma(acc_ref, lhs_smem, rhs)

        plgpu.emit_pipeline(
            step, grid=(nsteps,),
            in_specs=[plgpu.BlockSpec((bm, bc), lambda c: (0, c), delay_release=1), rhs_spec],
            max_concurrent_steps=stages,
        )(lhs_view, rhs_view)
        return acc_ref[...]

    return pl.run_scoped(compute, plgpu.ACC((bm, bw), _F32))


def _epilogue(base, lora_chunk, out_gmem, rows: _RowTile, col0, bm: int):
    """out[tile rows, col0 : col0 + bw] = base [bm, bw] + the LoRA term, rounded once.

    lora_chunk(c0, width) -> [bm, width] float32: the LoRA term of columns c0 .. (computed in
    chunks of <= EPI_COLS columns so its accumulator and `base` fit in registers together).
    The sum goes to SMEM, then rows [off, off + nrows) go out with a ladder of TMA stores of 2^i
    rows (static box sizes, run-time row count; as in JAX's ragged_dot_mgpu)."""
    bw = base.shape[1]

    def scope(o_smem):
        for c0 in range(0, bw, min(bw, EPI_COLS)):
            width = min(bw, EPI_COLS)
            o_smem[:, pl.ds(c0, width)] = (base[:, c0:c0 + width]
                                           + lora_chunk(c0, width)).astype(o_smem.dtype)
        plgpu.commit_smem()
        smem_start = rows.off
        size = bm
        while size > 0:
            chunk = 1 << int(math.log2(size))
            size //= 2

            @pl.when(rows.nrows & chunk != 0)
            def _store(chunk=chunk, smem_start=smem_start):
                plgpu.copy_smem_to_gmem(
                    o_smem.at[pl.ds(smem_start, chunk)],
                    out_gmem.at[pl.ds(rows.start + smem_start, chunk), pl.ds(col0, bw)])

            smem_start = smem_start + (rows.nrows & chunk)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(scope, plgpu.SMEM((bm, bw), out_gmem.dtype))


EPI_COLS = 64


def _wgmma_iota(shape, dim: int):
    return plgpu.layout_cast(lax.broadcasted_iota(_I32, shape, dim), plgpu.Layout.WGMMA)


def _tile_loop(num_m: int, num_n: int, group: int, body):
    """Run body(mi, ni) over the (row tile, column block) grid: persistent programs over the
    tiles in planar-snake order (`group` column blocks per band, L2 reuse)."""
    @plgpu.nd_loop((num_m * num_n,), collective_axes="sm")
    def _loop(info):
        mi, ni = plgpu.planar_snake(info.index[0], (num_m, num_n), 1, group)
        body(mi, ni)


# --- E: y = x @ W + s * S @ B ------------------------------------------------------------------

def _base_expand_body(block_ref, skip_ref, end_ref, slot_ref, scale_ref, x_ref, w_ref, s_ref,
                      b_ref, y_ref, *, bm: int, bk: int, bn: int, stages: int, group: int):
    k = x_ref.shape[1]
    num_m, num_n = block_ref.shape[0], w_ref.shape[1] // bn

    def tile(t, j):
        rows = _RowTile(block_ref, skip_ref, end_ref, t, bm)

        @pl.when(rows.nrows > 0)
        def _compute():
            slot = slot_ref[t]
            scale = jnp.where(slot >= 0, scale_ref[t], 0.0)  # S is finite (D zeroes it)
            s_view = s_ref.at[pl.ds(t * bm, bm)]
            b_slot = b_ref.at[jnp.maximum(slot, 0)]

            def lora_chunk(c0, width):
                b_view = b_slot.at[:, pl.ds(j * bn + c0, width)]
                lora = _lora_product(s_view, b_view, (bm, width), rhs_transposed=False)
                return lora * scale

            base = _base_gemm(x_ref.at[pl.ds(rows.start, bm)], w_ref.at[:, pl.ds(j * bn, bn)],
                              k // bk, (bm, bk, bn), rhs_transposed=False, stages=stages)
            _epilogue(base, lora_chunk, y_ref, rows, j * bn, bm)

    _tile_loop(num_m, num_n, group, tile)


def base_expand_mgpu(x, w, s, lora_b, layout: TileLayout, cfg: FusedLoRAConfig, interpret):
    """E: x [m, k] (m a multiple of block_m), w [k, n], S [T * block_m, R], lora_b [P, R, n]
    -> y [m, n] (x.dtype). The layout's block_m is the row tile; k, n padded to the blocks."""
    m, k = x.shape
    n = w.shape[1]
    bm, bk, bn = layout.block_m, cfg.block_k, cfg.block_n
    _check(m, k, n, bm, bk, bn)
    slot = jnp.where(layout.tile_active, layout.tile_slot, -1)
    body = functools.partial(_base_expand_body, bm=bm, bk=bk, bn=bn, stages=cfg.num_stages,
                             group=cfg.group_m)
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(_num_programs(layout.num_tiles * (n // bn), interpret),), grid_names=("sm",),
        compiler_params=_compiler_params(), interpret=interpret or None,
    )(*_rows_table(layout), slot, layout.tile_scale, x, w, s, lora_b)


# --- L: dX = dY W^T + mask * (dS A^T) / (1 - p) --------------------------------------------------

def _grad_x_body(block_ref, skip_ref, end_ref, slot_ref, thr_ref, inv_ref, seed_ref, dy_ref,
                 w_ref, ds_ref, a_ref, dx_ref, *, bm: int, bk: int, bn: int, stages: int,
                 group: int):
    n = dy_ref.shape[1]
    num_m, num_k = block_ref.shape[0], w_ref.shape[0] // bk

    def tile(t, i):
        rows = _RowTile(block_ref, skip_ref, end_ref, t, bm)

        @pl.when(rows.nrows > 0)
        def _compute():
            slot, inv, seed = slot_ref[t], inv_ref[t], seed_ref[0]
            thr = jnp.where(slot >= 0, thr_ref[t], _DROP_ALL)  # inactive: no LoRA term
            ds_view = ds_ref.at[pl.ds(t * bm, bm)]
            a_slot = a_ref.at[jnp.maximum(slot, 0)]

            def lora_chunk(c0, width):
                a_view = a_slot.at[pl.ds(i * bk + c0, width)]
                lora = _lora_product(ds_view, a_view, (bm, width), rhs_transposed=True)
                caller_rows = rows.start + _wgmma_iota((bm, width), 0)
                cols = i * bk + c0 + _wgmma_iota((bm, width), 1)
                keep = dropout_keep(seed, caller_rows, cols, thr)
                return lora * (keep.astype(_F32) * inv)  # dS is finite (zeroed when inactive)

            base = _base_gemm(dy_ref.at[pl.ds(rows.start, bm)], w_ref.at[pl.ds(i * bk, bk)],
                              n // bn, (bm, bn, bk), rhs_transposed=True, stages=stages)
            _epilogue(base, lora_chunk, dx_ref, rows, i * bk, bm)

    _tile_loop(num_m, num_k, group, tile)


def grad_x_mgpu(dy, w, ds, lora_a, layout: TileLayout, seed, cfg: FusedLoRAConfig, interpret):
    """L: dY [m, n] (m a multiple of block_m), w [k, n], dS [T * block_m, R], lora_a [P, k, R],
    seed int32 [1] -> dX [m, k] (dY.dtype)."""
    m, n = dy.shape
    k = w.shape[0]
    bm, bk, bn = layout.block_m, cfg.block_k, cfg.block_n
    _check(m, k, n, bm, bk, bn)
    slot = jnp.where(layout.tile_active, layout.tile_slot, -1)
    body = functools.partial(_grad_x_body, bm=bm, bk=bk, bn=bn, stages=cfg.num_stages,
                             group=cfg.group_m)
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((m, k), dy.dtype),
        grid=(_num_programs(layout.num_tiles * (k // bk), interpret),), grid_names=("sm",),
        compiler_params=_compiler_params(), interpret=interpret or None,
    )(*_rows_table(layout), slot, layout.tile_threshold, layout.tile_inv_keep, seed, dy, w, ds,
      lora_a)


def _rows_table(layout: TileLayout):
    """(block index, skip, end) per tile: where its rows are (see `_RowTile`)."""
    return layout.tile_row0 // layout.block_m, layout.tile_skip, layout.tile_nrows


def _check(m: int, k: int, n: int, bm: int, bk: int, bn: int):
    if m % bm:
        raise ValueError(f"{m} rows: pad the rows to whole blocks of {bm}")
    if bm % 64:
        raise ValueError(f"block_m {bm} must be a multiple of 64 (one wgmma row group)")
    if k % bk or n % bn:
        raise ValueError(f"k {k} / n {n} must be padded to blocks {bk} / {bn}")
