"""Shared pieces of the fused LoRA training kernels: dropout hash, tile layout, block config.

Dropout. The mask is a counter-based hash of (seed, row, column) (murmur3 `fmix32` in int32
arithmetic, which wraps identically in XLA, Triton and Mosaic), so the forward and the backward
kernels regenerate the same mask and no mask tensor is stored. `row` is the row index in the
caller's (unpadded) x and `column` the index along k, so the mask does not depend on the tile
sizes or on the padded layout, and the pure-jnp reference reproduces it exactly. An element is
kept when `hash >> 8` (24 uniform bits) >= `floor(p * 2**24)`; kept values are scaled by
1 / (1 - p). Use a different seed per layer and per step.

Tile layout (FusedMultiLoRA). The kernels route LoRA work per row tile (LoRAFusion's "Mtile"
lookup table): every row tile belongs to exactly one adapter slot, so a tile must not straddle
two segments. `build_tile_layout` lays the grouped rows out so that this holds:

- the caller's segments are extended with two base-only (slot -1) segments for the rows before
  `seg_starts[0]` and from `seg_starts[S]` on, giving S + 2 segments that cover [0, m);
- each segment starts on a fresh row tile and is padded with zero rows up to a multiple of
  `block_m` (so segment e occupies tiles [seg_tile_lo[e], seg_tile_hi[e]));
- `row_src[p]` is the caller's row placed at padded row p (-1: padding row, x = 0 there) and
  `row_dst[i]` the padded row of the caller's row i: `x_p = x[row_src]`, `y = y_p[row_dst]`;
- the number of tiles is static: `(m + (S + 2) * (block_m - 1)) // block_m` bounds
  sum(ceil(len_e / block_m)); tiles past the used ones are dead (`tile_live == 0`) and the
  kernels skip them (their outputs are never read).

Padding costs at most (S + 2) * (block_m - 1) rows of base GEMM work, and the gather/scatter of
x/y (and dY/dX in the backward) is one extra copy of each. A caller whose batch plan is already
tile-aligned (e.g. a single adapter: `identity_tile_layout`) skips the copy.

Block-aligned layout (`build_block_layout`, for the Mosaic GPU GEMMs, whose TMA loads need row
offsets on the block grid): the tiles are the non-empty intersections of the S + 2 segments with
the aligned row blocks [b * block_m, (b + 1) * block_m) (as in JAX's ragged_dot_mgpu), so tile t
starts at the aligned caller row tile_row0[t], its rows are tile_row0 + tile_skip .. tile_row0 +
tile_nrows - 1, and the `tile_skip` leading rows belong to the previous segment (read as zero and
never written by the kernels). A block holding a segment boundary is computed once per segment:
at most S + 1 extra row blocks of base GEMM work, and no row copies.

The per-tile table holds, for tile t: slot, rank, scale, the dropout threshold and 1 / (1 - p)
of its adapter, the caller row of its first row (`tile_row0`, for the hash), whether it is live,
and its segment. It is built once per microbatch (pure jnp, traced: no recompilation when the
values change) and can be passed to every layer's call.
"""

import dataclasses
import functools
import json
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

_F32 = jnp.float32
_I32 = jnp.int32


def _signed(c: int) -> int:
    return c - (1 << 32) if c >= (1 << 31) else c


_SEED_MUL = _signed(0x9E3779B1)
_ROW_MUL = _signed(0x85EBCA77)
_COL_MUL = _signed(0xC2B2AE3D)
_FMIX1 = _signed(0x85EBCA6B)
_FMIX2 = _signed(0xC2B2AE35)
DROPOUT_BITS = 24
MAX_DROPOUT = 1.0 - 2.0 ** -20


def _srl(h, amount: int):
    return lax.shift_right_logical(h, jnp.full_like(h, amount))


def _fmix32(h):
    h = h ^ _srl(h, 16)
    h = h * _FMIX1
    h = h ^ _srl(h, 13)
    h = h * _FMIX2
    return h ^ _srl(h, 16)


def dropout_bits(seed, rows, cols):
    """24 uniform bits (int32 in [0, 2**24)) per (seed, row, col); rows/cols int32, broadcast.

    Usable inside Pallas kernels (Triton and Mosaic) and in plain jnp.
    """
    row_key = _fmix32(seed * _SEED_MUL + rows * _ROW_MUL)
    h = _fmix32(row_key ^ (cols * _COL_MUL))
    return _srl(h, 32 - DROPOUT_BITS)


