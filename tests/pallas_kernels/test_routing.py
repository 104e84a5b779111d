"""Row-tile -> segment routing tables against a brute-force numpy construction."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.routing import make_routing, row_segments


def _random_starts(rng, num_rows, num_segments):
    end = num_rows - int(rng.integers(0, 5))  # some trailing padding rows
    cuts = np.sort(rng.integers(0, end + 1, num_segments))  # repeats: empty segments
    return np.concatenate([[0], cuts]).astype(np.int32)


def _overlapping(starts, tile, block_rows):
    lo, hi = tile * block_rows, (tile + 1) * block_rows
    return [
        s for s in range(len(starts) - 1)
        if starts[s] < hi and starts[s + 1] > lo and starts[s + 1] > starts[s]
    ]


@pytest.mark.parametrize("seed", range(4))
def test_routing_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    block_rows, num_rows, num_segments = 8, 64, int(rng.integers(1, 20))
    starts = _random_starts(rng, num_rows, num_segments)
    routing = make_routing(jnp.asarray(starts), num_rows, block_rows)
    lo, hi = np.asarray(routing.tile_seg_lo), np.asarray(routing.tile_seg_hi)
    work_tile, work_seg = np.asarray(routing.work_tile), np.asarray(routing.work_seg)
    assert work_tile.shape == (num_rows // block_rows + num_segments,)
    assert np.all(np.diff(work_tile) >= 0)  # a tile's items are consecutive
    assert set(work_tile) == set(range(num_rows // block_rows))  # every tile visited
    for tile in range(num_rows // block_rows):
        nonempty = [s for s in range(lo[tile], hi[tile]) if starts[s + 1] > starts[s]]
        assert nonempty == _overlapping(starts, tile, block_rows)
        listed = [s for s in work_seg[work_tile == tile] if s >= 0]
        assert listed == list(range(lo[tile], hi[tile]))
    out_seg = np.asarray(routing.work_out_seg)
    assert np.all(np.diff(out_seg) >= 0)
    assert np.all(out_seg[work_seg >= 0] == work_seg[work_seg >= 0])


def test_row_segments_skip_empty_and_padding():
    starts = jnp.array([0, 3, 3, 7, 7], jnp.int32)
    seg, valid = row_segments(starts, 9)
    np.testing.assert_array_equal(np.asarray(seg)[:7], [0, 0, 0, 2, 2, 2, 2])
    np.testing.assert_array_equal(np.asarray(valid), [True] * 7 + [False] * 2)
