"""Random SGMV batches for the kernel tests (fresh random values, never zeros)."""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.tiles import TileConfig

# Small tiles so that the tiny test shapes still span several row tiles, k blocks and rank
# chunks (interpret mode is slow; these keep the grids small but non-trivial).
SMALL_TILES = TileConfig(block_rows=16, block_k=16, block_n=32, rank_chunk=16, k_splits=2)
IMPLS = ("gpu", "tpu")
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def rel_err(actual, expected) -> float:
    """Relative norm error ||a - e|| / ||e|| in float32."""
    actual, expected = jnp.asarray(actual, jnp.float32), jnp.asarray(expected, jnp.float32)
    return float(jnp.linalg.norm(actual - expected) / jnp.linalg.norm(expected))


def segments(sizes, slots, ranks, scales=None):
    """(seg_starts [S+1], seg_slot [S], seg_rank [S], seg_scale [S]) from per-segment lists."""
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    if scales is None:
        scales = np.linspace(0.5, 2.0, len(sizes))
    return (
        jnp.asarray(starts),
        jnp.asarray(np.asarray(slots, np.int32)),
        jnp.asarray(np.asarray(ranks, np.int32)),
        jnp.asarray(np.asarray(scales, np.float32)),
    )


def arrays(seed, num_rows, k, n, r_max, num_slots, dtype):
    """(x [T, k], A [slots, k, r_max], B [slots, r_max, n], y [T, n]) random normal, scaled."""
    kx, ka, kb, ky = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(kx, (num_rows, k))
    lora_a = jax.random.normal(ka, (num_slots, k, r_max)) / np.sqrt(k)
    lora_b = jax.random.normal(kb, (num_slots, r_max, n)) / np.sqrt(r_max)
    y = jax.random.normal(ky, (num_rows, n))
    return tuple(a.astype(dtype) for a in (x, lora_a, lora_b, y))


# Mixed ranks 8..128 in one batch, an empty segment, a slot -1 segment, a slot used twice, a
# padded empty segment at the end, pool slot 5 used by no segment; T = 50 (not a multiple of 16) with 3 trailing padding rows.
MIXED = dict(
    sizes=[5, 0, 9, 13, 6, 7, 7, 0],
    slots=[1, 2, -1, 0, 3, 4, 1, -1],
    ranks=[8, 16, 32, 128, 64, 17, 8, 0],
    num_rows=50, k=48, n=64, r_max=128, num_slots=6,
)


def mixed_batch(dtype, seed=0):
    """The MIXED case: (x, A, B, y, seg_starts, seg_slot, seg_rank, seg_scale)."""
    c = MIXED
    x, lora_a, lora_b, y = arrays(seed, c["num_rows"], c["k"], c["n"], c["r_max"],
                                  c["num_slots"], dtype)
    return (x, lora_a, lora_b, y, *segments(c["sizes"], c["slots"], c["ranks"]))
