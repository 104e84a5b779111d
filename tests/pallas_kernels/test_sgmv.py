"""SGMV shrink/expand, BGMV and segment_outer kernels (GPU and TPU style, interpret mode on
CPU) against the pure-jnp reference."""

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import reference as ref
from tests.pallas_kernels.cases import IMPLS, SMALL_TILES, TOL, arrays, mixed_batch, rel_err
from tests.pallas_kernels.cases import segments

DTYPES = (jnp.float32, jnp.bfloat16)
UNTOUCHED_ROWS = np.r_[5:14, 47:50]  # the slot -1 segment and the padding rows of MIXED


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_shrink_mixed_ranks(impl, dtype):
    x, lora_a, _, _, starts, slots, ranks, _ = mixed_batch(dtype)
    v = pk.sgmv_shrink(x, lora_a, starts, slots, ranks, impl=impl, tiles=SMALL_TILES)
    expected = ref.sgmv_shrink_ref(x, lora_a, starts, slots, ranks)
    assert v.shape == expected.shape and v.dtype == dtype
    assert rel_err(v, expected) <= TOL[dtype]
    assert not np.any(np.asarray(v[UNTOUCHED_ROWS], np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_expand_mixed_ranks_leaves_base_rows(impl, dtype):
    x, lora_a, lora_b, y, starts, slots, ranks, scales = mixed_batch(dtype, seed=1)
    v = ref.sgmv_shrink_ref(x, lora_a, starts, slots, ranks)
    out = pk.sgmv_expand(y, v, lora_b, starts, slots, ranks, scales, impl=impl, tiles=SMALL_TILES)
    expected = ref.sgmv_expand_ref(y, v, lora_b, starts, slots, ranks, scales)
    assert out.dtype == dtype
    assert rel_err(out - y, expected - y) <= TOL[dtype]
    np.testing.assert_array_equal(np.asarray(out[UNTOUCHED_ROWS]), np.asarray(y[UNTOUCHED_ROWS]))


@pytest.mark.parametrize("impl", IMPLS)
def test_single_segment_lora_delta(impl):
    x, lora_a, lora_b, _ = arrays(2, 32, 32, 32, 32, 2, jnp.float32)
    meta = segments([32], [1], [32])
    delta = pk.sgmv_lora_delta(x, lora_a, lora_b, *meta, impl=impl, tiles=SMALL_TILES)
    assert rel_err(delta, ref.sgmv_lora_delta_ref(x, lora_a, lora_b, *meta)) <= 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_64_adapters(impl):
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 4, 64)
    meta = segments(sizes, rng.permutation(64), rng.choice([8, 16], 64))
    x, lora_a, lora_b, y = arrays(3, int(sizes.sum()) + 5, 32, 32, 16, 64, jnp.float32)
    v = pk.sgmv_shrink(x, lora_a, *meta[:3], impl=impl, tiles=SMALL_TILES)
    assert rel_err(v, ref.sgmv_shrink_ref(x, lora_a, *meta[:3])) <= 1e-5
    out = pk.sgmv_expand(y, v, lora_b, *meta, impl=impl, tiles=SMALL_TILES)
    assert rel_err(out - y, ref.sgmv_expand_ref(y, v, lora_b, *meta) - y) <= 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_columns_beyond_rank_are_ignored(impl):
    """NaN in A columns / B rows / v columns >= rank must not reach the output."""
    x, lora_a, lora_b, y = arrays(4, 40, 32, 32, 64, 3, jnp.float32)
    meta = segments([10, 14, 16], [0, 1, 2], [8, 24, 64])
    live = np.arange(64)[None, :] < np.array([8, 24, 64])[:, None]  # per slot
    lora_a = jnp.where(live[:, None, :], lora_a, jnp.nan)
    lora_b = jnp.where(live[:, :, None], lora_b, jnp.nan)
    v = pk.sgmv_shrink(x, lora_a, *meta[:3], impl=impl, tiles=SMALL_TILES)
    assert rel_err(v, ref.sgmv_shrink_ref(x, jnp.nan_to_num(lora_a), *meta[:3])) <= 1e-5
    v_nan = jnp.where(v == 0, jnp.nan, v)
    out = pk.sgmv_expand(y, v_nan, lora_b, *meta, impl=impl, tiles=SMALL_TILES)
    expected = ref.sgmv_expand_ref(y, v, jnp.nan_to_num(lora_b), *meta)
    assert rel_err(out - y, expected - y) <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_bgmv(impl, dtype):
    x, lora_a, lora_b, y = arrays(5, 12, 48, 64, 64, 6, dtype)
    row_slot = jnp.array([0, 5, -1, 3, 3, 2, -1, 1, 4, 0, 5, 2], jnp.int32)
    row_rank = jnp.array([8, 16, 64, 32, 32, 64, 8, 17, 8, 8, 16, 64], jnp.int32)
    row_scale = jnp.linspace(0.5, 2.0, 12, dtype=jnp.float32)
    v = pk.bgmv_shrink(x, lora_a, row_slot, row_rank, impl=impl)
    assert rel_err(v, ref.bgmv_shrink_ref(x, lora_a, row_slot, row_rank)) <= TOL[dtype]
    out = pk.bgmv_expand(y, v, lora_b, row_slot, row_rank, row_scale, impl=impl)
    expected = ref.bgmv_expand_ref(y, v, lora_b, row_slot, row_rank, row_scale)
    assert rel_err(out - y, expected - y) <= TOL[dtype]
    base_rows = [2, 6]  # slot -1
    np.testing.assert_array_equal(np.asarray(out)[base_rows], np.asarray(y)[base_rows])


@pytest.mark.parametrize("impl", IMPLS)
def test_default_tiles(impl):
    x, lora_a, lora_b, y, starts, slots, ranks, scales = mixed_batch(jnp.float32, seed=6)
    v = pk.sgmv_shrink(x, lora_a, starts, slots, ranks, impl=impl)
    assert rel_err(v, ref.sgmv_shrink_ref(x, lora_a, starts, slots, ranks)) <= 1e-5
    out = pk.sgmv_expand(y, v, lora_b, starts, slots, ranks, scales, impl=impl)
    expected = ref.sgmv_expand_ref(y, v, lora_b, starts, slots, ranks, scales)
    assert rel_err(out - y, expected - y) <= 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_shared_routing(impl):
    x, lora_a, _, _, starts, slots, ranks, _ = mixed_batch(jnp.float32, seed=7)
    routing = pk.make_routing(starts, 64, 16)  # T = 50 padded to 4 tiles of 16 rows
    v = pk.sgmv_shrink(x, lora_a, starts, slots, ranks, impl=impl, tiles=SMALL_TILES,
                       routing=routing)
    assert rel_err(v, ref.sgmv_shrink_ref(x, lora_a, starts, slots, ranks)) <= 1e-5
    with pytest.raises(ValueError, match="tiles"):
        pk.sgmv_shrink(x, lora_a, starts, slots, ranks, impl=impl, tiles=SMALL_TILES,
                       routing=pk.make_routing(starts, 64, 32))


@pytest.mark.parametrize("rank_axis", (0, 1))
@pytest.mark.parametrize("impl", IMPLS)
def test_segment_outer(impl, rank_axis):
    x, lora_a, _, _, starts, slots, ranks, _ = mixed_batch(jnp.float32, seed=8)
    v = ref.sgmv_shrink_ref(x, lora_a, starts, slots, ranks) + 1.0  # nonzero beyond rank
    lhs, rhs = (v, x) if rank_axis == 0 else (x, v)
    out = pk.segment_outer(lhs, rhs, starts, slots, ranks, rank_axis=rank_axis, impl=impl,
                           tiles=SMALL_TILES)
    expected = ref.segment_outer_ref(lhs, rhs, starts, slots, ranks, rank_axis)
    assert out.shape == expected.shape
    assert rel_err(out, expected) <= 1e-5


def test_auto_impl_and_errors():
    assert pk.resolve_impl(None) == ("reference", False)  # CPU: the jnp reference
    assert pk.resolve_impl("gpu") == ("gpu", True)
    with pytest.raises(ValueError, match="impl"):
        pk.resolve_impl("cuda")


@pytest.mark.parametrize("impl", IMPLS)
def test_sgmv_lora_pipeline(impl):
    """shrink -> expand with the split-K partials passed straight on (GPU), row tiles of the
    two kernels different (the partials' rows are cut to the expand's padding)."""
    x, lora_a, lora_b, y, starts, slots, ranks, scales = mixed_batch(jnp.float32, seed=9)
    expand_tiles = SMALL_TILES.__class__(block_rows=32, block_k=16, block_n=32, rank_chunk=32,
                                         col_blocks=2)  # one program loops over both blocks
    out = pk.sgmv_lora(y, x, lora_a, lora_b, starts, slots, ranks, scales, impl=impl,
                       tiles=(SMALL_TILES, expand_tiles))
    v = ref.sgmv_shrink_ref(x, lora_a, starts, slots, ranks)
    expected = ref.sgmv_expand_ref(y, v, lora_b, starts, slots, ranks, scales)
    assert rel_err(out - y, expected - y) <= 1e-5
    np.testing.assert_array_equal(np.asarray(out[UNTOUCHED_ROWS]), np.asarray(y[UNTOUCHED_ROWS]))


@pytest.mark.parametrize("impl", IMPLS)
def test_bgmv_lora_pipeline(impl):
    x, lora_a, lora_b, y = arrays(10, 12, 64, 48, 32, 5, jnp.float32)
    row_slot = jnp.array([0, 4, -1, 3, 3, 2, -1, 1, 4, 0, 2, 2], jnp.int32)
    row_rank = jnp.array([8, 16, 32, 32, 32, 0, 8, 17, 8, 8, 16, 32], jnp.int32)
    row_scale = jnp.linspace(0.5, 2.0, 12, dtype=jnp.float32)
    tiles = (SMALL_TILES, SMALL_TILES) if impl == "gpu" else None
    out = pk.bgmv_lora(y, x, lora_a, lora_b, row_slot, row_rank, row_scale, impl=impl,
                       tiles=tiles)
    v = ref.bgmv_shrink_ref(x, lora_a, row_slot, row_rank)
    expected = ref.bgmv_expand_ref(y, v, lora_b, row_slot, row_rank, row_scale)
    assert rel_err(out - y, expected - y) <= 1e-5
    np.testing.assert_array_equal(np.asarray(out)[[2, 5, 6]], np.asarray(y)[[2, 5, 6]])
