"""Mosaic GPU (Hopper: wgmma + TMA, warp-specialised) versions of the fused LoRA GEMMs E and L.

Same contract as `fused_lora_gpu.base_expand_gpu` / `grad_x_gpu` (x / dY read and y / dX written
in the caller's row order, S / dS in the tile layout), structured like JAX's Hopper matmul
example (`hopper_matmul_mgpu`): a persistent grid (one CTA per SM, `plgpu.nd_loop` over the
output tiles in planar-snake order); per output tile a warp-specialised pipeline
(`plgpu.emit_pipeline_warp_specialized`): one memory warpgroup issues the TMA loads of the
contraction blocks `num_stages` deep, `wgs` compute warpgroups each run wgmma into their own
float32 accumulator [block_m, block_n / wgs] (the CTA's output columns split between them).

The LoRA term, per compute warpgroup, from operands loaded by TMA while the main loop runs:
  E: y = x @ W + s * S @ B[slot]: one extra wgmma step of contraction R (the rank block) into
     the same accumulator, S's tile scaled by s in SMEM first (s * S rounded to bf16).
  L: dX = dY @ W^T + mask * (dS @ A[slot]^T) / (1 - p): the mask is per output element, so the
     product goes to a second accumulator in chunks of EPI_COLS columns, is masked (the
     (seed, row, column) hash) and scaled in registers and added to the base in the epilogue.
Costs beyond the GEMM: R / K of its MMA work, and for L the hash over the output tile.

Row routing (block-aligned layout, `fused_lora_layout.build_block_layout`): row tile t is the
aligned row block starting at tile_row0[t] (a multiple of block_m: TMA loads into the swizzled
wgmma operand tiles need row offsets on the tile grid, which Mosaic GPU's layout inference
checks), of which rows tile_skip[t] .. tile_nrows[t] - 1 are the tile's own (one adapter slot).
S / dS row t * block_m + i is block row i. The kernel computes the whole block and stores only
the tile's rows with a ladder of TMA stores of 2^i rows (as `ragged_dot_mgpu` does), so the
tiles of other adapters sharing the block are never overwritten. m must be a multiple of
block_m (the dispatcher pads). Dead tiles (tile_nrows == 0) do no work.

Config (`FusedLoRAConfig.mosaic_kernels()`): block_m rows, block_k the contraction block (k for
E, n for L), block_n the CTA's output columns (n for E, k for L), num_warps / 4 compute
warpgroups, num_stages TMA stages, group_m column blocks per planar-snake band.

bf16 / f16 only: wgmma on float32 operands is tf32 (not f32-accurate), so float32 layers stay
on the Triton kernels (`fused_lora.gemm_backend`). D, I and K (shrink, dS/dB, dA: bandwidth
bound, rank-16 outputs) stay on the Triton kernels too.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.fused_lora_layout import (DROPOUT_BITS, FusedLoRAConfig, TileLayout,
                                              dropout_keep)
from pallas_kernels.tiles import device_smem_limit

try:  # the Mosaic GPU Pallas API (jax >= 0.9 with a CUDA-capable jaxlib build)
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - depends on the installed jax
    plgpu = None

_F32 = jnp.float32
_I32 = jnp.int32
_DROP_ALL = 1 << DROPOUT_BITS  # a dropout threshold no hash reaches: every element dropped
EPI_COLS = 64  # epilogue chunk: columns per output store (2 SMEM slots, the store of one
#               overlapping the next) and per L LoRA accumulator (fits beside the base one)
_MEMORY_REGISTERS = 40  # registers of the TMA warpgroup (as in hopper_matmul_mgpu)
# Shared memory one CTA may take on Hopper (227 KiB: Mosaic GPU's max_smem_bytes on an H100 /
# H200, and what it assumes when lowering off a GPU); the device's own: `smem_limit()`.
MAX_SMEM_BYTES = 232448
_REQUIRED = ("kernel", "emit_pipeline_warp_specialized", "wgmma", "wgmma_wait", "ACC", "SMEM",
             "BlockSpec", "Barrier", "nd_loop", "planar_snake", "copy_gmem_to_smem",
             "copy_smem_to_gmem", "barrier_wait", "wait_smem_to_gmem", "commit_smem",
             "commit_smem_to_gmem_group", "layout_cast", "Layout", "CompilerParams",
             "LoweringSemantics")


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
    a GPU, e.g. jax.export); one program in interpret mode (it loops over every tile; the
    interpreter runs each warpgroup of each program as a thread, and jax 0.11.2's deadlocked on
    a 2-core machine with 2 programs)."""
    if interpret:
        return 1
    return min(num_tiles, getattr(jax.devices()[0], "core_count", None) or 132)


