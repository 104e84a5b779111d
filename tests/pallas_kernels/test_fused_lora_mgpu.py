"""Mosaic GPU E / L kernels (`fused_lora_mgpu`) and the GEMM-backend resolver.

CPU: the fused op with gemm="mosaic" runs the Mosaic GPU kernels under Mosaic GPU's interpret
mode (D, I, K in the Triton interpreter) against the pure-jnp reference: bf16, single and multi
adapter, dropout on / off, odd m, m below one row tile, segments that share a row block (the
TMA store ladder), gradients. The kernels are also lowered for CUDA (jax.export) so Mosaic
GPU's layout inference checks them. The resolver is tested with the device capability mocked. GPU-only tests
run the compiled kernels (bf16; float32 goes to Triton, wgmma on f32 being tf32).
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fused_lora, fused_lora_gpu, fused_lora_mgpu
from pallas_kernels.fused_lora import (
    fused_lora_linear,
    fused_lora_linear_single,
    gemm_backend,
    make_layout,
)
from pallas_kernels.fused_lora_layout import (
    MOSAIC_DEFAULT,
    FusedLoRAConfig,
    build_block_layout,
    gather_rows,
    max_block_tiles,
)
from pallas_kernels.fused_lora_reference import fused_lora_linear_single_reference
from tests.pallas_kernels.test_fused_lora import TOL, make_problem, meta, rel_err, value_and_grads

BF16 = jnp.bfloat16
# 64-row tiles, 32-deep contraction steps, 64 output columns per CTA in 2 compute warpgroups:
# the tiny shapes span several row tiles, pipeline steps and output blocks.
SMALL = FusedLoRAConfig(block_m=32, block_k=32, block_n=32,
                        mosaic=FusedLoRAConfig(block_m=64, block_k=32, block_n=64, num_warps=8,
                                               num_stages=2, group_m=2))


def _errors(kernel, reference, x, w, a, b):
    y, (dx, dw, da, db) = value_and_grads(kernel, x, w, a, b)
    y_ref, (dx_ref, _, da_ref, db_ref) = value_and_grads(reference, x, w, a, b)
    assert y.dtype == x.dtype and y.shape == y_ref.shape
    assert not np.any(np.asarray(dw, np.float32)), "W is frozen: its cotangent must be zero"
    errors = {name: rel_err(got, want) for name, got, want in
              [("y", y, y_ref), ("dx", dx, dx_ref), ("da", da, da_ref), ("db", db, db_ref)]}
    return errors, y


class _Spy:
    """Counts calls of the E / L kernels of both backends."""

    def __init__(self, monkeypatch):
        self.calls = []
        for module, name in [(fused_lora_mgpu, "base_expand_mgpu"),
                             (fused_lora_mgpu, "grad_x_mgpu"),
                             (fused_lora_gpu, "base_expand_gpu"), (fused_lora_gpu, "grad_x_gpu")]:
            monkeypatch.setattr(module, name, self._wrap(name, getattr(module, name)))

    def _wrap(self, name, fn):
        def spy(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)
        return spy


# --- the resolver ---------------------------------------------------------------------------

def _device(platform="gpu", capability="9.0"):
    return types.SimpleNamespace(platform=platform, compute_capability=capability)


def test_gemm_backend_picks_mosaic_only_on_hopper_with_mosaic_gpu():
    hopper, ampere = _device(capability="9.0"), _device(capability="8.0")
    assert gemm_backend(BF16, device=hopper, mosaic_available=True) == "mosaic"
    assert gemm_backend(jnp.float16, device=hopper, mosaic_available=True) == "mosaic"
    assert gemm_backend(jnp.float32, device=hopper, mosaic_available=True) == "triton"
    assert gemm_backend(BF16, device=hopper, mosaic_available=False) == "triton"
    assert gemm_backend(BF16, device=ampere, mosaic_available=True) == "triton"
    assert gemm_backend(BF16, device=_device("cpu", None), mosaic_available=True) == "triton"
    assert gemm_backend(BF16, "triton", device=hopper, mosaic_available=True) == "triton"
    assert gemm_backend(BF16, "mosaic", device=ampere, mosaic_available=False) == "mosaic"
    with pytest.raises(ValueError):
        gemm_backend(jnp.float32, "mosaic")
    with pytest.raises(ValueError):
        gemm_backend(BF16, "cublas")
    assert fused_lora_mgpu.available()  # the installed jax (0.12) has the API


@pytest.mark.parametrize("mosaic_available", [True, False])
def test_auto_selection_runs_the_chosen_kernels(monkeypatch, mosaic_available):
    """With a Hopper device mocked, the auto choice runs the Mosaic GPU kernels when the API is
    available and the Triton kernels when it is not; the result matches the reference."""
    monkeypatch.setattr(fused_lora, "is_hopper", lambda device: True)
    monkeypatch.setattr(fused_lora_mgpu, "available", lambda: mosaic_available)
    spy = _Spy(monkeypatch)
    m, k, n, r = 70, 64, 64, 8
    x, w, a, b = make_problem(21, m, k, n, 1, r, BF16)
    errors, _ = _errors(
        lambda x, w, a, b: fused_lora_linear_single(x, w, a, b, 1.5, 0.2, 4, impl="gpu",
                                                    config=SMALL),
        lambda x, w, a, b: fused_lora_linear_single_reference(x, w, a, b, 1.5, 0.2, 4),
        x, w, a[0], b[0])
    assert max(errors.values()) <= TOL[BF16], errors
    want = ({"base_expand_mgpu", "grad_x_mgpu"} if mosaic_available
            else {"base_expand_gpu", "grad_x_gpu"})
    assert set(spy.calls) == want


# --- kernels vs reference (Mosaic GPU interpret mode) ---------------------------------------

# the default blocks at k = n = 256: 128 columns per warpgroup, L's LoRA term in 2 chunks
WIDE = FusedLoRAConfig(block_m=32, block_k=32, block_n=32)


@pytest.mark.parametrize("m, k, n, dropout, config", [(37, 96, 64, 0.0, SMALL),
                                                      (151, 96, 64, 0.3, SMALL),
                                                      (130, 256, 256, 0.2, WIDE)])
def test_single_adapter(m, k, n, dropout, config):
    """Odd m: below one 64-row tile (padded) and tiles with the last one partial."""
    r = 8
    x, w, a, b = make_problem(22, m, k, n, 1, r, BF16)
    errors, _ = _errors(
        lambda x, w, a, b: fused_lora_linear_single(x, w, a, b, 0.75, dropout, 9, impl="gpu",
                                                    config=config, gemm="mosaic"),
        lambda x, w, a, b: fused_lora_linear_single_reference(x, w, a, b, 0.75, dropout, 9),
        x, w, a[0], b[0])
    assert max(errors.values()) <= TOL[BF16], errors


@pytest.mark.parametrize("drops, shared_layout", [((0.0, 0.0, 0.0, 0.0), False),
                                                  ((0.1, 0.0, 0.5, 0.25), True)])
def test_multi_adapter(drops, shared_layout):
    """4 adapters (ranks 8/3/16/5; a 1-row segment) + a slot -1 segment, rows before / after
    the segments, odd m, segment starts off the 64-row grid (tiles end mid-block: partial TMA
    stores); with dropout, the block layout built once by make_layout and passed in."""
    m, k, n = 181, 64, 96
    x, w, a, b = make_problem(23, m, k, n, 5, 16, BF16)
    metadata = meta([3, 50, 51, 120, 131, 170], [3, 0, -1, 2, 4],
                    [8, 16, 16, 3, 5], [0.5, 2.0, 1.0, 1.5, 0.25], [drops[0], 0.0, *drops[1:]])
    layout = (make_layout(*metadata, m, impl="gpu", dtype=BF16, config=SMALL, gemm="mosaic")
              if shared_layout else None)
    call = functools.partial(fused_lora_linear, impl="gpu", config=SMALL, layout=layout)
    errors, y = _errors(
        lambda x, w, a, b: call(x, w, a, b, *metadata, 123, gemm="mosaic"),
        lambda x, w, a, b: fused_lora_linear(x, w, a, b, *metadata, 123, impl="reference"),
        x, w, a, b)
    assert max(errors.values()) <= TOL[BF16], errors
    base_rows = [*range(0, 3), *range(51, 120), *range(170, m)]  # outside / slot -1
    want = np.asarray(jnp.dot(x, w, preferred_element_type=jnp.float32).astype(BF16))
    assert rel_err(np.asarray(y)[base_rows], want[base_rows]) <= TOL[BF16]


def test_block_layout_tiles_are_segment_block_intersections():
    m, bm = 181, 64
    starts, slots = [3, 50, 51, 120, 131, 170], [3, 0, -1, 2, 4]
    seg_starts, seg_slot, ranks, scales, drops = meta(starts, slots, [8, 16, 16, 3, 5],
                                                      [0.5, 2.0, 1.0, 1.5, 0.25], [0.1] * 5)
    layout = build_block_layout(seg_starts, seg_slot, ranks, scales, drops, m, bm)
    assert layout.num_tiles == max_block_tiles(m, len(slots), bm) and layout.block_m == bm
    row0, skip, end = (np.asarray(v) for v in (layout.tile_row0, layout.tile_skip,
                                                layout.tile_nrows))
    live = np.asarray(layout.tile_live) > 0
    bounds = np.array([0, *starts, m])
    ext_slot = np.array([-1, *slots, -1])
    covered = []
    for t in np.flatnonzero(live):
        assert row0[t] % bm == 0 and 0 <= skip[t] < end[t] <= bm
        rows = np.arange(row0[t] + skip[t], row0[t] + end[t])
        segs = np.searchsorted(bounds, rows, side="right") - 1
        assert np.all(segs == segs[0]), "a tile holds one segment"
        assert int(layout.tile_slot[t]) == ext_slot[segs[0]]
        # the tile's rows are the whole intersection of its segment with its block
        lo, hi = bounds[segs[0]], bounds[segs[0] + 1]
        assert rows[0] == max(lo, row0[t]) and rows[-1] == min(hi, row0[t] + bm) - 1
        covered.extend(rows.tolist())
    assert sorted(covered) == list(range(m)) and len(covered) == m
    assert not np.any(end[~live])
    row_src = np.asarray(layout.row_src)
    assert np.array_equal(row_src[np.asarray(layout.row_dst)], np.arange(m))
    x = jnp.arange(m * 3, dtype=jnp.float32).reshape(m, 3) + 1.0
    assert np.array_equal(np.asarray(gather_rows(x, layout.row_src)[layout.row_dst]), x)


def test_kernels_lower_for_cuda():
    """The production config's E and L pass Mosaic GPU's layout inference and lowering for a
    CUDA target (jax.export on CPU; interpret mode does not check TMA / wgmma layouts)."""
    m, k, n, r = 512, 256, 512, 16
    layout = build_block_layout(*meta([3, 200, 300], [0, 1], [16, 8], [1.0, 2.0], [0.1, 0.0]),
                                m, MOSAIC_DEFAULT.block_m)
    rows = layout.num_tiles * layout.block_m
    spec = lambda *shape, dtype=BF16: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    kernels = {
        "E": (lambda x, w, s, b: fused_lora_mgpu.base_expand_mgpu(x, w, s, b, layout,
                                                                   MOSAIC_DEFAULT, False),
              (spec(m, k), spec(k, n), spec(rows, r), spec(2, r, n))),
        "L": (lambda dy, w, ds, a, seed: fused_lora_mgpu.grad_x_mgpu(
                  dy, w, ds, a, layout, seed, MOSAIC_DEFAULT, False),
              (spec(m, n), spec(k, n), spec(rows, r), spec(2, k, r), spec(1, dtype=jnp.int32))),
    }
    for name, (fn, args) in kernels.items():
        module = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
        assert "mosaic_gpu" in module and "wgmma" in module, name


@pytest.mark.parametrize("gemm", ["mosaic", "triton"])
def test_fused_op_lowers_for_cuda(monkeypatch, gemm):
    """The whole layer's gradient (D, E, I, K, L: Triton + either GEMM backend) lowers for an
    H200 target on CPU: compiled mode forced, Triton's GPU info pinned to the H200's."""
    from jax._src.pallas.triton import gpu_info

    info = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: info)
    monkeypatch.setattr(fused_lora, "resolve_impl", lambda impl: ("gpu", False))
    m, k, n, r = 1000, 512, 768, 16
    metadata = meta([0, 100, 333, 700, 1000], [0, 1, 2, 3], [r] * 4, [2.0] * 4, [0.1] * 4)

    def loss(x, w, a, b):
        y = fused_lora_linear(x, w, a, b, *metadata, 3, impl="gpu", gemm=gemm)
        return jnp.sum(y.astype(jnp.float32))

    specs = [jax.ShapeDtypeStruct(shape, BF16) for shape in [(m, k), (k, n), (4, k, r),
                                                             (4, r, n)]]
    triton_call = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    module = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 2, 3))), platforms=["cuda"],
                               disabled_checks=[triton_call])(*specs).mlir_module()
    assert "xla.gpu.triton" in module
    assert ("mosaic_gpu" in module) == (gemm == "mosaic")


# --- compiled kernels (GPU only) ------------------------------------------------------------

def _compiled_case(dtype, dropout, gemm=None):
    m, k, n = 301, 256, 384
    x, w, a, b = make_problem(25, m, k, n, 5, 32, dtype)
    metadata = meta([0, 70, 71, 150, 260, 290], [4, 0, -1, 2, 1], [16, 32, 8, 4, 12],
                    [0.5, 2.0, 1.0, 1.5, 0.25], [dropout, 0.0, 0.0, dropout, dropout])
    return _errors(
        lambda x, w, a, b: fused_lora_linear(x, w, a, b, *metadata, 5, impl="gpu", gemm=gemm),
        lambda x, w, a, b: fused_lora_linear(x, w, a, b, *metadata, 5, impl="reference"),
        x, w, a, b)[0]


@pytest.mark.gpu_only
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_gpu_mosaic_multi_adapter_bf16(dropout):
    errors = _compiled_case(BF16, dropout, gemm="mosaic")
    assert max(errors.values()) <= TOL[BF16], errors


@pytest.mark.gpu_only
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gpu_mosaic_single_adapter_bf16(dropout):
    m, k, n, r = 333, 512, 256, 16
    x, w, a, b = make_problem(26, m, k, n, 1, r, BF16)
    errors, _ = _errors(
        lambda x, w, a, b: fused_lora_linear_single(x, w, a, b, 2.0, dropout, 3, impl="gpu",
                                                    gemm="mosaic"),
        lambda x, w, a, b: fused_lora_linear_single_reference(x, w, a, b, 2.0, dropout, 3),
        x, w, a[0], b[0])
    assert max(errors.values()) <= TOL[BF16], errors


@pytest.mark.gpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, BF16])
def test_gpu_auto_backend(dtype):
    """Auto choice on this GPU: float32 always Triton (f32-accurate); bf16 Mosaic GPU on Hopper
    with Mosaic GPU available, else Triton (issue 24 item 4); both match the reference."""
    expected = ("mosaic" if dtype == BF16 and fused_lora_mgpu.available()
                and fused_lora.is_hopper(jax.devices()[0]) else "triton")
    assert gemm_backend(dtype) == expected
    errors = _compiled_case(dtype, 0.1)
    assert max(errors.values()) <= TOL[dtype], errors
