"""Fused (multi-)LoRA training kernels vs the pure-jnp reference (same dropout masks).

CPU: both kernel styles in interpret mode ("gpu" = Triton-style, "tpu" = Mosaic-style), small
shapes and small blocks so several tiles, k blocks and n blocks are exercised. GPU-only tests
run the compiled Triton kernels with the default config.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fused_lora import (
    fused_lora_linear,
    fused_lora_linear_single,
    make_layout,
)
from pallas_kernels.fused_lora_layout import (
    FusedLoRAConfig,
    build_tile_layout,
    dropout_mask,
    gather_rows,
    max_tiles,
)
from pallas_kernels.fused_lora_reference import (
    fused_lora_linear_reference,
    fused_lora_linear_single_reference,
)

SMALL = FusedLoRAConfig(block_m=16, block_k=16, block_n=16)
STYLES = ["gpu", "tpu"]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def make_problem(seed, m, k, n, num_slots, r_max, dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(keys[1], (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    a = (jax.random.normal(keys[2], (num_slots, k, r_max), jnp.float32) / np.sqrt(k)).astype(dtype)
    b = jax.random.normal(keys[3], (num_slots, r_max, n), jnp.float32).astype(dtype)
    return x, w, a, b


def meta(seg_starts, seg_slot, ranks, scales, drops):
    return (jnp.array(seg_starts, jnp.int32), jnp.array(seg_slot, jnp.int32),
            jnp.array(ranks, jnp.int32), jnp.array(scales, jnp.float32),
            jnp.array(drops, jnp.float32))


def value_and_grads(fn, x, w, a, b):
    """y and d/d(x, w, a, b) of a loss with a non-uniform dY, jitted."""
    def loss(x, w, a, b):
        y = fn(x, w, a, b)
        weights = jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape) * 0.37)
        return jnp.sum(y.astype(jnp.float32) * weights), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        x, w, a, b)
    return y, grads


def check_against_reference(impl, x, w, a, b, metadata, seed, tol, layout_kw=None):
    kernel = functools.partial(_multi, impl=impl, metadata=metadata, seed=seed,
                               layout_kw=layout_kw)
    reference = functools.partial(_multi, impl="reference", metadata=metadata, seed=seed)
    y, (dx, dw, da, db) = value_and_grads(kernel, x, w, a, b)
    y_ref, (dx_ref, _, da_ref, db_ref) = value_and_grads(reference, x, w, a, b)
    assert y.dtype == x.dtype and y.shape == y_ref.shape
    errors = {name: rel_err(got, want) for name, got, want in
              [("y", y, y_ref), ("dx", dx, dx_ref), ("da", da, da_ref), ("db", db, db_ref)]}
    assert all(e <= tol for e in errors.values()), errors
    assert not np.any(np.asarray(dw, np.float32)), "W is frozen: its cotangent must be zero"
    return y, (dx, da, db)


def _multi(x, w, a, b, *, impl, metadata, seed, layout_kw=None):
    layout = None
    if layout_kw is not None:
        layout = make_layout(*metadata, x.shape[0], impl=impl, dtype=x.dtype, **layout_kw)
    return fused_lora_linear(x, w, a, b, *metadata, seed, impl=impl, config=SMALL,
                             layout=layout)


# --- dropout hash and layout ------------------------------------------------------------------

def test_dropout_hash_rate_determinism_and_offsets():
    mask = np.asarray(dropout_mask(11, 256, 128, 0.3))
    assert abs(1.0 - mask.mean() - 0.3) < 0.01
    assert np.array_equal(mask, np.asarray(dropout_mask(11, 256, 128, 0.3)))
    assert (mask != np.asarray(dropout_mask(12, 256, 128, 0.3))).mean() > 0.3
    assert np.array_equal(np.asarray(dropout_mask(11, 56, 128, 0.3, row_offset=100)),
                          mask[100:156])
    assert np.asarray(dropout_mask(11, 64, 64, 0.0)).all()
    # rows and columns are decorrelated: per-row / per-column rates stay near p
    assert np.abs(1.0 - mask.mean(axis=0) - 0.3).max() < 0.15
    assert np.abs(1.0 - mask.mean(axis=1) - 0.3).max() < 0.15


@pytest.mark.parametrize("block_m", [8, 16])
def test_tile_layout_aligns_segments(block_m):
    m = 53
    seg_starts, seg_slot, ranks, scales, drops = meta(
        [2, 9, 9, 30, 47], [1, 0, -1, 2], [4, 8, 2], [1.0, 2.0, 0.5], [0.1, 0.0, 0.5])
    layout = build_tile_layout(seg_starts, seg_slot, ranks, scales, drops, m, block_m)
    assert layout.num_tiles == max_tiles(m, 4, block_m) and layout.block_m == block_m
    row_src = np.asarray(layout.row_src).reshape(layout.num_tiles, block_m)
    row_dst = np.asarray(layout.row_dst)
    # every caller row appears exactly once, and row_dst inverts row_src
    assert sorted(row_src[row_src >= 0].tolist()) == list(range(m))
    assert np.array_equal(row_src.reshape(-1)[row_dst], np.arange(m))
    # no tile straddles two segments; each tile's slot / rank / scale is its rows' adapter
    bounds = np.array([0, 2, 9, 9, 30, 47, m])
    ext_slot = np.array([-1, 1, 0, -1, 2, -1])
    for t in range(layout.num_tiles):
        rows = row_src[t][row_src[t] >= 0]
        if not int(layout.tile_live[t]):
            assert rows.size == 0
            continue
        segs = np.searchsorted(bounds, rows, side="right") - 1
        assert rows.size and np.all(segs == segs[0])
        assert np.array_equal(rows, int(layout.tile_row0[t]) + np.arange(rows.size))
        slot = ext_slot[segs[0]]
        assert int(layout.tile_slot[t]) == slot
        if slot >= 0:
            assert int(layout.tile_rank[t]) == [4, 8, 2][slot]
            assert float(layout.tile_scale[t]) == [1.0, 2.0, 0.5][slot]
    x = jnp.arange(m * 3, dtype=jnp.float32).reshape(m, 3) + 1.0
    x_p = gather_rows(x, layout.row_src)
    assert np.array_equal(np.asarray(x_p[layout.row_dst]), np.asarray(x))
    assert not np.any(np.asarray(x_p)[np.asarray(layout.row_src) < 0])


# --- reference semantics ------------------------------------------------------------------------

def test_reference_matches_naive_per_segment_loop():
    m, k, n, r_max = 41, 24, 20, 8
    x, w, a, b = make_problem(0, m, k, n, 3, r_max)
    bounds, slots = [3, 12, 20, 33], [2, -1, 0]
    ranks, scales, drops = [8, 5, 3], [0.5, 2.0, 1.5], [0.2, 0.0, 0.4]
    y = fused_lora_linear_reference(x, w, a, b, *meta(bounds, slots, ranks, scales, drops), 5)
    xn, wn, an, bn = (np.asarray(v, np.float64) for v in (x, w, a, b))
    want = xn @ wn
    for lo, hi, slot in zip(bounds[:-1], bounds[1:], slots):
        if slot < 0:
            continue
        r = ranks[slot]
        keep = np.asarray(dropout_mask(5, hi - lo, k, drops[slot], row_offset=lo))
        xhat = np.where(keep, xn[lo:hi], 0.0) / (1.0 - drops[slot])
        want[lo:hi] += scales[slot] * xhat @ an[slot][:, :r] @ bn[slot][:r]
    assert rel_err(y, want) < 1e-5
    # rows outside the segments and slot -1 rows are the base output
    base = [*range(0, 3), *range(12, 20), *range(33, m)]
    np.testing.assert_allclose(np.asarray(y)[base], (xn @ wn)[base], rtol=1e-5, atol=1e-5)


# --- kernels vs reference (interpret mode) -------------------------------------------------------

@pytest.mark.parametrize("impl", STYLES)
def test_multi_adapter_f32(impl):
    """4 adapters (ranks 8/3/16/5, r_max 16), a slot -1 segment, an empty segment, rows before
    and after the segments, odd m, k and n not multiples of the blocks."""
    m, k, n = 77, 40, 36
    x, w, a, b = make_problem(1, m, k, n, 5, 16)
    metadata = meta([4, 19, 19, 36, 45, 70], [3, 0, -1, 2, 4],
                    [8, 16, 16, 3, 5], [0.5, 2.0, 1.0, 1.5, 0.25], [0.1, 0.0, 0.0, 0.5, 0.2])
    y, (dx, da, db) = check_against_reference(impl, x, w, a, b, metadata, 123, TOL[jnp.float32])
    # slot -1 rows and rows outside all segments equal x @ W; an unused slot gets no gradient
    base_rows = [*range(0, 4), *range(19, 36), *range(70, m)]
    want = np.asarray(x @ w)[base_rows]
    np.testing.assert_allclose(np.asarray(y)[base_rows], want, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(da[1])) and not np.any(np.asarray(db[1]))
    # columns beyond an adapter's rank get no gradient
    assert not np.any(np.asarray(da[3])[:, 3:]) and not np.any(np.asarray(db[3])[3:])


@pytest.mark.parametrize("impl", STYLES)
def test_multi_adapter_bf16_shared_layout(impl):
    m, k, n = 45, 32, 48
    x, w, a, b = make_problem(2, m, k, n, 3, 8, jnp.bfloat16)
    metadata = meta([0, 13, 30, 45], [1, 2, 0], [8, 4, 6], [1.0, 2.0, 0.5], [0.25, 0.1, 0.0])
    check_against_reference(impl, x, w, a, b, metadata, 9, TOL[jnp.bfloat16], layout_kw={})


@pytest.mark.parametrize("impl", STYLES)
def test_eight_adapters_heterogeneous(impl):
    m, k, n = 59, 16, 16
    x, w, a, b = make_problem(3, m, k, n, 8, 16)
    starts = [0, 5, 11, 12, 20, 31, 38, 50, 59]
    metadata = meta(starts, [7, 6, 5, 4, 3, 2, 1, 0], [1, 2, 4, 8, 16, 3, 5, 7],
                    [0.5 + i for i in range(8)], [0.05 * i for i in range(8)])
    check_against_reference(impl, x, w, a, b, metadata, 2024, TOL[jnp.float32])


@pytest.mark.parametrize("impl", STYLES)
def test_single_adapter(impl):
    m, k, n, r = 33, 48, 24, 4
    x, w, a, b = make_problem(4, m, k, n, 1, r)
    a, b = a[0], b[0]

    def kernel(x, w, a, b):
        return fused_lora_linear_single(x, w, a, b, 1.75, 0.3, 77, impl=impl, config=SMALL)

    def reference(x, w, a, b):
        return fused_lora_linear_single_reference(x, w, a, b, 1.75, 0.3, 77)

    y, (dx, dw, da, db) = value_and_grads(kernel, x, w, a, b)
    y_ref, (dx_ref, _, da_ref, db_ref) = value_and_grads(reference, x, w, a, b)
    for got, want in [(y, y_ref), (dx, dx_ref), (da, da_ref), (db, db_ref)]:
        assert got.shape == want.shape and rel_err(got, want) <= TOL[jnp.float32]
    assert not np.any(np.asarray(dw))


@pytest.mark.parametrize("impl", STYLES)
def test_multi_adapter_equals_per_adapter(impl):
    """One multi-adapter call == per-adapter calls: the single-adapter op on each segment's rows
    (no dropout), and the multi op with only that segment active (with dropout: same rows, same
    masks). Gradients of each adapter equal its own call's gradients."""
    m, k, n = 42, 16, 32
    x, w, a, b = make_problem(5, m, k, n, 3, 8)
    bounds, slots = [0, 17, 26, 42], [2, 0, 1]
    ranks, scales = [8, 6, 3], [1.0, 0.5, 2.0]
    call = jax.jit(functools.partial(fused_lora_linear, impl=impl, config=SMALL))
    y = call(x, w, a, b, *meta(bounds, slots, ranks, scales, [0.0] * 3), 0)
    single = jax.jit(functools.partial(fused_lora_linear_single, impl=impl, config=SMALL))
    for lo, hi, slot in zip(bounds[:-1], bounds[1:], slots):
        r = ranks[slot]
        y_one = single(x[lo:hi], w, a[slot][:, :r], b[slot][:r], scales[slot], 0.0, 0)
        np.testing.assert_allclose(np.asarray(y[lo:hi]), np.asarray(y_one), rtol=1e-5,
                                   atol=1e-5)

    drops = [0.3, 0.2, 0.5]
    metadata = meta(bounds, slots, ranks, scales, drops)
    y, grads = value_and_grads(
        functools.partial(_multi, impl=impl, metadata=metadata, seed=31), x, w, a, b)
    for i, (lo, hi, slot) in enumerate(zip(bounds[:-1], bounds[1:], slots)):
        only = meta(bounds, [s if j == i else -1 for j, s in enumerate(slots)], ranks, scales,
                    drops)
        y_one, grads_one = value_and_grads(
            functools.partial(_multi, impl="reference", metadata=only, seed=31), x, w, a, b)
        np.testing.assert_allclose(np.asarray(y[lo:hi]), np.asarray(y_one[lo:hi]), rtol=1e-5,
                                   atol=1e-5)
        for got, want in [(grads[2][slot], grads_one[2][slot]),
                          (grads[3][slot], grads_one[3][slot])]:
            assert rel_err(got, want) <= TOL[jnp.float32]