class _RowTile:
    """Where row tile t's rows are: the aligned block start `start` (block_ref holds
    tile_row0 // block_m, so the offset is provably on the block grid), the tile's rows at
    offset `off` within the block, `nrows` of them (caller rows start + off ..)."""

    def __init__(self, block_ref, skip_ref, end_ref, t, bm: int):
        self.start = block_ref[t] * bm
        self.off = skip_ref[t]
        self.nrows = end_ref[t] - self.off


def _store_rows(o_smem, out_gmem, rows: _RowTile, col0):
    """TMA-store rows [off, off + nrows) of o_smem [bm, bw] to out rows start + off .. (columns
    col0 ..) with a ladder of stores of 2^i rows (static box sizes, run-time row count; as in
    JAX's ragged_dot_mgpu), committed as one bulk group (not awaited here)."""
    bm, bw = o_smem.shape
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
                out_gmem.at[pl.ds(rows.start + smem_start, chunk), pl.ds(col0, bw)],
                commit_group=False)

        smem_start = smem_start + (rows.nrows & chunk)
    plgpu.commit_smem_to_gmem_group()


def _emit(ctx, chunk_value):
    """Store the warpgroup's output tile in EPI_COLS-column chunks: chunk_value(c0, width) ->
    float32 [bm, width] goes to one of the 2 output SMEM slots (waiting only for the store that
    used that slot two chunks before) and out by `_store_rows`."""
    slots, bm, width = ctx.o_smem.shape
    bw = ctx.acc_ref.shape[1]
    for i, c0 in enumerate(range(0, bw, width)):
        value = chunk_value(c0, width)
        plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
        o_slot = ctx.o_smem.at[i % slots]
        o_slot[...] = value.astype(o_slot.dtype)
        _store_rows(o_slot, ctx.out_ref, ctx.rows, ctx.col0 + c0)


def _wgmma_iota(shape, dim: int):
    return plgpu.layout_cast(lax.broadcasted_iota(_I32, shape, dim), plgpu.Layout.WGMMA)


