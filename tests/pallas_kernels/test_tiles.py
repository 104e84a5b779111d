"""Tile-config lookup (table, heuristic fallback) and tile fitting/padding."""

import jax.numpy as jnp
import pytest

from pallas_kernels.tile_fit import fit_shrink_smem, fit_tiles, pad_to, shrink_smem_bytes
from pallas_kernels.tiles import TileConfig, get_tile_config, heuristic_tiles, load_table
from pallas_kernels.tiles import shape_bucket, smem_limit

TABLE = {"NVIDIA H200": {"sgmv_shrink": {shape_bucket(4096, 4096, 16): {"block_rows": 128,
                                                                       "k_splits": 8}}}}


def test_repo_table_loads():
    assert isinstance(load_table(), dict)


@pytest.mark.parametrize("style", ("gpu", "tpu"))
def test_unknown_device_gets_heuristic(style):
    cfg = get_tile_config("Imaginary GPU 9000", "sgmv_shrink", 4096, 4096, 16, style, TABLE)
    assert cfg == heuristic_tiles("sgmv_shrink", 4096, 4096, 16, style)


def test_table_entry_overrides_heuristic():
    cfg = get_tile_config("NVIDIA H200", "sgmv_shrink", 3000, 4096, 16, "gpu", TABLE)
    base = heuristic_tiles("sgmv_shrink", 3000, 4096, 16, "gpu")
    assert (cfg.block_rows, cfg.k_splits) == (128, 8)
    assert cfg.block_k == base.block_k  # fields missing from the entry come from the heuristic
    other_bucket = get_tile_config("NVIDIA H200", "sgmv_shrink", 64, 4096, 16, "gpu", TABLE)
    assert other_bucket == heuristic_tiles("sgmv_shrink", 64, 4096, 16, "gpu")


def test_unknown_op_rejected():
    with pytest.raises(ValueError, match="op"):
        heuristic_tiles("gemm", 1, 1, 1, "gpu")


def test_gpu_fit_is_power_of_two_and_divides():
    cfg = fit_tiles(TileConfig(64, 256, 128, 16, 64), "gpu", 576, 576, 1536, 8)
    assert (cfg.block_rows, cfg.block_k, cfg.block_n, cfg.rank_chunk) == (64, 64, 128, 16)
    assert cfg.k_splits == 9  # at most one k block per split
    odd = fit_tiles(TileConfig(64, 256, 128, 16, 1), "gpu", 50, 40, 100, 64)
    assert (odd.block_rows, odd.block_k, odd.block_n) == (64, 64, 128)


def test_tpu_fit_uses_full_dims():
    cfg = fit_tiles(TileConfig(128, 512, 512, 128), "tpu", 50, 576, 64, 64)
    assert (cfg.block_rows, cfg.block_k, cfg.block_n, cfg.rank_chunk) == (56, 512, 64, 64)


def test_pad_to_is_noop_when_aligned():
    array = jnp.ones((32, 48))
    assert pad_to(array, (16, 16)) is array
    assert pad_to(array, (None, 32)).shape == (32, 64)


def test_missing_bucket_takes_nearest_row_bucket():
    table = {"NVIDIA H200": {"bgmv_shrink": {
        shape_bucket(16, 4096, 16): {"k_splits": 4, "us": 3.0},
        shape_bucket(64, 4096, 16): {"k_splits": 16, "us": 5.0},
    }}}
    near = lambda rows: get_tile_config("NVIDIA H200", "bgmv_shrink", rows, 4096, 16, "gpu",
                                        table).k_splits
    assert near(16) == 4 and near(64) == 16  # exact buckets
    assert near(8) == 4 and near(128) == 16  # one octave away
    assert near(32) == 16  # a tie between 16 and 64 takes the larger rows
    far = get_tile_config("NVIDIA H200", "bgmv_shrink", 1024, 4096, 16, "gpu", table)
    assert far == heuristic_tiles("bgmv_shrink", 1024, 4096, 16, "gpu")  # 4 octaves: heuristic
    other_shape = get_tile_config("NVIDIA H200", "bgmv_shrink", 16, 2048, 16, "gpu", table)
    assert other_shape == heuristic_tiles("bgmv_shrink", 16, 2048, 16, "gpu")
    unknown = get_tile_config("Some Future GPU", "bgmv_shrink", 16, 4096, 16, "gpu", table)
    assert unknown == heuristic_tiles("bgmv_shrink", 16, 4096, 16, "gpu")


def test_shrink_fits_shared_memory():
    """The heuristic shrink for the GPU gradient test's f32 shapes (k=1536, r=64) asked Triton
    for 384 KiB of shared memory on an H100; the guard trims stages, then k blocks."""
    limit = smem_limit("NVIDIA H100 80GB HBM3")
    cfg = fit_tiles(heuristic_tiles("sgmv_shrink", 300, 1536, 64, "gpu"), "gpu", 300, 1536, 64,
                    64)
    assert shrink_smem_bytes(cfg, 64, 4) > limit
    fitted = fit_shrink_smem(cfg, 64, 4, limit)
    assert shrink_smem_bytes(fitted, 64, 4) <= limit and 1536 % fitted.block_k == 0
    tuned_bf16 = TileConfig(64, 256, 16, 64, 2, 4, 3)  # the H100 table's r=64 winner
    assert fit_shrink_smem(tuned_bf16, 64, 2, limit) == tuned_bf16
    assert smem_limit("Imaginary GPU 9000") < limit
