"""Make a TileConfig legal for a shape and pad arrays to whole blocks.

GPU (Triton): every block is a power of two >= 16 (dot dims). A block that divides the
dimension is preferred, so bucketed shapes (T, k, n multiples of 16..256) need no padding.
TPU (Mosaic): a block covering the whole dimension is used as is; row blocks are multiples of
8. When a dimension is not a multiple of its block the array is zero-padded (a copy: for the
in-place expand this also means y is no longer updated in place, so bucket T and n).
"""

import dataclasses

import jax.numpy as jnp

from pallas_kernels.tiles import TileConfig, next_pow2

_GPU_MIN_BLOCK = 16
_TPU_ROW_MULTIPLE = 8


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _prev_pow2(value: int) -> int:
    return 1 << (max(int(value), 1).bit_length() - 1)


def _gpu_block(target: int, dim: int) -> int:
    """Largest power of two in [16, target] dividing dim, else the block to pad dim to."""
    top = max(_GPU_MIN_BLOCK, _prev_pow2(target))
    block = top
    while block >= _GPU_MIN_BLOCK:
        if dim % block == 0:
            return block
        block //= 2
    return max(_GPU_MIN_BLOCK, min(top, next_pow2(dim)))


def _tpu_block(target: int, dim: int, multiple: int = 1) -> int:
    if target >= dim:
        return round_up(dim, multiple)
    return max(multiple, target // multiple * multiple)


def fit_tiles(cfg: TileConfig, style: str, num_rows: int, in_dim: int, out_dim: int,
              rank_dim: int) -> TileConfig:
    """Legal blocks for rows x in_dim -> out_dim; rank_dim is the r_max axis (for rank_chunk).

    in_dim takes block_k, out_dim block_n (for shrink out_dim == rank_dim, for expand
    in_dim == rank_dim: that axis uses rank_chunk instead).
    """
    if style == "tpu":
        return dataclasses.replace(
            cfg,
            block_rows=_tpu_block(cfg.block_rows, num_rows, _TPU_ROW_MULTIPLE),
            block_k=_tpu_block(cfg.block_k, in_dim),
            block_n=_tpu_block(cfg.block_n, out_dim),
            rank_chunk=_tpu_block(cfg.rank_chunk, rank_dim),
            k_splits=1,
            col_blocks=1,
        )
    block_k = _gpu_block(cfg.block_k, in_dim)
    block_n = _gpu_block(cfg.block_n, out_dim)
    col_blocks = _prev_pow2(max(1, cfg.col_blocks))
    while col_blocks > 1 and (round_up(out_dim, block_n) // block_n) % col_blocks:
        col_blocks //= 2
    return dataclasses.replace(
        cfg,
        block_rows=_gpu_block(cfg.block_rows, num_rows),
        block_k=block_k,
        block_n=block_n,
        rank_chunk=_gpu_block(cfg.rank_chunk, rank_dim),
        k_splits=max(1, min(cfg.k_splits, -(-in_dim // block_k))),
        col_blocks=col_blocks,
    )


def pad_axis(array, axis: int, multiple: int):
    """Zero-pad `axis` up to a multiple of `multiple` (no copy when already aligned)."""
    extra = round_up(array.shape[axis], multiple) - array.shape[axis]
    if extra == 0:
        return array
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, extra)
    return jnp.pad(array, widths)


def pad_to(array, multiples):
    """Zero-pad every axis i up to a multiple of multiples[i] (None: leave the axis)."""
    for axis, multiple in enumerate(multiples):
        if multiple is not None:
            array = pad_axis(array, axis, multiple)
    return array


def shrink_smem_bytes(cfg: TileConfig, rank_pad: int, itemsize: int) -> int:
    """Shared memory of the GPU SGMV shrink: Triton keeps num_stages copies of the x block
    [block_rows, block_k] and the A block [block_k, rank_pad] (matches its own count)."""
    return cfg.num_stages * cfg.block_k * (cfg.block_rows + rank_pad) * itemsize


def fit_shrink_smem(cfg: TileConfig, rank_pad: int, itemsize: int, limit: int) -> TileConfig:
    """Fewer pipeline stages, then smaller k blocks (powers of two: still dividing k), until
    the shrink fits `limit` bytes of shared memory (f32 inputs need twice bf16's)."""
    while shrink_smem_bytes(cfg, rank_pad, itemsize) > limit and cfg.num_stages > 1:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    while shrink_smem_bytes(cfg, rank_pad, itemsize) > limit and cfg.block_k > _GPU_MIN_BLOCK:
        cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
    return cfg