def dropout_keep(seed, rows, cols, threshold):
    """Keep mask: dropout_bits(seed, rows, cols) >= threshold (see `dropout_threshold`)."""
    return dropout_bits(seed, rows, cols) >= threshold


def dropout_threshold(p):
    """int32 threshold floor(p * 2**24) of a dropout probability (p clipped to [0, 1))."""
    p = jnp.clip(jnp.asarray(p, _F32), 0.0, MAX_DROPOUT)
    return jnp.floor(p * float(1 << DROPOUT_BITS)).astype(_I32)


def dropout_inv_keep(p):
    """1 / (1 - p) (float32), p clipped like `dropout_threshold`."""
    p = jnp.clip(jnp.asarray(p, _F32), 0.0, MAX_DROPOUT)
    return 1.0 / (1.0 - p)


def dropout_mask(seed, num_rows: int, num_cols: int, p, row_offset=0):
    """[num_rows, num_cols] keep mask for rows row_offset.. (scalar or per-row p [num_rows])."""
    rows = (row_offset + jnp.arange(num_rows, dtype=_I32))[:, None]
    cols = jnp.arange(num_cols, dtype=_I32)[None, :]
    threshold = dropout_threshold(p)
    if threshold.ndim == 1:
        threshold = threshold[:, None]
    return dropout_keep(jnp.asarray(seed, _I32), rows, cols, threshold)


class TileLayout(NamedTuple):
    """Padded row layout + per-row-tile lookup table (see the module docstring). All int32
    except tile_scale / tile_inv_keep (float32). T = num tiles, E = S + 2 segments.

    row_src [T*block_m], row_dst [m];
    tile_slot, tile_rank, tile_scale, tile_threshold, tile_inv_keep, tile_row0, tile_live,
    tile_seg [T]; seg_slot, seg_tile_lo, seg_tile_hi [E]; tile_nrows [T] (the tile's caller
    rows end at tile_row0 + tile_nrows - 1; 0 for dead tiles); tile_skip [T] (its rows start at
    tile_row0 + tile_skip; 0 except in `build_block_layout`). The GPU kernels read x / dY and
    write y / dX in the caller's row order through (tile_row0, tile_skip, tile_nrows), so they
    need no gathered copy; row_src / row_dst serve the TPU kernels.
    """

    row_src: jax.Array
    row_dst: jax.Array
    tile_slot: jax.Array
    tile_rank: jax.Array
    tile_scale: jax.Array
    tile_threshold: jax.Array
    tile_inv_keep: jax.Array
    tile_row0: jax.Array
    tile_live: jax.Array
    tile_seg: jax.Array
    seg_slot: jax.Array
    seg_tile_lo: jax.Array
    seg_tile_hi: jax.Array
    tile_nrows: jax.Array
    tile_skip: jax.Array

    @property
    def num_tiles(self) -> int:
        return self.tile_slot.shape[0]

    @property
    def block_m(self) -> int:
        return self.row_src.shape[0] // self.tile_slot.shape[0]

    @property
    def num_rows(self) -> int:
        return self.row_dst.shape[0]

    @property
    def tile_active(self):
        """Tiles that run LoRA work: live, slot >= 0 and rank > 0."""
        return (self.tile_live > 0) & (self.tile_slot >= 0) & (self.tile_rank > 0)

    @property
    def seg_active(self):
        """Segments with LoRA work: slot >= 0, at least one tile, and rank > 0."""
        has_tiles = self.seg_tile_hi > self.seg_tile_lo
        first = jnp.clip(self.seg_tile_lo, 0, self.num_tiles - 1)
        return has_tiles & (self.seg_slot >= 0) & (self.tile_rank[first] > 0)


