"""SGMV/BGMV over a stacked pool (`sgmv_lora_stacked`, `bgmv_lora_stacked`: entries slot +
offset of A/B [layers x slots, ...], rank/scale read per entry) against the jnp reference run on
the same layer's slice with per-row/segment metadata, GPU and TPU style in interpret mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import reference as ref
from tests.pallas_kernels.cases import IMPLS, SMALL_TILES, TOL, arrays, rel_err

LAYERS, SLOTS, K, N, R_MAX = 3, 5, 64, 48, 32
DTYPES = (jnp.float32, jnp.bfloat16)


def stacked(seed: int, dtype):
    """(A [L*slots, k, r], B [L*slots, r, n], rank [L*slots], scale [L*slots]) random, mixed
    ranks (0 for some entries: an adapter that does not target this module in that layer)."""
    _, lora_a, lora_b, _ = arrays(seed, 1, K, N, R_MAX, LAYERS * SLOTS, dtype)
    rng = np.random.default_rng(seed)
    rank = jnp.asarray(rng.choice([0, 8, 16, 17, 32], LAYERS * SLOTS).astype(np.int32))
    scale = jnp.asarray(rng.uniform(0.5, 2.0, LAYERS * SLOTS).astype(np.float32))
    return lora_a, lora_b, rank, scale


def layer_metadata(slot, rank, scale, layer: int):
    """Per row/segment (rank, scale) of `slot` in `layer`, 0 for slot -1: the plain kernels' input."""
    entry = jnp.maximum(slot, 0) + layer * SLOTS
    return jnp.where(slot >= 0, rank[entry], 0), jnp.where(slot >= 0, scale[entry], 0.0)