def test_impl_validation_and_auto_dispatch():
    x, w, a, b = make_problem(6, 8, 16, 16, 1, 4)
    metadata = meta([0, 8], [0], [4], [1.0], [0.0])
    with pytest.raises(ValueError):
        fused_lora_linear(x, w, a, b, *metadata, 0, impl="cuda")
    y = fused_lora_linear(x, w, a, b, *metadata, 0)  # auto: reference on CPU
    want = fused_lora_linear_reference(x, w, a, b, *metadata, 0)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-6, atol=1e-6)


# --- compiled Triton kernels (GPU only) ---------------------------------------------------------

@pytest.mark.gpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_compiled_matches_reference(dtype):
    m, k, n = 301, 256, 384
    x, w, a, b = make_problem(7, m, k, n, 5, 32, dtype)
    metadata = meta([0, 70, 71, 150, 260, 290], [4, 0, -1, 2, 1],
                    [16, 32, 8, 4, 12], [0.5, 2.0, 1.0, 1.5, 0.25], [0.1, 0.0, 0.0, 0.5, 0.2])

    def kernel(x, w, a, b):
        return fused_lora_linear(x, w, a, b, *metadata, 5, impl="gpu")

    def reference(x, w, a, b):
        return fused_lora_linear(x, w, a, b, *metadata, 5, impl="reference")

    y, (dx, _, da, db) = value_and_grads(kernel, x, w, a, b)
    y_ref, (dx_ref, _, da_ref, db_ref) = value_and_grads(reference, x, w, a, b)
    errors = [rel_err(g, r) for g, r in [(y, y_ref), (dx, dx_ref), (da, da_ref), (db, db_ref)]]
    assert max(errors) <= TOL[dtype], errors


