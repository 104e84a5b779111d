"""The adapter window's expand (pallas_kernels/window_expand.py): the GPU kernel in interpret mode
against the plain-jnp reference on both B layouts (block-diagonal q/k/v-like widths, batched
gate/up-like), rows on every window slot, base rows (-1), second slots (token_extra), odd and
single row counts, float32 and bfloat16; the reference against a per-row loop; the kernel's
Triton lowering for sm_90 without a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.window_expand import BLOCK_N, window_expand, window_expand_reference
from tests.pallas_kernels.cases import TOL, rel_err

W, R = 4, 8  # window slots, rank: W*r = 32 columns per projection


def _case(seed, widths, batched, rows, dtype):
    """(y, B, token_window, token_extra, column_window, B as dense float32 [P*W*r, n])."""
    wr, n, p = W * R, sum(widths), len(widths)
    ky, kb = jax.random.split(jax.random.PRNGKey(seed))
    y = jax.random.normal(ky, (rows, n + p * wr), jnp.float32).astype(dtype)
    blocks = np.asarray(jax.random.normal(kb, (p, wr, max(widths)), jnp.float32))
    dense = np.zeros((p * wr, n), np.float32)
    offset = 0
    for q, width in enumerate(widths):
        dense[q * wr:(q + 1) * wr, offset:offset + width] = blocks[q, :, :width]
        offset += width
    b = jnp.asarray(blocks if batched else dense).astype(dtype)
    rng = np.random.default_rng(seed)
    tw = jnp.asarray(rng.integers(-1, W, rows), jnp.int32)
    te = jnp.asarray(np.where(rng.random(rows) < 0.3, rng.integers(0, W, rows), -1), jnp.int32)
    return y, b, tw, te, jnp.asarray(np.arange(wr) // R, jnp.int32), dense


CASES = [((2 * BLOCK_N, BLOCK_N, BLOCK_N), False, 5),  # q/k/v: block-diagonal, three widths
         ((2 * BLOCK_N, 2 * BLOCK_N), True, 33),  # gate/up: batched
         ((BLOCK_N,), False, 1),  # o / down, a single row
         ((BLOCK_N, BLOCK_N), True, 70)]  # more rows than one block


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
@pytest.mark.parametrize("widths,batched,rows", CASES)
def test_kernel_matches_reference(widths, batched, rows, dtype):
    y, b, tw, te, cw, _ = _case(rows, widths, batched, rows, dtype)
    want = window_expand_reference(y.astype(jnp.float32), b.astype(jnp.float32), tw, te, cw)
    for given in (None, widths):  # a block-diagonal B read whole, or one projection's rows a program
        got = window_expand(y, b, tw, te, cw, impl="gpu", widths=given)
        assert got.shape == (rows, sum(widths)) and got.dtype == dtype
        assert rel_err(got, want) <= TOL[dtype]


@pytest.mark.parametrize("batched", (False, True))
def test_reference_is_each_rows_own_slots(batched):
    """Row t's delta is the shrink columns of its slot and of its extra slot through B, nothing of
    the other slots: a loop over rows in numpy."""
    widths = (BLOCK_N, BLOCK_N)
    y, b, tw, te, cw, dense = _case(3, widths, batched, 9, jnp.float32)
    y_np, n, wr = np.asarray(y), sum(widths), W * R
    want = y_np[:, :n].copy()
    for t in range(y_np.shape[0]):
        for slot in {int(tw[t]), int(te[t])} - {-1}:
            for p in range(len(widths)):
                cols = n + p * wr + slot * R + np.arange(R)
                want[t] += y_np[t, cols] @ dense[p * wr + slot * R + np.arange(R)]
    got = window_expand_reference(y, b, tw, te, cw)
    assert rel_err(got, want) <= TOL[jnp.float32]


def test_base_rows_and_bias():
    """Rows on no slot keep their base columns exactly; a bias is added to every row."""
    widths = (BLOCK_N,)
    y, b, _, _, cw, _ = _case(4, widths, False, 7, jnp.float32)
    none = jnp.full((7,), -1, jnp.int32)
    bias = jnp.arange(BLOCK_N, dtype=jnp.float32)
    for impl in ("gpu", "reference"):
        out = window_expand(y, b, none, none, cw, bias, impl=impl)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(y[:, :BLOCK_N] + bias))


def test_leading_axes_and_fallback_shapes():
    """y [1, T, .] (the model's batch axis) keeps its axes; base columns that no column block
    divides take the reference on every impl; a y whose columns do not match B is a clear error."""
    widths = (48, 24)  # 72 base columns: no power-of-two block >= 16 divides them
    y, b, tw, te, cw, _ = _case(5, widths, False, 6, jnp.float32)
    got = window_expand(y[None], b, tw, te, cw, impl="gpu")
    assert got.shape == (1, 6, 72)
    assert rel_err(got[0], window_expand_reference(y, b, tw, te, cw)) <= TOL[jnp.float32]
    with pytest.raises(ValueError, match="columns"):
        window_expand(y[:, 1:], b, tw, te, cw, impl="gpu")


def test_block_diagonal_with_a_projection_without_window_columns():
    """A packed group whose window covers only some of its projections (q and v of q/k/v): B is
    block-diagonal over those (k's columns get no delta), P*W*r not a power of two is padded."""
    y, b, tw, te, cw, dense = _case(6, (2 * BLOCK_N, BLOCK_N, BLOCK_N), False, 11, jnp.float32)
    wr = W * R
    q_v = jnp.concatenate([jnp.asarray(dense[:wr]), jnp.asarray(dense[2 * wr:])])  # [2*W*r, n]
    n = 4 * BLOCK_N
    y2 = jnp.concatenate([y[:, :n], y[:, n:n + wr], y[:, n + 2 * wr:]], axis=1)
    want = window_expand_reference(y2, q_v, tw, te, cw)
    got = window_expand(y2, q_v, tw, te, cw, impl="gpu", widths=(2 * BLOCK_N, BLOCK_N, BLOCK_N))  # 3 widths, P = 2
    assert rel_err(got, want) <= TOL[jnp.float32]
    np.testing.assert_array_equal(np.asarray(got[:, 2 * BLOCK_N:3 * BLOCK_N]), np.asarray(y2[:, 2 * BLOCK_N:3 * BLOCK_N]))


def test_kernel_lowers_to_triton_for_cuda(monkeypatch):
    """The kernel lowers through Pallas' Triton lowering for sm_90 without a GPU (the pattern of
    test_paged_lora.py): block shapes, the dot and the masked loads are legal for Triton."""
    from jax import export
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    from pallas_kernels.window_expand import window_expand_gpu

    sm90 = gpu_info.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90)
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: sm90)
    spec, i32, bf16 = jax.ShapeDtypeStruct, jnp.int32, jnp.bfloat16
    wr, rows = 128, 32
    triton_call = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    for n, b_shape in ((768, (3 * wr, 768)), (512, (2, wr, 256))):
        args = (spec((rows, n + 3 * wr if len(b_shape) == 2 else n + 2 * wr), bf16), spec(b_shape, bf16),
                spec((rows,), i32), spec((rows,), i32), spec((wr,), i32))
        spans = (512, 128, 128) if len(b_shape) == 2 else None
        kernel = lambda y, b, tw, te, cw, spans=spans: window_expand_gpu(y, b, tw, te, cw, spans=spans)
        exported = export.export(jax.jit(kernel), platforms=["cuda"], disabled_checks=[triton_call])(*args)
        assert "xla.gpu.triton" in exported.mlir_module()


@pytest.mark.parametrize("batched", (False, True))
def test_stacked_layer_reads_its_own_layer(batched):
    """A stack of three layers' B read at layer 2 (the engine's layer scan) equals that layer's B
    alone, on the kernel and on the reference."""
    widths = (BLOCK_N, BLOCK_N)
    y, b, tw, te, cw, _ = _case(8, widths, batched, 9, jnp.float32)
    stack = jnp.stack([b * 3.0, b * -1.0, b])
    want = window_expand_reference(y, b, tw, te, cw)
    for impl in ("gpu", "reference"):
        got = window_expand(y, stack, tw, te, cw, layer=jnp.int32(2), impl=impl)
        assert rel_err(got, want) <= TOL[jnp.float32], impl