def layer_slice(array, layer: int):
    return array[layer * SLOTS: (layer + 1) * SLOTS]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_bgmv_stacked(impl, dtype):
    x, _, _, y = arrays(21, 12, K, N, R_MAX, 1, dtype)
    lora_a, lora_b, rank, scale = stacked(22, dtype)
    row_slot = jnp.array([0, 4, -1, 3, 3, 2, -1, 1, 4, 0, 2, 2], jnp.int32)
    layer = 1
    tiles = (SMALL_TILES, SMALL_TILES) if impl == "gpu" else None
    out = jax.jit(lambda y, offset: pk.bgmv_lora_stacked(
        y, x, lora_a, lora_b, row_slot, rank, scale, offset, impl=impl, tiles=tiles))(y, jnp.int32(layer * SLOTS))
    row_rank, row_scale = layer_metadata(row_slot, rank, scale, layer)
    a, b = layer_slice(lora_a, layer), layer_slice(lora_b, layer)
    v = ref.bgmv_shrink_ref(x.astype(jnp.float32), a.astype(jnp.float32), row_slot, row_rank)
    expected = ref.bgmv_expand_ref(y.astype(jnp.float32), v, b.astype(jnp.float32), row_slot, row_rank, row_scale)
    assert float(jnp.abs(expected - y.astype(jnp.float32)).max()) > 0.1  # the adapters contribute
    assert rel_err(out.astype(jnp.float32) - y, expected - y) <= TOL[dtype]
    untouched = np.asarray((row_slot < 0) | (row_rank == 0))
    np.testing.assert_array_equal(np.asarray(out)[untouched], np.asarray(y)[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_sgmv_stacked(impl, dtype):
    x, _, _, y = arrays(31, 40, K, N, R_MAX, 1, dtype)
    lora_a, lora_b, rank, scale = stacked(32, dtype)
    starts = jnp.array([0, 7, 7, 19, 30, 36], jnp.int32)  # an empty segment; rows 36.. padding
    seg_slot = jnp.array([2, 0, 4, -1, 1], jnp.int32)
    layer = 2
    tiles = (SMALL_TILES, SMALL_TILES) if impl == "gpu" else None
    out = pk.sgmv_lora_stacked(y, x, lora_a, lora_b, starts, seg_slot, rank, scale, jnp.int32(layer * SLOTS),
                               impl=impl, tiles=tiles)
    seg_rank, seg_scale = layer_metadata(seg_slot, rank, scale, layer)
    a, b = layer_slice(lora_a, layer), layer_slice(lora_b, layer)
    f32 = lambda array: array.astype(jnp.float32)
    v = ref.sgmv_shrink_ref(f32(x), f32(a), starts, seg_slot, seg_rank)
    expected = ref.sgmv_expand_ref(f32(y), v, f32(b), starts, seg_slot, seg_rank, seg_scale)
    assert float(jnp.abs(expected - f32(y)).max()) > 0.1
    assert rel_err(f32(out) - f32(y), expected - f32(y)) <= TOL[dtype]
    untouched = np.r_[19:30, 36:40]  # the slot -1 segment and the padding rows
    np.testing.assert_array_equal(np.asarray(out)[untouched], np.asarray(y)[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_bgmv_grouped(impl, dtype):
    """Three projections of one x (output widths 48, 16, 96) in one shrink + one expand equal
    three `bgmv_lora_stacked` calls; per-projection ranks (0 where a module is not targeted)."""
    x, _, _, _ = arrays(41, 12, K, N, R_MAX, 1, dtype)
    widths = (48, 16, 96)
    pools = [stacked(42 + g, dtype) for g in range(3)]
    lora_bs = [arrays(50 + g, 1, 1, n, R_MAX, LAYERS * SLOTS, dtype)[2] for g, n in enumerate(widths)]
    ys = [arrays(60 + g, 12, 1, n, 1, 1, dtype)[3] for g, n in enumerate(widths)]
    row_slot = jnp.array([0, 4, -1, 3, 3, 2, -1, 1, 4, 0, 2, 2], jnp.int32)
    offset = jnp.int32(1 * SLOTS)
    tiles = (SMALL_TILES, SMALL_TILES) if impl == "gpu" else None
    outs = pk.bgmv_lora_grouped(ys, x, [p[0] for p in pools], lora_bs, row_slot, [p[2] for p in pools],
                                [p[3] for p in pools], offset, impl=impl, tiles=tiles)
    for g, (y, out) in enumerate(zip(ys, outs)):
        a, _, rank, scale = pools[g]
        expected = pk.bgmv_lora_stacked(y.astype(jnp.float32), x.astype(jnp.float32), a.astype(jnp.float32),
                                        lora_bs[g].astype(jnp.float32), row_slot, rank, scale, offset,
                                        impl="reference")
        assert float(jnp.abs(expected - y.astype(jnp.float32)).max()) > 0.1
        assert rel_err(out.astype(jnp.float32) - y, expected - y) <= TOL[dtype], g
        untouched = np.asarray(row_slot < 0)
        np.testing.assert_array_equal(np.asarray(out)[untouched], np.asarray(y)[untouched])


@pytest.mark.parametrize("col_blocks", [2, 4])
def test_bgmv_expand_column_groups(col_blocks):
    """GPU BGMV expand programs over `col_blocks` column blocks each (v's split-K parts summed once
    per program): single and grouped (widths 64, 32, 128 in 16-wide blocks: the grouped call cuts
    col_blocks to divide every width) equal the reference; mixed ranks (two rank chunks), rows
    with slot -1 untouched."""
    import dataclasses

    shrink = dataclasses.replace(SMALL_TILES, k_splits=4)
    expand = dataclasses.replace(SMALL_TILES, block_n=16, col_blocks=col_blocks)
    x, _, _, _ = arrays(71, 12, K, N, R_MAX, 1, jnp.float32)
    row_slot = jnp.array([0, 4, -1, 3, 3, 2, -1, 1, 4, 0, 2, 2], jnp.int32)
    offset = jnp.int32(2 * SLOTS)
    widths = (64, 32, 128)
    pools = [stacked(72 + g, jnp.float32) for g in range(3)]
    lora_bs = [arrays(80 + g, 1, 1, n, R_MAX, LAYERS * SLOTS, jnp.float32)[2] for g, n in enumerate(widths)]
    ys = [arrays(90 + g, 12, 1, n, 1, 1, jnp.float32)[3] for g, n in enumerate(widths)]
    outs = pk.bgmv_lora_grouped(ys, x, [p[0] for p in pools], lora_bs, row_slot, [p[2] for p in pools],
                                [p[3] for p in pools], offset, impl="gpu", tiles=(shrink, expand))
    single = pk.bgmv_lora_stacked(ys[2], x, pools[2][0], lora_bs[2], row_slot, pools[2][2], pools[2][3], offset,
                                  impl="gpu", tiles=(shrink, expand))
    for g, (y, out) in enumerate(zip(ys, outs)):
        a, _, rank, scale = pools[g]
        expected = pk.bgmv_lora_stacked(y, x, a, lora_bs[g], row_slot, rank, scale, offset, impl="reference")
        assert float(jnp.abs(expected - y).max()) > 0.1
        assert rel_err(out - y, expected - y) <= 1e-5, g
        np.testing.assert_array_equal(np.asarray(out)[np.asarray(row_slot < 0)], np.asarray(y)[np.asarray(row_slot < 0)])
    assert rel_err(single - ys[2], expected - ys[2]) <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("widths", [(64, 32, 32), (48, 16, 96), (32,)])
def test_bgmv_packed(impl, dtype, widths):
    """`bgmv_lora_packed`: the projections' outputs side by side in one array (a packed kernel's),
    each projection's LoRA added in its own columns, equals `bgmv_lora_grouped` on them cut apart.
    Widths that are multiples of the expand's 16-wide blocks take the in-place packed kernel on GPU
    (col_blocks cut to divide them: 2 for (64, 32, 32), 1 for (48, 16, 96)); one projection too."""
    import dataclasses

    x, _, _, _ = arrays(141, 12, K, N, R_MAX, 1, dtype)
    pools = [stacked(142 + g, dtype) for g in range(len(widths))]
    lora_bs = [arrays(150 + g, 1, 1, n, R_MAX, LAYERS * SLOTS, dtype)[2] for g, n in enumerate(widths)]
    y = arrays(160, 12, 1, sum(widths), 1, 1, dtype)[3]
    row_slot = jnp.array([0, 4, -1, 3, 3, 2, -1, 1, 4, 0, 2, 2], jnp.int32)
    offset = jnp.int32(1 * SLOTS)
    expand = dataclasses.replace(SMALL_TILES, block_n=16, col_blocks=2)
    tiles = (SMALL_TILES, expand) if impl == "gpu" else None
    args = ([p[0] for p in pools], lora_bs, row_slot, [p[2] for p in pools], [p[3] for p in pools], offset)
    out = jax.jit(lambda y: pk.bgmv_lora_packed(y, widths, x, *args, impl=impl, tiles=tiles))(y)
    ys = jnp.split(y.astype(jnp.float32), np.cumsum(widths)[:-1].tolist(), axis=-1)
    f32 = [[a.astype(jnp.float32) for a in arg] if isinstance(arg, list) else arg for arg in args]
    f32[0] = [a.astype(jnp.float32) for a in args[0]]
    expected = jnp.concatenate(pk.bgmv_lora_grouped(ys, x.astype(jnp.float32), *f32, impl="reference"), axis=-1)
    assert out.shape == y.shape and out.dtype == y.dtype
    assert float(jnp.abs(expected - y.astype(jnp.float32)).max()) > 0.1
    assert rel_err(out.astype(jnp.float32) - y, expected - y) <= TOL[dtype]
    untouched = np.asarray(row_slot < 0)
    np.testing.assert_array_equal(np.asarray(out)[untouched], np.asarray(y)[untouched])
