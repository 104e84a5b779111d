"""The fused decode BGMV (`bgmv_lora_fused`: shrink and expand of a row in one launch) against the
jnp reference over a stacked pool, GPU style in interpret mode: odd sizes (k, n not multiples of
the blocks: padded), mixed ranks (several rank chunks, rank 0), rows with slot -1 untouched, one
and three projections, several column groups per projection, float32 and bfloat16."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.dispatch import FUSED_TILES, fused_tiles
from tests.pallas_kernels.cases import TOL, rel_err

LAYERS, SLOTS, R_MAX = 2, 5, 32
# Small blocks so the interpreter runs several k blocks, rank chunks and column groups.
TILES = dataclasses.replace(FUSED_TILES, block_k=32, block_n=16, rank_chunk=16, col_blocks=2, num_warps=1)


def _pool(rng, k: int, n: int, dtype):
    """Stacked A [L*slots, k, r], B [L*slots, r, n], rank [L*slots] (mixed, some 0), scale."""
    entries = LAYERS * SLOTS
    a = jnp.asarray(rng.standard_normal((entries, k, R_MAX)) / np.sqrt(k), dtype)
    b = jnp.asarray(rng.standard_normal((entries, R_MAX, n)), dtype)
    rank = jnp.asarray(rng.choice([0, 8, 16, 17, 32], entries).astype(np.int32))
    scale = jnp.asarray(rng.uniform(0.5, 2.0, entries).astype(np.float32))
    return a, b, rank, scale


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("widths", [(40,), (70, 24, 24)])
def test_fused_bgmv_equals_the_reference(dtype, widths):
    rng = np.random.default_rng(len(widths) * 10 + (dtype == jnp.bfloat16))
    k, rows = 75, 9
    pools = [_pool(rng, k, n, dtype) for n in widths]
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    ys = [jnp.asarray(rng.standard_normal((rows, n)), jnp.float32) for n in widths]
    row_slot = jnp.asarray(rng.choice([-1, 0, 1, 2, 3, 4], rows).astype(np.int32)).at[2].set(-1)
    offset = jnp.int32(SLOTS)  # layer 1
    outs = pk.bgmv_lora_fused(ys, x, [p[0] for p in pools], [p[1] for p in pools], row_slot,
                              [p[2] for p in pools], [p[3] for p in pools], offset, impl="gpu", tiles=TILES)
    for y, out, (a, b, rank, scale) in zip(ys, outs, pools):
        expected = pk.bgmv_lora_stacked(y, x.astype(jnp.float32), a.astype(jnp.float32), b.astype(jnp.float32),
                                        row_slot, rank, scale, offset, impl="reference")
        assert out.shape == y.shape and float(jnp.abs(expected - y).max()) > 0.1
        assert rel_err(out - y, expected - y) <= TOL[dtype]
        untouched = np.asarray(row_slot < 0)
        np.testing.assert_array_equal(np.asarray(out)[untouched], np.asarray(y)[untouched])


def test_fused_tiles_fit_the_call():
    """Blocks shrink to the dimensions (>= 16), col_blocks halves until it divides every width."""
    cfg = fused_tiles(4096, [4096, 1024, 1024], 16)
    assert (cfg.block_k, cfg.block_n, cfg.col_blocks) == (512, 256, 4)
    cfg = fused_tiles(40, [24, 48], 8)
    assert (cfg.block_k, cfg.block_n, cfg.rank_chunk) == (64, 64, 16)
    assert fused_tiles(4096, [256 * 6], 16).col_blocks == 2