def max_tiles(num_rows: int, num_segments: int, block_m: int) -> int:
    """Static bound on the tiles of `build_tile_layout` (S segments + 2 base-only ones)."""
    return max(1, (num_rows + (num_segments + 2) * (block_m - 1)) // block_m)


def _tile_table(slot, live, slot_rank, slot_scale, slot_dropout):
    num_slots = slot_rank.shape[0]
    active = (slot >= 0) & live
    safe = jnp.clip(slot, 0, num_slots - 1)
    rank = jnp.where(active, slot_rank.astype(_I32)[safe], 0)
    scale = jnp.where(active, slot_scale.astype(_F32)[safe], 0.0)
    p = jnp.where(active, slot_dropout.astype(_F32)[safe], 0.0)
    return (jnp.where(active, slot, -1).astype(_I32), rank, scale, dropout_threshold(p),
            dropout_inv_keep(p))


def build_tile_layout(seg_starts, seg_slot, slot_rank, slot_scale, slot_dropout, num_rows: int,
                      block_m: int) -> TileLayout:
    """Pad the grouped segments to whole row tiles and build the per-tile lookup table.

    seg_starts int32 [S+1] (non-decreasing; clipped to [0, num_rows]), seg_slot int32 [S]
    (-1: base model only), slot_rank int32 [P], slot_scale / slot_dropout float [P].
    """
    num_segments = seg_slot.shape[0]
    m, bm = num_rows, block_m
    starts = lax.cummax(jnp.clip(seg_starts.astype(_I32), 0, m), axis=0)
    ext_starts = jnp.concatenate([jnp.zeros((1,), _I32), starts, jnp.full((1,), m, _I32)])
    ext_slot = jnp.concatenate([jnp.full((1,), -1, _I32), seg_slot.astype(_I32),
                                jnp.full((1,), -1, _I32)])
    num_ext = num_segments + 2
    lengths = ext_starts[1:] - ext_starts[:-1]
    seg_tiles = (lengths + bm - 1) // bm
    seg_tile_hi = jnp.cumsum(seg_tiles).astype(_I32)
    seg_tile_lo = seg_tile_hi - seg_tiles

    num_tiles = max_tiles(m, num_segments, bm)
    tiles = jnp.arange(num_tiles, dtype=_I32)
    tile_seg = jnp.minimum(jnp.searchsorted(seg_tile_hi, tiles, side="right"), num_ext - 1)
    tile_seg = tile_seg.astype(_I32)
    live = tiles < seg_tile_hi[-1]
    tile_row0 = ext_starts[tile_seg] + (tiles - seg_tile_lo[tile_seg]) * bm
    tile_rows = jnp.where(live, jnp.minimum(bm, ext_starts[tile_seg + 1] - tile_row0), 0)
    slot, rank, scale, threshold, inv_keep = _tile_table(ext_slot[tile_seg], live, slot_rank,
                                                         slot_scale, slot_dropout)

    offs = jnp.arange(bm, dtype=_I32)
    row_src = jnp.where(offs[None, :] < tile_rows[:, None], tile_row0[:, None] + offs[None, :], -1)
    rows = jnp.arange(m, dtype=_I32)
    row_seg = (jnp.searchsorted(ext_starts[1:], rows, side="right")).astype(_I32)
    row_seg = jnp.minimum(row_seg, num_ext - 1)
    row_dst = seg_tile_lo[row_seg] * bm + rows - ext_starts[row_seg]
    return TileLayout(
        row_src=row_src.reshape(-1).astype(_I32), row_dst=row_dst.astype(_I32),
        tile_slot=slot, tile_rank=rank, tile_scale=scale, tile_threshold=threshold,
        tile_inv_keep=inv_keep, tile_row0=tile_row0.astype(_I32),
        tile_live=live.astype(_I32), tile_seg=tile_seg, seg_slot=ext_slot,
        seg_tile_lo=seg_tile_lo, seg_tile_hi=seg_tile_hi, tile_nrows=tile_rows.astype(_I32),
        tile_skip=jnp.zeros((num_tiles,), _I32))


def max_block_tiles(num_rows: int, num_segments: int, block_m: int) -> int:
    """Static bound on the tiles of `build_block_layout`: the row blocks plus one per segment
    boundary inside a block (S + 1 of them)."""
    return -(-num_rows // block_m) + num_segments + 1


def _extended_segments(seg_starts, seg_slot, num_rows: int):
    """(starts [S+3], slots [S+2]): the segments plus base-only ones before and after them."""
    starts = lax.cummax(jnp.clip(seg_starts.astype(_I32), 0, num_rows), axis=0)
    ext_starts = jnp.concatenate([jnp.zeros((1,), _I32), starts,
                                  jnp.full((1,), num_rows, _I32)])
    ext_slot = jnp.concatenate([jnp.full((1,), -1, _I32), seg_slot.astype(_I32),
                                jnp.full((1,), -1, _I32)])
    return ext_starts, ext_slot


def build_block_layout(seg_starts, seg_slot, slot_rank, slot_scale, slot_dropout,
                       num_rows: int, block_m: int) -> TileLayout:
    """The block-aligned layout (see the module docstring): tiles = non-empty (segment, aligned
    row block) pairs, in segment order. Arguments as in `build_tile_layout`."""
    m, bm = num_rows, block_m
    ext_starts, ext_slot = _extended_segments(seg_starts, seg_slot, m)
    num_ext = ext_slot.shape[0]
    lo, hi = ext_starts[:-1], ext_starts[1:]
    first_block, end_block = lo // bm, (hi + bm - 1) // bm
    seg_tiles = jnp.where(hi > lo, end_block - first_block, 0)
    seg_tile_hi = jnp.cumsum(seg_tiles).astype(_I32)
    seg_tile_lo = seg_tile_hi - seg_tiles

    num_tiles = max_block_tiles(m, seg_slot.shape[0], bm)
    tiles = jnp.arange(num_tiles, dtype=_I32)
    tile_seg = jnp.minimum(jnp.searchsorted(seg_tile_hi, tiles, side="right"), num_ext - 1)
    tile_seg = tile_seg.astype(_I32)
    live = tiles < seg_tile_hi[-1]
    block = first_block[tile_seg] + tiles - seg_tile_lo[tile_seg]
    tile_row0 = jnp.where(live, block * bm, 0)
    skip = jnp.where(live, jnp.maximum(lo[tile_seg] - tile_row0, 0), 0)
    nrows = jnp.where(live, jnp.minimum(hi[tile_seg] - tile_row0, bm), 0)
    slot, rank, scale, threshold, inv_keep = _tile_table(ext_slot[tile_seg], live, slot_rank,
                                                         slot_scale, slot_dropout)

    offs = jnp.arange(bm, dtype=_I32)[None, :]
    own = (offs >= skip[:, None]) & (offs < nrows[:, None])
    row_src = jnp.where(own, tile_row0[:, None] + offs, -1)
    rows = jnp.arange(m, dtype=_I32)
    row_seg = jnp.minimum(jnp.searchsorted(hi, rows, side="right"), num_ext - 1).astype(_I32)
    row_tile = seg_tile_lo[row_seg] + rows // bm - first_block[row_seg]
    return TileLayout(
        row_src=row_src.reshape(-1).astype(_I32), row_dst=(row_tile * bm + rows % bm).astype(_I32),
        tile_slot=slot, tile_rank=rank, tile_scale=scale, tile_threshold=threshold,
        tile_inv_keep=inv_keep, tile_row0=tile_row0.astype(_I32), tile_live=live.astype(_I32),
        tile_seg=tile_seg, seg_slot=ext_slot, seg_tile_lo=seg_tile_lo, seg_tile_hi=seg_tile_hi,
        tile_nrows=nrows.astype(_I32), tile_skip=skip.astype(_I32))


def identity_tile_layout(num_rows: int, block_m: int, slot_rank, slot_scale, slot_dropout,
                         slot: int = 0) -> TileLayout:
    """Layout of a batch whose rows all use `slot` (single adapter): rows stay in place, only
    padded at the end to whole tiles (x_p = pad(x), y = y_p[:m]; no gather)."""
    num_tiles = max(1, -(-num_rows // block_m))
    tiles = jnp.arange(num_tiles, dtype=_I32)
    live = jnp.ones((num_tiles,), bool)
    t_slot, rank, scale, threshold, inv_keep = _tile_table(
        jnp.full((num_tiles,), slot, _I32), live, slot_rank, slot_scale, slot_dropout)
    padded = jnp.arange(num_tiles * block_m, dtype=_I32)
    zero, one = jnp.zeros((1,), _I32), jnp.full((1,), num_tiles, _I32)
    return TileLayout(
        row_src=jnp.where(padded < num_rows, padded, -1), row_dst=padded[:num_rows],
        tile_slot=t_slot, tile_rank=rank, tile_scale=scale, tile_threshold=threshold,
        tile_inv_keep=inv_keep, tile_row0=tiles * block_m, tile_live=live.astype(_I32),
        tile_seg=jnp.zeros((num_tiles,), _I32), seg_slot=jnp.full((1,), slot, _I32),
        seg_tile_lo=zero, seg_tile_hi=one,
        tile_nrows=jnp.minimum(block_m, num_rows - tiles * block_m).astype(_I32),
        tile_skip=jnp.zeros((num_tiles,), _I32))


def gather_rows(x, row_src):
    """x_p[p] = x[row_src[p]] (zero where row_src < 0)."""
    safe = jnp.maximum(row_src, 0)
    return jnp.where((row_src >= 0)[:, None], x[safe], jnp.zeros((), x.dtype))


@dataclasses.dataclass(frozen=True)
class FusedLoRAConfig:
    """Block sizes and Triton launch parameters of the fused kernels.

    block_m: row tile (the layout granularity). block_k: tile along k (x columns / W rows).
    block_n: tile along n. The rank axis is one block (r_max padded to >= 16, a power of two).
    Dimensions are clamped to the problem and padded to whole blocks by the dispatcher.
    group_m: row blocks per group in the swizzled launch order of the two GEMM kernels (L2
    reuse). splits: programs per (segment, k block) in the dA kernel (each sums a share of the
    segment's tiles; the shares are added outside).

    GPU only: `shrink`, `base_expand`, `grad_s_b`, `grad_a`, `grad_x` override the blocks, warps
    and stages of one kernel each (None: this config's own). A kernel's block_m is clamped to
    the layout's and must divide it (powers of two do). `mosaic`: the blocks of the Mosaic GPU
    E and L kernels (block_m: row tile, a multiple of 64; block_k: contraction block, k for E
    and n for L; block_n: output columns per CTA, n for E and k for L; num_warps / 4: compute
    warpgroups splitting those columns; num_stages: TMA pipeline depth; group_m: column blocks
    per planar-snake band), None: `MOSAIC_DEFAULT`.
    """

    block_m: int = 64
    block_k: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 2
    group_m: int = 8
    splits: int = 4
    shrink: "FusedLoRAConfig | None" = None
    base_expand: "FusedLoRAConfig | None" = None
    grad_s_b: "FusedLoRAConfig | None" = None
    grad_a: "FusedLoRAConfig | None" = None
    grad_x: "FusedLoRAConfig | None" = None
    mosaic: "FusedLoRAConfig | None" = None

    def kernel(self, name: str) -> "FusedLoRAConfig":
        """The config of one GPU kernel ("shrink", "base_expand", ...)."""
        return getattr(self, name) or self

    def mosaic_kernels(self) -> "FusedLoRAConfig":
        """The blocks of the Mosaic GPU E / L kernels."""
        return self.mosaic or MOSAIC_DEFAULT


KERNELS = ("shrink", "base_expand", "grad_s_b", "grad_a", "grad_x")
# Mosaic GPU E / L, as JAX's Hopper matmul example: 128-row tiles, 64-deep TMA steps (128-byte
# swizzle rows of bf16), 256 output columns per CTA split between 2 compute warpgroups (a
# 128 x 128 f32 accumulator each), 3 stages (3 x 48 KB of SMEM; with the 64 KB output tile
# and the LoRA operands 4 stages exceed the 227 KB an SM has).
MOSAIC_DEFAULT = FusedLoRAConfig(block_m=128, block_k=64, block_n=256, num_warps=8,
                                 num_stages=3, group_m=8)


def default_config(style: str) -> FusedLoRAConfig:
    if style == "tpu":
        return FusedLoRAConfig(block_m=128, block_k=512, block_n=512)
    return gpu_config()


def gpu_config(device_kind: str | None = None) -> FusedLoRAConfig:
    """GPU per-kernel blocks: the measured table (`fused_lora_tiles.json`) for this device
    kind if it has one, else a heuristic for Hopper/Ampere-class GPUs."""
    table = _tile_table_json()
    if device_kind is None:
        try:
            device_kind = jax.devices()[0].device_kind
        except RuntimeError:
            device_kind = ""
    entry = table.get(device_kind) or table.get("default")
    if not isinstance(entry, dict):
        return FusedLoRAConfig()
    if entry is None:
        return FusedLoRAConfig()
    top = {key: value for key, value in entry.items()
           if key not in KERNELS + ("mosaic",) and not key.startswith("_")}
    kernels = {name: FusedLoRAConfig(**entry[name]) for name in KERNELS + ("mosaic",)
               if name in entry}
    return FusedLoRAConfig(**top, **kernels)


@functools.cache
def _tile_table_json() -> dict:
    path = os.path.join(os.path.dirname(__file__), "fused_lora_tiles.json")
    if not os.path.exists(path):
        return {}
    with open(path) as file:
        return json.load(file)


def next_pow2(value: int) -> int:
    return 1 << max(int(value) - 1, 0).bit_length()


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def fit_block(style: str, target: int, dim: int) -> int:
    """Legal block for a k / n dimension: GPU a power of two >= 16 (<= target, <= the power of
    two covering dim); TPU the whole dimension when it fits in target, else target rounded down
    to a multiple of 128 (lanes). The dimension is then zero-padded to a multiple of it."""
    if style == "tpu":
        return dim if dim <= target else max(128, target // 128 * 128)
    return max(16, min(next_pow2(target), next_pow2(dim)))


def pad_axis(array, axis: int, size: int):
    extra = size - array.shape[axis]
    if extra == 0:
        return array
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, extra)
    return jnp.pad(array, widths)
