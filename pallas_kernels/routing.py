"""Row-tile -> segment routing tables for the segmented (SGMV) kernels.

Built once per batch from `seg_starts` (pure jnp, traced: no recompilation when the values
change) and shared by every kernel call that uses the same row tile size.

Two views of the same information:

- GPU (Triton) kernels run one program per row tile, and each program loops over the segments
  that overlap its tile: `tile_seg_lo[t] <= seg < tile_seg_hi[t]`. A tile that straddles a segment
  boundary is handled by masking rows (no relayout of `x`).
- TPU (Mosaic) kernels run a sequential grid over a flat *work list* of (tile, segment) pairs,
  megablox style: `work_tile[w]`, `work_seg[w]` (-1: nothing to compute). The pairs of one tile
  are consecutive, so an output tile stays resident in VMEM while it is revisited. Every tile is
  visited at least once (a tile that no segment overlaps gets one item with segment -1), so
  every output tile is written. Length `num_tiles + S` is a static upper bound; the unused tail
  repeats the last tile with segment -1.
- `work_out_seg[w]` is the segment whose per-segment output the item accumulates into (for the
  segmented transposed product); items with segment -1 reuse the previous segment, so the
  visits of one segment stay consecutive.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class TileRouting(NamedTuple):
    """Routing tables for a row tile of `num_rows // num_tiles` rows (all int32).

    tile_seg_lo, tile_seg_hi: [num_tiles]; work_tile, work_seg, work_out_seg: [num_tiles + S].
    """

    tile_seg_lo: jax.Array
    tile_seg_hi: jax.Array
    work_tile: jax.Array
    work_seg: jax.Array
    work_out_seg: jax.Array

    @property
    def num_tiles(self) -> int:
        return self.tile_seg_lo.shape[0]


def tile_segment_ranges(seg_starts: jax.Array, num_rows: int, block_rows: int):
    """Segments overlapping each row tile: ([num_tiles] lo, [num_tiles] hi), lo <= seg < hi.

    `num_rows` must be a multiple of `block_rows`; `seg_starts` [S+1] must be non-decreasing.
    Empty segments strictly inside a tile may be included (kernels skip them).
    """
    assert num_rows % block_rows == 0, (num_rows, block_rows)
    num_tiles = num_rows // block_rows
    tile_begin = jnp.arange(num_tiles, dtype=jnp.int32) * block_rows
    seg_starts = seg_starts.astype(jnp.int32)
    # compare_all: one small fusion; the default "scan" method is a while loop, which costs a
    # device->host round trip per iteration on GPU.
    lo = jnp.searchsorted(seg_starts[1:], tile_begin, side="right", method="compare_all")
    hi = jnp.searchsorted(seg_starts[:-1], tile_begin + block_rows, side="left",
                          method="compare_all")
    lo = lo.astype(jnp.int32)
    return lo, jnp.maximum(hi.astype(jnp.int32), lo)


def _work_list(lo: jax.Array, hi: jax.Array, num_segments: int):
    """Flatten per-tile segment ranges into (work_tile, work_seg), length num_tiles + S."""
    num_tiles = lo.shape[0]
    num_items = num_tiles + num_segments
    counts = jnp.maximum(hi - lo, 1)
    ends = jnp.cumsum(counts)
    item = jnp.arange(num_items, dtype=jnp.int32)
    tile = jnp.minimum(jnp.searchsorted(ends, item, side="right", method="compare_all"), num_tiles - 1)
    tile = tile.astype(jnp.int32)
    seg = lo[tile] + item - (ends[tile] - counts[tile])
    valid = (item < ends[-1]) & (seg < hi[tile])
    return tile, jnp.where(valid, seg, -1).astype(jnp.int32)


def make_routing(seg_starts: jax.Array, num_rows: int, block_rows: int) -> TileRouting:
    """Build the routing tables for `num_rows` rows (a multiple of `block_rows`).

    seg_starts: int32 [S+1]. Returns a TileRouting (see the module docstring).
    """
    lo, hi = tile_segment_ranges(seg_starts, num_rows, block_rows)
    work_tile, work_seg = _work_list(lo, hi, seg_starts.shape[0] - 1)
    work_out_seg = jax.lax.cummax(jnp.maximum(work_seg, 0), axis=0)
    return TileRouting(lo, hi, work_tile, work_seg, work_out_seg)


def row_segments(seg_starts: jax.Array, num_rows: int):
    """Segment of each row: ([num_rows] int32 seg id clipped to [0, S), [num_rows] bool valid).

    Rows before seg_starts[0] or at/after seg_starts[S] are not valid (padding).
    """
    num_segments = seg_starts.shape[0] - 1
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    seg = jnp.searchsorted(seg_starts.astype(jnp.int32), rows, side="right") - 1
    valid = (seg >= 0) & (seg < num_segments)
    return jnp.clip(seg, 0, num_segments - 1).astype(jnp.int32), valid
