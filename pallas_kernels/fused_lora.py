"""FusedLoRA / FusedMultiLoRA linear layer for training (LoRAFusion §4.1): dispatch + custom_vjp.

    y = x @ W + s_i * dropout_i(x) @ A_i @ B_i      (per row, adapter i of the row's segment)

Five kernels instead of the ~10 ops of an unfused LoRA layer (LoRAFusion's split-graph fusion):
forward D (S = dropout(x) @ A; S is tiny and stored) and E (y = x @ W + s * S @ B, one
accumulator); backward I (dB and dS from one read of dY), K (dA = xhat^T dS) and L
(dX = dY W^T + mask * dS A^T / (1 - p), one accumulator). W is frozen: no dW is computed and
its cotangent is zero. Dropout masks come from a (seed, row, column) hash computed inside the
kernels and regenerated in the backward (no mask tensor). See `fused_lora_gpu` (Triton),
`fused_lora_mgpu` (Mosaic GPU E and L), `fused_lora_tpu` (Mosaic TPU) and `fused_lora_layout`
(hash, tile layout, block config).

GPU GEMM kernels (`gemm`): on the "gpu" style the two GEMMs E and L run either as Triton kernels
or as Mosaic GPU (wgmma + TMA) kernels; D, I and K are Triton kernels either way.
`gemm_backend` picks: "mosaic" on a Hopper GPU (compute capability 9.x) when the installed jax
has a working `pallas.mosaic_gpu` and the dtype is bf16 / f16 (wgmma on f32 is tf32), else
"triton". Pass gemm="mosaic" / "triton" to force one (off a GPU both run in interpret mode).

`impl`: None (auto: "gpu" on a GPU backend, "tpu" on TPU, "reference" elsewhere), "reference"
(pure jnp + JAX autodiff), "gpu" or "tpu"; a kernel style that does not match the backend runs
with `interpret=True` (the TPU style with the TPU interpreter), which is how CPU tests run both.

Multi-adapter batches: rows grouped by adapter (seg_starts int32 [S+1], seg_slot int32 [S],
-1 = base model only; rows outside all segments are base-only too), adapters in pools
lora_a [P, k, r_max], lora_b [P, r_max, n] with per-slot slot_rank int32 [P] (<= r_max; columns
beyond it are ignored), slot_scale float [P] and slot_dropout float [P] (in [0, 1)). Any number
of adapters per microbatch. The rows are laid out tile-aligned (`build_tile_layout`: each
segment padded to whole row tiles, via a gather of x / scatter of y); build the layout once per
microbatch and pass `layout=` to every layer to share it (its block_m then fixes the row tile).
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import fused_lora_gpu, fused_lora_mgpu, fused_lora_tpu
from pallas_kernels.dispatch import resolve_impl
from pallas_kernels.fused_lora_layout import (
    KERNELS,
    FusedLoRAConfig,
    TileLayout,
    build_block_layout,
    build_tile_layout,
    default_config,
    fit_block,
    gather_rows,
    identity_tile_layout,
    next_pow2,
    pad_axis,
    round_up,
)
from pallas_kernels.fused_lora_reference import (
    fused_lora_linear_reference,
    fused_lora_linear_single_reference,
)

_F32 = jnp.float32
_I32 = jnp.int32
GEMMS = ("triton", "mosaic")
_MOSAIC_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class _Plan:
    style: str
    interpret: Any
    cfg: FusedLoRAConfig
    block_k: int
    block_n: int
    gemm: str = "triton"
    gemm_interpret: Any = False
    mosaic: FusedLoRAConfig | None = None


def is_hopper(device) -> bool:
    """A CUDA device of compute capability 9.x (H100 / H200 / GH200)."""
    capability = str(getattr(device, "compute_capability", "") or "")
    return getattr(device, "platform", "") == "gpu" and capability.split(".")[0] == "9"


def gemm_backend(dtype, gemm: str | None = None, device=None,
                 mosaic_available: bool | None = None) -> str:
    """The GEMM kernels (E, L) of the "gpu" style: `gemm` when given, else "mosaic" on a Hopper
    `device` (default: jax.devices()[0]) with a working Mosaic GPU API (`mosaic_available`,
    default: probed) for bf16 / f16, else "triton" (f32, other GPUs, jax without it)."""
    if gemm is not None:
        if gemm not in GEMMS:
            raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
        if gemm == "mosaic" and jnp.dtype(dtype) not in _MOSAIC_DTYPES:
            raise ValueError(f"gemm='mosaic' takes bf16 / f16 (wgmma on {dtype} is tf32); "
                             "use the Triton kernels")
        return gemm
    if mosaic_available is None:
        mosaic_available = fused_lora_mgpu.available()
    if device is None:
        device = jax.devices()[0]
    supported = jnp.dtype(dtype) in _MOSAIC_DTYPES and mosaic_available
    return "mosaic" if supported and is_hopper(device) else "triton"


def _gemm_interpret(gemm: str, interpret):
    """The interpret argument of the GEMM kernels: Mosaic GPU's own interpreter off a GPU."""
    if gemm == "mosaic" and interpret:
        return fused_lora_mgpu.interpret_params()
    return interpret