@pytest.mark.gpu_only
def test_gpu_compiled_single_adapter():
    m, k, n, r = 200, 128, 256, 16
    x, w, a, b = make_problem(8, m, k, n, 1, r)
    y, (dx, _, da, db) = value_and_grads(
        lambda x, w, a, b: fused_lora_linear_single(x, w, a, b, 2.0, 0.1, 3, impl="gpu"),
        x, w, a[0], b[0])
    y_ref, (dx_ref, _, da_ref, db_ref) = value_and_grads(
        lambda x, w, a, b: fused_lora_linear_single_reference(x, w, a, b, 2.0, 0.1, 3),
        x, w, a[0], b[0])
    errors = [rel_err(g, r) for g, r in [(y, y_ref), (dx, dx_ref), (da, da_ref), (db, db_ref)]]
    assert max(errors) <= TOL[jnp.float32], errors


def test_gpu_per_kernel_blocks_interpret():
    """Per-kernel overrides: row sub-tiles (kernel block_m < the layout's), k / n blocks that
    differ between kernels, grouped launch order and split dA sums, multi-adapter + dropout."""
    per_kernel = FusedLoRAConfig(block_m=16, block_k=16, block_n=32)
    config = FusedLoRAConfig(
        block_m=32, block_k=16, block_n=16, group_m=2, splits=3, shrink=per_kernel,
        base_expand=FusedLoRAConfig(block_m=32, block_k=32, block_n=16),
        grad_s_b=FusedLoRAConfig(block_m=16, block_n=32), grad_a=per_kernel,
        grad_x=FusedLoRAConfig(block_m=16, block_k=32, block_n=16))
    m, k, n = 83, 64, 64
    x, w, a, b = make_problem(9, m, k, n, 3, 8)
    metadata = meta([5, 40, 41, 83], [2, 0, 1], [8, 4, 6], [1.0, 2.0, 0.5], [0.25, 0.1, 0.0])

    def kernel(x, w, a, b):
        return fused_lora_linear(x, w, a, b, *metadata, 17, impl="gpu", config=config)

    def reference(x, w, a, b):
        return fused_lora_linear(x, w, a, b, *metadata, 17, impl="reference")

    y, (dx, _, da, db) = value_and_grads(kernel, x, w, a, b)
    y_ref, (dx_ref, _, da_ref, db_ref) = value_and_grads(reference, x, w, a, b)
    errors = [rel_err(g, r) for g, r in [(y, y_ref), (dx, dx_ref), (da, da_ref), (db, db_ref)]]
    assert max(errors) <= TOL[jnp.float32], errors
