"""Shared memory of the Mosaic GPU E / L kernels (issue 37 item 1), on CPU.

On an H200 four GPU tests failed with "Mosaic GPU kernel exceeds available shared memory:
smem_bytes=245840 > max_smem_bytes=232448": the resolver had picked MOSAIC_DEFAULT (3 stages,
256 output columns) at the tests' padded rank 32. Here: the estimate (`fused_lora_mgpu.smem_bytes`)
equals Mosaic GPU's own count (read off its error when lowering for CUDA under an artificial
limit of 1 byte), including that figure; the device limit table; the resolver falling back to
blocks that fit; blocks forced on a kernel that do not fit: a ValueError before lowering.
"""

import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import fused_lora, fused_lora_mgpu
from pallas_kernels.fused_lora_layout import (MOSAIC_DEFAULT, FusedLoRAConfig, build_block_layout,
                                              gpu_config)
from pallas_kernels.tiles import (AOT_SMEM_PER_BLOCK, device_smem_limit, smem_limit)
from tests.pallas_kernels.test_fused_lora import meta

BF16 = jnp.bfloat16
SM90 = 232448  # 227 KiB: H100 / H200
ISSUE_37 = 245840  # what Mosaic GPU reported on the H200


def _cfg(bm, bk, bn, warps, stages):
    return FusedLoRAConfig(block_m=bm, block_k=bk, block_n=bn, num_warps=warps,
                           num_stages=stages, group_m=4)


def _kernel(kind, cfg, m, k, n, r, dtype=BF16):
    """(fn, arg specs) of E or L with blocks `cfg` (one adapter of rank r over rows 0..199)."""
    layout = build_block_layout(*meta([0, 200], [0], [r], [1.0], [0.0]), m, cfg.block_m)
    rows = layout.num_tiles * layout.block_m
    spec = lambda *shape, dtype=dtype: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    if kind == "E":
        return (lambda x, w, s, b: fused_lora_mgpu.base_expand_mgpu(x, w, s, b, layout, cfg,
                                                                     False),
                (spec(m, k), spec(k, n), spec(rows, r), spec(1, r, n)))
    return (lambda dy, w, ds, a, seed: fused_lora_mgpu.grad_x_mgpu(dy, w, ds, a, layout, seed, cfg,
                                                                  False),
            (spec(m, n), spec(k, n), spec(rows, r), spec(1, k, r), spec(1, dtype=jnp.int32)))


def _mosaic_count(monkeypatch, kind, cfg, m, k, n, r, dtype=BF16):
    """Mosaic GPU's own shared-memory figure for the kernel: lowered for CUDA (jax.export, on
    CPU) under an artificial limit of 1 byte, read off its "exceeds available shared memory"
    error (our own check switched off so that Mosaic GPU's is reached)."""
    core = pytest.importorskip("jax.experimental.mosaic.gpu.core")
    if not hasattr(core, "artificial_shared_memory_limit"):
        pytest.skip("this jax has no artificial_shared_memory_limit")
    monkeypatch.setattr(fused_lora_mgpu, "check_smem", lambda *args, **kwargs: None)
    fn, args = _kernel(kind, cfg, m, k, n, r, dtype)
    with core.artificial_shared_memory_limit(1), pytest.raises(ValueError) as error:
        jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
    found = re.search(r"smem_bytes=(\d+)", str(error.value))
    assert found, str(error.value)
    return int(found.group(1))


@pytest.mark.parametrize("kind, cfg, rank, shape", [
    ("E", MOSAIC_DEFAULT, 32, (256, 256, 512)),  # the failing tests' blocks and rank: 245,840
    ("L", MOSAIC_DEFAULT, 32, (256, 256, 512)),
    ("E", MOSAIC_DEFAULT, 16, (256, 512, 512)),  # rank 16: 229,456, fits
    ("L", _cfg(128, 64, 128, 8, 3), 128, (256, 512, 512)),  # 1 output slot per warpgroup
    ("E", _cfg(128, 64, 256, 8, 3), 16, (256, 128, 512)),  # 2 contraction steps < 3 stages
    ("E", _cfg(64, 32, 48, 4, 3), 16, (256, 256, 192)),  # buffers rounded up to 1024 bytes
])
def test_estimate_is_mosaic_gpus_own_count(monkeypatch, kind, cfg, rank, shape):
    m, k, n = shape
    contraction = k if kind == "E" else n
    estimate = fused_lora_mgpu.smem_bytes(cfg, rank, 2, contraction)
    assert estimate == _mosaic_count(monkeypatch, kind, cfg, m, k, n, rank)
    if cfg == MOSAIC_DEFAULT and rank == 32:
        assert estimate == fused_lora_mgpu.smem_bytes(cfg, rank) == ISSUE_37 > SM90