def row_block(impl: str | None, num_rows: int, dtype=jnp.float32,
              config: FusedLoRAConfig | None = None, gemm: str | None = None) -> int:
    """The row tile (layout granularity) the kernels of `impl` (and `gemm`) use for
    `num_rows` rows. Mosaic GPU: the E / L row tile (64 for up to 64 rows; fewer rows are
    padded to it)."""
    style, _ = resolve_impl(impl)
    cfg = config or default_config(style)
    if style == "tpu":
        multiple = 8 * max(1, 4 // jnp.dtype(dtype).itemsize)
        return max(multiple, round_up(min(cfg.block_m, num_rows), multiple))
    if style == "gpu" and gemm_backend(dtype, gemm) == "mosaic":
        return 64 if num_rows <= 64 else cfg.mosaic_kernels().block_m
    return fit_block("gpu", cfg.block_m, num_rows)


def make_layout(seg_starts, seg_slot, slot_rank, slot_scale, slot_dropout, num_rows: int, *,
                impl: str | None = None, dtype=jnp.float32,
                config: FusedLoRAConfig | None = None, gemm: str | None = None) -> TileLayout:
    """Tile layout + lookup table for a microbatch, with the row tile `impl` (and `gemm`)
    uses (build once, pass as `layout=` to every layer)."""
    bm = row_block(impl, num_rows, dtype, config, gemm)
    style, _ = resolve_impl(impl)
    if style == "gpu" and gemm_backend(dtype, gemm) == "mosaic":
        return build_block_layout(seg_starts, seg_slot, slot_rank, slot_scale, slot_dropout,
                                  num_rows, bm)
    return build_tile_layout(seg_starts, seg_slot, slot_rank, slot_scale, slot_dropout,
                             num_rows, bm)


# --- the kernels' custom_vjp (tile layout, padded shapes) ---------------------------------------

def _forward(plan: _Plan, x_p, w_p, a_p, b_p, layout: TileLayout, seed):
    if plan.style == "gpu":
        s = fused_lora_gpu.shrink_gpu(x_p, a_p, layout, seed, plan.cfg, plan.interpret)
        if plan.gemm == "mosaic":
            y = fused_lora_mgpu.base_expand_mgpu(x_p, w_p, s, b_p, layout, plan.mosaic,
                                                 plan.gemm_interpret)
        else:
            y = fused_lora_gpu.base_expand_gpu(x_p, w_p, s, b_p, layout, plan.cfg,
                                               plan.interpret)
    else:
        s = fused_lora_tpu.shrink_tpu(x_p, a_p, layout, seed, plan.block_k, plan.interpret)
        y = fused_lora_tpu.base_expand_tpu(x_p, w_p, s, b_p, layout, seed, plan.block_k,
                                           plan.block_n, plan.interpret)
    return y, s


def _to_slots(per_item, item_slot, item_active, num_slots: int):
    """Sum per-tile / per-segment partials into their adapter slots (inactive ones dropped):
    a one-hot contraction over the items (deterministic; no scatter)."""
    keep = item_active & (item_slot >= 0)
    values = jnp.where(keep[:, None, None], per_item, 0.0)
    onehot = (item_slot[:, None] == jnp.arange(num_slots, dtype=_I32)[None, :]) & keep[:, None]
    return jnp.einsum("ep,erc->prc", onehot.astype(_F32), values,
                      precision=jax.lax.Precision.HIGHEST)


def _backward(plan: _Plan, x_p, w_p, a_p, b_p, layout: TileLayout, seed, s, dy):
    num_slots = a_p.shape[0]
    dy = dy.astype(x_p.dtype)
    if plan.style == "gpu":
        ds_parts, db_tiles = fused_lora_gpu.grad_s_b_gpu(dy, s, b_p, layout, plan.cfg,
                                                         plan.interpret)
        # rows of inactive tiles are not written by I: zero them (L multiplies, not selects)
        row_active = jnp.repeat(layout.tile_active, layout.block_m)[:, None]
        ds = jnp.where(row_active, jnp.sum(ds_parts, axis=0), 0.0).astype(dy.dtype)
        db = _to_slots(db_tiles, layout.tile_slot, layout.tile_active, num_slots)
        da_parts = fused_lora_gpu.grad_a_gpu(x_p, ds, layout, seed, plan.cfg, plan.interpret)
        da_segs = jnp.sum(da_parts, axis=0)
        if plan.gemm == "mosaic":
            dx = fused_lora_mgpu.grad_x_mgpu(dy, w_p, ds, a_p, layout, seed, plan.mosaic,
                                             plan.gemm_interpret)
        else:
            dx = fused_lora_gpu.grad_x_gpu(dy, w_p, ds, a_p, layout, seed, plan.cfg,
                                           plan.interpret)
    else:
        ds, db_segs = fused_lora_tpu.grad_s_b_tpu(dy, s, b_p, layout, seed, plan.block_n,
                                                  plan.interpret)
        db = _to_slots(db_segs, layout.seg_slot, layout.seg_active, num_slots)
        da_segs = fused_lora_tpu.grad_a_tpu(x_p, ds, layout, seed, plan.block_k,
                                            plan.interpret)
        dx = fused_lora_tpu.grad_x_tpu(dy, w_p, ds, a_p, layout, seed, plan.block_k,
                                       plan.block_n, plan.interpret)
    da = _to_slots(da_segs, layout.seg_slot, layout.seg_active, num_slots)
    return dx, da.astype(a_p.dtype), db.astype(b_p.dtype)


def _fused_core(plan, x_p, w_p, a_p, b_p, layout, seed):
    return _forward(plan, x_p, w_p, a_p, b_p, layout, seed)[0]


def _fused_core_fwd(plan, x_p, w_p, a_p, b_p, layout, seed):
    y, s = _forward(plan, x_p, w_p, a_p, b_p, layout, seed)
    return y, (x_p, w_p, a_p, b_p, layout, seed, s)


def _fused_core_bwd(plan, residuals, dy):
    x_p, w_p, a_p, b_p, layout, seed, s = residuals
    dx, da, db = _backward(plan, x_p, w_p, a_p, b_p, layout, seed, s, dy)
    # W is frozen (zero cotangent, never computed); the layout and the seed are metadata.
    return dx, None, da, db, None, None


_fused_core = jax.custom_vjp(_fused_core, nondiff_argnums=(0,))
_fused_core.defvjp(_fused_core_fwd, _fused_core_bwd)


# --- public ops -------------------------------------------------------------------------------

def mosaic_blocks(cfg: FusedLoRAConfig, k: int, n: int, rank: int = 16, itemsize: int = 2,
                  limit: int | None = None) -> FusedLoRAConfig:
    """The Mosaic GPU E / L config with its blocks fitted to k and n (its block_k / block_n
    are contraction / output blocks of both GEMMs, so both fit the smaller dimension) and to the
    shared memory of a CTA (`limit` bytes, default: this device's, `fused_lora_mgpu.smem_limit`)
    at the padded `rank`: the config itself if its estimate (`fused_lora_mgpu.smem_bytes`, for
    the longer contraction of E's k and L's n) fits, else the first fallback that does (fewer
    pipeline stages, down to 2, then narrower output blocks, then one compute warpgroup), so the
    resolver never picks blocks that cannot launch; ValueError (`check_smem`'s) when none fits."""
    mosaic = cfg.mosaic_kernels()
    fitted = dataclasses.replace(mosaic, block_k=fit_block("gpu", mosaic.block_k, min(k, n)),
                                 block_n=fit_block("gpu", mosaic.block_n, min(k, n)))
    contraction = max(k, n)
    fitting = fused_lora_mgpu.fit_smem(fitted, rank, itemsize, contraction, limit)
    if fitting is None:
        fused_lora_mgpu.check_smem(fitted, rank, itemsize, contraction, limit)  # raises
    return fitting


def _blocks(style, cfg: FusedLoRAConfig, k: int, n: int, gemm: str = "triton"):
    """(block_k, block_n) that k and n are padded to multiples of: on GPU the largest of the
    kernels' blocks (each kernel's block then divides the padded size)."""
    if style != "gpu":
        return fit_block(style, cfg.block_k, k), fit_block(style, cfg.block_n, n)
    configs = [cfg.kernel(name) for name in KERNELS]
    bk = max(fit_block(style, c.block_k, k) for c in configs)
    bn = max(fit_block(style, c.block_n, n) for c in configs)
    if gemm == "mosaic":  # k and n are each E's and L's contraction and output dimension
        mosaic = mosaic_blocks(cfg, k, n)
        both = max(mosaic.block_k, mosaic.block_n)
        bk, bn = max(bk, both), max(bn, both)
    return bk, bn


def _prepare(style, interpret, cfg, x, w, lora_a, lora_b, gemm):
    k, n = w.shape
    r_max = lora_a.shape[2]
    gemm = gemm_backend(x.dtype, gemm) if style == "gpu" else "triton"
    bk, bn = _blocks(style, cfg, k, n, gemm)
    kp, np_ = round_up(k, bk), round_up(n, bn)
    r_pad = max(16, next_pow2(r_max))
    dtype = x.dtype
    w_p = pad_axis(pad_axis(w.astype(dtype), 0, kp), 1, np_)
    a_p = pad_axis(pad_axis(lora_a.astype(dtype), 1, kp), 2, r_pad)
    b_p = pad_axis(pad_axis(lora_b.astype(dtype), 1, r_pad), 2, np_)
    plan = _Plan(style, interpret, cfg, bk, bn, gemm, _gemm_interpret(gemm, interpret),
                 mosaic_blocks(cfg, kp, np_, r_pad, jnp.dtype(dtype).itemsize) if gemm == "mosaic" else None)
    return plan, kp, w_p, a_p, b_p


def _pad_rows(plan: _Plan, x, layout: TileLayout):
    """x padded to whole row blocks (the Mosaic GPU kernels read whole aligned blocks; no copy
    when m is a multiple of block_m)."""
    if plan.gemm != "mosaic":
        return x
    return pad_axis(x, 0, round_up(x.shape[0], layout.block_m))


def fused_lora_linear(x, w, lora_a, lora_b, seg_starts, seg_slot, slot_rank, slot_scale,
                      slot_dropout, seed, *, impl: str | None = None,
                      config: FusedLoRAConfig | None = None, layout: TileLayout | None = None,
                      gemm: str | None = None):
    """Multi-adapter fused LoRA linear layer (see the module docstring).

    x [m, k], w [k, n] (frozen), lora_a [P, k, r_max], lora_b [P, r_max, n],
    seg_starts int32 [S+1], seg_slot int32 [S], slot_rank int32 [P], slot_scale float [P],
    slot_dropout float [P], seed int32 scalar -> y [m, n] (x.dtype).
    Differentiable in x, lora_a and lora_b (w's gradient is zero: it is frozen).
    `layout` (from `make_layout`, same impl and gemm: the Mosaic GPU GEMMs need its
    block-aligned layout) replaces the segment / slot metadata arguments. `gemm`: the GPU GEMM kernels, "triton" / "mosaic" / None (`gemm_backend`).
    """
    style, interpret = resolve_impl(impl)
    if style == "reference":
        return fused_lora_linear_reference(x, w, lora_a, lora_b, seg_starts, seg_slot,
                                           slot_rank, slot_scale, slot_dropout, seed)
    cfg = config or default_config(style)
    m, k = x.shape
    n = w.shape[1]
    if layout is None:
        slot_rank = jnp.minimum(slot_rank.astype(_I32), lora_a.shape[2])
        layout = make_layout(seg_starts, seg_slot, slot_rank, slot_scale, slot_dropout, m,
                             impl=impl, dtype=x.dtype, config=cfg, gemm=gemm)
    elif layout.num_rows != m:
        raise ValueError(f"layout is for {layout.num_rows} rows, x has {m}")
    plan, kp, w_p, a_p, b_p = _prepare(style, interpret, cfg, x, w, lora_a, lora_b, gemm)
    seed = jnp.reshape(jnp.asarray(seed, _I32), (1,))
    if style == "gpu":  # caller's row order (no gathered copy); only columns padded
        x_p = _pad_rows(plan, pad_axis(x, 1, kp), layout)
        return _fused_core(plan, x_p, w_p, a_p, b_p, layout, seed)[:m, :n]
    x_p = pad_axis(gather_rows(x, layout.row_src), 1, kp)
    y_p = _fused_core(plan, x_p, w_p, a_p, b_p, layout, seed)
    return y_p[layout.row_dst, :n]


def fused_lora_linear_single(x, w, a, b, scale, dropout, seed, *, impl: str | None = None,
                             config: FusedLoRAConfig | None = None, gemm: str | None = None):
    """Single-adapter fused LoRA linear layer (FusedLoRA): every row uses adapter (a, b).

    x [m, k], w [k, n], a [k, r], b [r, n], scale / dropout float scalars, seed int32 scalar
    -> y [m, n] (x.dtype). Rows stay in place (padded at the end to whole tiles; no gather).
    `gemm`: as in `fused_lora_linear`.
    """
    style, interpret = resolve_impl(impl)
    if style == "reference":
        return fused_lora_linear_single_reference(x, w, a, b, scale, dropout, seed)
    cfg = config or default_config(style)
    m = x.shape[0]
    n = w.shape[1]
    bm = row_block(impl, m, x.dtype, cfg, gemm)
    layout = identity_tile_layout(
        m, bm, jnp.array([a.shape[1]], _I32), jnp.reshape(jnp.asarray(scale, _F32), (1,)),
        jnp.reshape(jnp.asarray(dropout, _F32), (1,)))
    plan, kp, w_p, a_p, b_p = _prepare(style, interpret, cfg, x, w, a[None], b[None], gemm)
    if style == "gpu":
        x_p = _pad_rows(plan, pad_axis(x, 1, kp), layout)
    else:
        x_p = pad_axis(pad_axis(x, 0, layout.row_src.shape[0]), 1, kp)
    seed = jnp.reshape(jnp.asarray(seed, _I32), (1,))
    y_p = _fused_core(plan, x_p, w_p, a_p, b_p, layout, seed)
    return y_p[:m, :n]