def _blocks(cfg: FusedLoRAConfig, bm: int):
    """(bm, bc, cta_w, wgs, bw): rows, contraction block, CTA columns, compute warpgroups,
    columns per warpgroup."""
    wgs = max(1, cfg.num_warps // 4)
    if cfg.block_n % (wgs * 8):
        raise ValueError(f"block_n {cfg.block_n} must split into {wgs} x multiples of 8")
    return bm, cfg.block_k, cfg.block_n, wgs, cfg.block_n // wgs


def _gemm_kernel(tables, lhs_ref, rhs_ref, lora_lhs_ref, lora_rhs_ref, out_ref, *, kind: str,
                 bm: int, bc: int, cta_w: int, wgs: int, stages: int, group: int, epilogue):
    """The shared body of E (kind "E": rhs = W [K, N]) and L (kind "L": rhs = W [N, K], used
    transposed). tables = (block, skip, end, slot) refs; `epilogue(ctx)` adds the LoRA term
    and stores the warpgroup's output (see `_e_epilogue`, `_l_epilogue`)."""
    block_ref, skip_ref, end_ref, slot_ref = tables
    bw = cta_w // wgs
    epi = min(bw, EPI_COLS)
    transposed = kind == "L"
    n_steps = lhs_ref.shape[1] // bc
    num_m = block_ref.shape[0]
    num_w = (rhs_ref.shape[0] if transposed else rhs_ref.shape[1]) // cta_w
    r = lora_lhs_ref.shape[1]
    rhs_block = (cta_w, bc) if transposed else (bc, cta_w)
    rhs_index = (lambda c: (0, c)) if transposed else (lambda c: (c, 0))
    lora_rhs_block = (bw, r) if transposed else (r, bw)

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(n_steps,), memory_registers=_MEMORY_REGISTERS,
            in_specs=[plgpu.BlockSpec((bm, bc), lambda c: (0, c)),
                      plgpu.BlockSpec(rhs_block, rhs_index)],
            wg_axis="wg", num_compute_wgs=wgs, max_concurrent_steps=stages,
            compute_context=context)

    def ignore(*_, **__):
        return None

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(lhs_ref, rhs_ref),
        o_smem=plgpu.SMEM((wgs, min(2, bw // epi), bm, epi), out_ref.dtype),
        lhs_smem=plgpu.SMEM((wgs, bm, r), lora_lhs_ref.dtype),
        rhs_smem=plgpu.SMEM((wgs, *lora_rhs_block), lora_rhs_ref.dtype),
        barriers=plgpu.Barrier(num_barriers=2 * wgs),
        collective_axes="wg")
    def _scope(allocs, o_smem, lhs_smem, rhs_smem, barriers):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((num_m * num_w,), collective_axes="sm")
        def _tiles(info):
            t, j = plgpu.planar_snake(info.index[0], (num_m, num_w), 1, group)
            rows = _RowTile(block_ref, skip_ref, end_ref, t, bm)
            slot = jnp.maximum(slot_ref[t], 0)
            col0 = j * cta_w + wg * bw

            def context(eval_pipeline):
                # LoRA operands of this warpgroup, loaded while the main loop runs
                lora_rhs = (lora_rhs_ref.at[slot, pl.ds(col0, bw)] if transposed
                            else lora_rhs_ref.at[slot, :, pl.ds(col0, bw)])
                plgpu.copy_gmem_to_smem(lora_lhs_ref.at[pl.ds(t * bm, bm)], lhs_smem.at[wg],
                                        barriers.at[2 * wg])
                plgpu.copy_gmem_to_smem(lora_rhs, rhs_smem.at[wg], barriers.at[2 * wg + 1])

                def acc_scope(acc_ref):
                    eval_pipeline(acc_ref)
                    plgpu.barrier_wait(barriers.at[2 * wg])
                    plgpu.barrier_wait(barriers.at[2 * wg + 1])
                    epilogue(_Ctx(t, rows, col0, acc_ref, lhs_smem.at[wg], rhs_smem.at[wg],
                                  o_smem.at[wg], out_ref))

                pl.run_scoped(acc_scope, plgpu.ACC((bm, bw), _F32))

            def mma(_, lhs, rhs, acc_ref):
                wg_cols = pl.ds(wg * bw, bw)
                rhs = rhs.at[wg_cols].transpose((1, 0)) if transposed else rhs.at[:, wg_cols]
                plgpu.wgmma(acc_ref, lhs, rhs)
                plgpu.wgmma_wait(0)
                return acc_ref

            @pl.when(rows.nrows > 0)
            def _live():
                rhs_view = (rhs_ref.at[pl.ds(j * cta_w, cta_w)] if transposed
                            else rhs_ref.at[:, pl.ds(j * cta_w, cta_w)])
                pipeline(mma, context)(lhs_ref.at[pl.ds(rows.start, bm)], rhs_view,
                                       allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


class _Ctx:
    """What an epilogue sees: tile t, its rows, the warpgroup's first output column, its
    accumulator, its LoRA operands in SMEM, its output SMEM and the output."""

    def __init__(self, t, rows, col0, acc_ref, lhs_smem, rhs_smem, o_smem, out_ref):
        self.t, self.rows, self.col0, self.acc_ref = t, rows, col0, acc_ref
        self.lhs_smem, self.rhs_smem, self.o_smem, self.out_ref = lhs_smem, rhs_smem, o_smem, out_ref


def _e_epilogue(ctx: _Ctx, scale_ref):
    """E: acc += (s * S) @ B (the extra K-step; s = 0 for base-only tiles), then store."""
    scale = scale_ref[ctx.t]
    ctx.lhs_smem[...] = (ctx.lhs_smem[...].astype(_F32) * scale).astype(ctx.lhs_smem.dtype)
    plgpu.commit_smem()
    plgpu.wgmma(ctx.acc_ref, ctx.lhs_smem, ctx.rhs_smem)
    plgpu.wgmma_wait(0)
    acc = ctx.acc_ref[...]
    _emit(ctx, lambda c0, width: acc[:, c0:c0 + width])


def _l_epilogue(ctx: _Ctx, thr_ref, inv_ref, seed_ref, slot_ref):
    """L: out = acc + mask * (dS @ A^T) / (1 - p), the LoRA product in chunks of EPI_COLS
    columns (its own accumulator), masked and scaled in registers."""
    bm = ctx.acc_ref.shape[0]
    active = slot_ref[ctx.t] >= 0
    thr = jnp.where(active, thr_ref[ctx.t], _DROP_ALL)  # inactive: no LoRA term
    inv, seed = inv_ref[ctx.t], seed_ref[0]
    base = ctx.acc_ref[...]

    def chunk_value(c0, width):
        def lora_scope(lora_ref):
            rhs = ctx.rhs_smem.at[pl.ds(c0, width)].transpose((1, 0))
            plgpu.wgmma(lora_ref, ctx.lhs_smem, rhs)
            plgpu.wgmma_wait(0)
            return lora_ref[...]

        lora = pl.run_scoped(lora_scope, plgpu.ACC((bm, width), _F32))
        rows = ctx.rows.start + _wgmma_iota((bm, width), 0)
        cols = ctx.col0 + c0 + _wgmma_iota((bm, width), 1)
        keep = dropout_keep(seed, rows, cols, thr)
        return base[:, c0:c0 + width] + lora * (keep.astype(_F32) * inv)

    _emit(ctx, chunk_value)


def _launch(body, out_shape, num_tiles: int, wgs: int, interpret, *args):
    return plgpu.kernel(
        body, out_type=out_shape, grid=(_num_programs(num_tiles, interpret),),
        grid_names=("sm",), num_threads=wgs + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret or None,
    )(*args)


SMEM_ALIGNMENT = 1024  # Mosaic GPU rounds every SMEM allocation up to this (pallas gpu_core)
MBARRIER_BYTES = 8  # one mbarrier


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SMEM_ALIGNMENT) * SMEM_ALIGNMENT


def smem_parts(cfg: FusedLoRAConfig, rank: int, itemsize: int = 2,
               contraction: int | None = None) -> dict:
    """Shared memory of an E / L kernel with blocks `cfg`, by buffer, in bytes, as Mosaic GPU
    counts it for what `_gemm_kernel` allocates (one collective `run_scoped`):

      "pipeline"  the TMA stages of the lhs block [block_m, block_k] and of the W block
                  [block_k, block_n], stages = min(num_stages, contraction // block_k) (the
                  warp-specialised pipeline never allocates more slots than its grid has steps;
                  contraction None: num_stages);
      "output"    wgs x min(2, bw // EPI_COLS) store slots of [block_m, min(bw, EPI_COLS)];
      "lora"      wgs copies of the S / dS tile [block_m, rank] and of the B / A^T block
                  [rank, bw];
      "barriers"  the pipeline's produced and consumed barriers (stages each) and 2 per compute
                  warpgroup for the LoRA operand loads, MBARRIER_BYTES each;

    each buffer rounded up to SMEM_ALIGNMENT bytes (wgs = num_warps // 4 compute warpgroups,
    bw = block_n / wgs output columns each; `rank`: the padded rank, `itemsize`: bytes of the
    bf16 / f16 operands)."""
    bm, bc, cta_w, wgs, bw = _blocks(cfg, cfg.block_m)
    epi = min(bw, EPI_COLS)
    stages = cfg.num_stages if contraction is None else max(1, min(cfg.num_stages,
                                                                   contraction // bc))
    return {
        "pipeline": (_aligned(stages * bm * bc * itemsize)
                     + _aligned(stages * bc * cta_w * itemsize)),
        "output": _aligned(wgs * min(2, bw // epi) * bm * epi * itemsize),
        "lora": _aligned(wgs * bm * rank * itemsize) + _aligned(wgs * rank * bw * itemsize),
        "barriers": MBARRIER_BYTES * (2 * stages + 2 * wgs),
    }


def smem_bytes(cfg: FusedLoRAConfig, rank: int, itemsize: int = 2,
               contraction: int | None = None) -> int:
    """Shared memory of an E / L kernel with blocks `cfg` at the padded `rank` (`smem_parts`
    summed): what Mosaic GPU compares with the device's limit before it launches the kernel.
    MOSAIC_DEFAULT at rank 32 (bf16): 245,840 bytes, the figure the four GPU tests of issue 37
    failed with on an H200 (limit 232,448)."""
    return sum(smem_parts(cfg, rank, itemsize, contraction).values())


def smem_limit(device=None) -> int:
    """Shared memory (bytes) one CTA may take on `device` (default: jax's first local device):
    its reported opt-in maximum, else the table by compute capability
    (`tiles.device_smem_limit`); off a GPU, MAX_SMEM_BYTES (Mosaic GPU's assumption for an
    ahead-of-time lowering)."""
    return device_smem_limit(device)


def _fallbacks(cfg: FusedLoRAConfig):
    """`cfg`, then the configs to fall back to, best first: fewer TMA stages (down to 2), then
    narrower CTA column blocks (down to 64 columns per compute warpgroup), then, from 8+ warps,
    one compute warpgroup over at most 128 columns (a 128 x 128 f32 accumulator is the most one
    warpgroup's registers hold)."""
    wgs = max(1, cfg.num_warps // 4)
    shapes, block_n = [], cfg.block_n
    while block_n >= wgs * 64 or block_n == cfg.block_n:
        shapes.append((cfg.num_warps, block_n))
        block_n //= 2
    if wgs > 1:
        block_n = min(cfg.block_n, 128)
        while block_n >= 64:
            shapes.append((4, block_n))
            block_n //= 2
    for warps, block_n in shapes:
        for stages in range(cfg.num_stages, min(cfg.num_stages, 2) - 1, -1):
            yield dataclasses.replace(cfg, num_warps=warps, block_n=block_n, num_stages=stages)


def fit_smem(cfg: FusedLoRAConfig, rank: int, itemsize: int = 2, contraction: int | None = None,
             limit: int | None = None) -> FusedLoRAConfig | None:
    """`cfg` if its E / L kernels fit `limit` bytes of shared memory (default: `smem_limit()`),
    else the first of its fallbacks (`_fallbacks`: fewer stages, then narrower column blocks, then
    one compute warpgroup) that fits; None when none does. block_m and block_k are kept (block_m
    is the row layout's tile)."""
    limit = smem_limit() if limit is None else limit
    for candidate in _fallbacks(cfg):
        if smem_bytes(candidate, rank, itemsize, contraction) <= limit:
            return candidate
    return None


def _describe(cfg: FusedLoRAConfig) -> str:
    return (f"block_m={cfg.block_m} block_k={cfg.block_k} block_n={cfg.block_n} "
            f"num_warps={cfg.num_warps} num_stages={cfg.num_stages}")


def check_smem(cfg: FusedLoRAConfig, rank: int, itemsize: int = 2, contraction: int | None = None,
               limit: int | None = None) -> None:
    """ValueError, before any lowering, for blocks whose E / L kernels need more shared memory
    than `limit` (default: this device's, `smem_limit()`): names the bytes by buffer, the limit
    and the best fallback that fits (`fit_smem`), if any."""
    limit = smem_limit() if limit is None else limit
    parts = smem_parts(cfg, rank, itemsize, contraction)
    need = sum(parts.values())
    if need <= limit:
        return
    fitted = fit_smem(cfg, rank, itemsize, contraction, limit)
    hint = (f"blocks that fit: {_describe(fitted)} "
            f"({smem_bytes(fitted, rank, itemsize, contraction)} bytes)" if fitted is not None
            else "no fewer stages, narrower block_n or fewer warps fit: a smaller block_m or rank")
    breakdown = ", ".join(f"{name} {nbytes}" for name, nbytes in parts.items())
    raise ValueError(
        f"Mosaic GPU fused-LoRA E/L blocks {_describe(cfg)} need {need} bytes of shared memory "
        f"at rank {rank} ({itemsize}-byte operands; {breakdown}) > {limit} bytes per block on "
        f"this device; {hint}")


def _rows_table(layout: TileLayout):
    """(block index, skip, end, slot) per tile: where its rows are (see `_RowTile`) and its
    adapter slot (-1 for tiles without LoRA work)."""
    slot = jnp.where(layout.tile_active, layout.tile_slot, -1)
    return layout.tile_row0 // layout.block_m, layout.tile_skip, layout.tile_nrows, slot


def _check(m: int, contraction: int, width: int, bm: int, bc: int, cta_w: int):
    if m % bm:
        raise ValueError(f"{m} rows: pad the rows to whole blocks of {bm}")
    if bm % 64:
        raise ValueError(f"block_m {bm} must be a multiple of 64 (one wgmma row group)")
    if contraction % bc or width % cta_w:
        raise ValueError(f"contraction {contraction} / width {width} must be padded to blocks "
                         f"{bc} / {cta_w}")


# --- E: y = x @ W + s * S @ B ------------------------------------------------------------------

def base_expand_mgpu(x, w, s, lora_b, layout: TileLayout, cfg: FusedLoRAConfig, interpret):
    """E: x [m, k] (m a multiple of block_m), w [k, n], S [T * block_m, R], lora_b [P, R, n]
    -> y [m, n] (x.dtype). block_m: the layout's; k, n padded to block_k / block_n."""
    m, k = x.shape
    n = w.shape[1]
    bm, bc, cta_w, wgs, _ = _blocks(cfg, layout.block_m)
    _check(m, k, n, bm, bc, cta_w)
    check_smem(dataclasses.replace(cfg, block_m=bm), s.shape[1], jnp.dtype(x.dtype).itemsize,
               contraction=k)

    def body(block_ref, skip_ref, end_ref, slot_ref, scale_ref, x_ref, w_ref, s_ref, b_ref,
             y_ref):
        _gemm_kernel((block_ref, skip_ref, end_ref, slot_ref), x_ref, w_ref, s_ref, b_ref,
                     y_ref, kind="E", bm=bm, bc=bc, cta_w=cta_w, wgs=wgs,
                     stages=cfg.num_stages, group=cfg.group_m,
                     epilogue=functools.partial(_e_epilogue, scale_ref=scale_ref))

    scale = jnp.where(layout.tile_active, layout.tile_scale, 0.0)
    return _launch(body, jax.ShapeDtypeStruct((m, n), x.dtype),
                   layout.num_tiles * (n // cta_w), wgs, interpret,
                   *_rows_table(layout), scale, x, w, s, lora_b)


# --- L: dX = dY W^T + mask * (dS A^T) / (1 - p) --------------------------------------------------

def grad_x_mgpu(dy, w, ds, lora_a, layout: TileLayout, seed, cfg: FusedLoRAConfig, interpret):
    """L: dY [m, n] (m a multiple of block_m), w [k, n], dS [T * block_m, R] (zero rows for
    inactive tiles), lora_a [P, k, R], seed int32 [1] -> dX [m, k] (dY.dtype)."""
    m, n = dy.shape
    k = w.shape[0]
    bm, bc, cta_w, wgs, _ = _blocks(cfg, layout.block_m)
    _check(m, n, k, bm, bc, cta_w)
    check_smem(dataclasses.replace(cfg, block_m=bm), ds.shape[1], jnp.dtype(dy.dtype).itemsize,
               contraction=n)

    def body(block_ref, skip_ref, end_ref, slot_ref, thr_ref, inv_ref, seed_ref, dy_ref, w_ref,
             ds_ref, a_ref, dx_ref):
        epilogue = functools.partial(_l_epilogue, thr_ref=thr_ref, inv_ref=inv_ref,
                                     seed_ref=seed_ref, slot_ref=slot_ref)
        _gemm_kernel((block_ref, skip_ref, end_ref, slot_ref), dy_ref, w_ref, ds_ref, a_ref,
                     dx_ref, kind="L", bm=bm, bc=bc, cta_w=cta_w, wgs=wgs,
                     stages=cfg.num_stages, group=cfg.group_m, epilogue=epilogue)

    return _launch(body, jax.ShapeDtypeStruct((m, k), dy.dtype),
                   layout.num_tiles * (k // cta_w), wgs, interpret,
                   *_rows_table(layout), layout.tile_threshold, layout.tile_inv_keep, seed,
                   dy, w, ds, lora_a)