def test_the_failing_tests_config_is_refitted():
    """test_gpu_compiled_matches_reference[bfloat16] / test_gpu_mosaic_multi_adapter_bf16 /
    test_gpu_auto_backend[bfloat16]: x [301, 256], W [256, 384], 5 adapters of rank <= 32 (padded
    32), bf16, Mosaic GPU E / L. k and n pad to 256 / 512; the blocks before fitting were
    MOSAIC_DEFAULT's (the default entry, and the H200 entry's sweep winner has the same blocks):
    245,840 bytes. The resolver now drops a stage (196,672 bytes)."""
    for cfg in (FusedLoRAConfig(), gpu_config("NVIDIA H200"), gpu_config("NVIDIA H100 80GB HBM3")):
        unfitted = cfg.mosaic_kernels()
        assert (unfitted.block_m, unfitted.block_k, unfitted.block_n, unfitted.num_warps,
                unfitted.num_stages) == (128, 64, 256, 8, 3)
        assert fused_lora_mgpu.smem_bytes(unfitted, 32, 2, 256) == ISSUE_37
        plan = fused_lora._prepare("gpu", False, cfg, jnp.zeros((301, 256), BF16),
                                   jnp.zeros((256, 384), BF16), jnp.zeros((5, 256, 32), BF16),
                                   jnp.zeros((5, 32, 384), BF16), "mosaic")[0]
        assert (plan.block_k, plan.block_n) == (256, 256)
        assert plan.mosaic == dataclasses.replace(unfitted, num_stages=2)
        assert fused_lora_mgpu.smem_bytes(plan.mosaic, 32, 2, 512) == 196672 <= SM90


def test_device_limit_table():
    def gpu(capability, kind="", **attributes):
        return types.SimpleNamespace(platform="gpu", compute_capability=capability,
                                     device_kind=kind, **attributes)

    assert device_smem_limit(gpu("9.0")) == SM90 == fused_lora_mgpu.MAX_SMEM_BYTES
    assert device_smem_limit(gpu("10.0")) == SM90
    assert device_smem_limit(gpu("8.0")) == 166912
    assert device_smem_limit(gpu("8.9")) == device_smem_limit(gpu("12.0")) == 101376
    assert device_smem_limit(gpu("8.8")) == 166912  # unlisted: the nearest below, same major
    assert device_smem_limit(gpu("9.0", shared_memory_per_block_optin=100000)) == 100000
    assert device_smem_limit(gpu("", kind="NVIDIA H200")) == smem_limit("NVIDIA H200") == SM90
    cpu = types.SimpleNamespace(platform="cpu", device_kind="cpu")
    assert device_smem_limit(cpu) == AOT_SMEM_PER_BLOCK == SM90  # Mosaic GPU's AOT assumption
    device = jax.local_devices()[0]
    if device.platform == "cpu":  # Mosaic GPU's assumption when lowering for CUDA off a GPU
        assert fused_lora_mgpu.smem_limit() == SM90
    elif getattr(device, "shared_memory_per_block_optin", None):
        assert fused_lora_mgpu.smem_limit() == device.shared_memory_per_block_optin


def test_resolver_never_picks_blocks_that_do_not_fit():
    """For sm_90's 227 KiB at ranks 16 .. 256 and a 99 KiB limit at ranks 16 .. 64 (where
    128-row tiles can fit at all): the resolved blocks fit
    (fewer stages first, then narrower column blocks, then one compute warpgroup); where nothing
    fits the resolver raises instead of returning blocks that cannot launch."""
    assert fused_lora.mosaic_blocks(FusedLoRAConfig(), 4096, 4096, rank=16) == MOSAIC_DEFAULT
    assert fused_lora.mosaic_blocks(FusedLoRAConfig(), 4096, 4096, rank=32).num_stages == 2
    for limit, ranks in ((SM90, (16, 32, 64, 128, 256)), (101376, (16, 32, 64))):
        for rank in ranks:
            fitted = fused_lora.mosaic_blocks(FusedLoRAConfig(), 4096, 4096, rank=rank,
                                              limit=limit)
            assert fused_lora_mgpu.smem_bytes(fitted, rank, 2, 4096) <= limit, (limit, rank)
            assert fitted.block_m == 128 and fitted.block_k == 64 and fitted.num_stages >= 2
    at_256 = fused_lora.mosaic_blocks(FusedLoRAConfig(), 4096, 4096, rank=256)
    assert (at_256.num_warps, at_256.block_n) == (4, 128)  # 2 warpgroups: 2 copies of S
    with pytest.raises(ValueError, match=r"need \d+ bytes of shared memory .* > 65536 bytes"):
        fused_lora.mosaic_blocks(FusedLoRAConfig(), 4096, 4096, rank=256, limit=65536)


def test_tile_table_mosaic_entries_fit():
    """Every GPU kind's Mosaic GPU blocks in fused_lora_tiles.json fit its shared memory at the
    smallest padded rank (16), unfitted (the resolver refits larger ranks)."""
    for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "default"):
        blocks = gpu_config(kind).mosaic_kernels()
        limit = smem_limit(kind) if kind != "default" else SM90
        assert fused_lora_mgpu.smem_bytes(blocks, 16) <= limit, kind


@pytest.mark.parametrize("kind", ["E", "L"])
def test_forced_blocks_that_do_not_fit_raise(kind):
    """MOSAIC_DEFAULT forced on a kernel at rank 32: ValueError before lowering, with the bytes,
    the limit and the blocks that would fit."""
    fn, args = _kernel(kind, MOSAIC_DEFAULT, 256, 256, 512, 32)
    with pytest.raises(ValueError) as error:
        jax.jit(fn).lower(*args)
    message = str(error.value)
    assert f"need {ISSUE_37} bytes of shared memory" in message and f"> {SM90}" in message
    assert "blocks that fit: block_m=128 block_k=64 block_n=256 num_warps=8 num_stages=2" in message
