"""The one-pass merge of an adapter into base kernel columns (`pallas_kernels.merge_gpu`): the GPU
kernel (interpret mode on a CPU) against the jnp reference and against numpy, float32 and bf16,
odd sizes and ranks below/above Triton's smallest dot; unmerging gives the base bit for bit and
the kernel's other columns are never touched."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.merge_gpu import merge_columns, merge_columns_reference

# (layers, k, n, kernel width, column offset, rank)
SHAPES = [(3, 64, 96, 224, 32, 8), (2, 48, 80, 112, 16, 24), (1, 128, 512, 768, 256, 16), (2, 40, 36, 40, 4, 4)]


def _case(shape, dtype, seed):
    layers, k, n, width, offset, rank = shape
    rng = np.random.default_rng(seed)
    kernel = rng.normal(size=(layers, k, width)).astype(np.float32)
    kernel[0, 0, 0] = -0.0  # a negative zero must survive an unmerge
    base = rng.normal(size=(layers, k, n)).astype(np.float32)
    base[0, 0, 0] = -0.0
    a = rng.normal(0, k**-0.5, (layers, k, rank)).astype(np.float32)
    b = rng.normal(0, 0.5, (layers, rank, n)).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, layers).astype(np.float32)
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(kernel), cast(base), cast(a), cast(b), jnp.asarray(scale), offset


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_merge_kernel_equals_the_reference_and_unmerge_is_exact(shape, dtype):
    kernel, base, a, b, scale, offset = _case(shape, dtype, zlib.crc32(f"{shape} {dtype}".encode()))
    n = base.shape[2]
    before = np.asarray(kernel)
    want = (np.asarray(base, np.float32) + np.einsum("lkr,lrn->lkn", np.asarray(a, np.float32),
                                                      np.asarray(b, np.float32)) * np.asarray(scale)[:, None, None])
    merged = merge_columns(jnp.array(kernel), base, a, b, scale, jnp.bool_(True), offset, impl="gpu")
    reference = merge_columns_reference(jnp.array(kernel), base, a, b, scale, jnp.bool_(True), offset)
    got = np.asarray(merged, np.float32)[:, :, offset: offset + n]
    bound = 1e-5 if dtype == jnp.float32 else 1e-2
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= bound
    assert np.linalg.norm(got - np.asarray(reference, np.float32)[:, :, offset: offset + n]) <= bound * np.linalg.norm(want)
    outside = np.ones(before.shape[2], bool)
    outside[offset: offset + n] = False
    assert np.asarray(merged)[:, :, outside].tobytes() == before[:, :, outside].tobytes()
    restored = merge_columns(merged, base, a, b, scale, jnp.bool_(False), offset, impl="gpu")
    assert np.asarray(restored)[:, :, offset: offset + n].tobytes() == np.asarray(base).tobytes()
    assert np.asarray(restored)[:, :, outside].tobytes() == before[:, :, outside].tobytes()


def test_merge_refuses_columns_outside_the_kernel():
    kernel, base, a, b, scale, _ = _case(SHAPES[0], jnp.float32, 0)
    with pytest.raises(ValueError, match="do not fit"):
        merge_columns(kernel, base, a, b, scale, jnp.bool_(True), kernel.shape[2] - 8)
    with pytest.raises(ValueError, match="impl"):
        merge_columns(kernel, base, a, b, scale, jnp.bool_(True), 0, impl="tpu")


@pytest.mark.gpu_only
def test_gpu_merge_of_an_8b_shaped_projection_equals_the_reference():
    """The compiled kernel at a Llama-8B-like projection (bf16, 2 layers, q/k/v packed columns)."""
    kernel, base, a, b, scale, offset = _case((2, 4096, 1024, 6144, 4096, 16), jnp.bfloat16, 1)
    got = merge_columns(jnp.array(kernel), base, a, b, scale, jnp.bool_(True), offset)
    want = merge_columns_reference(jnp.array(kernel), base, a, b, scale, jnp.bool_(True), offset)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-2
    assert jax.devices()[0].platform == "gpu"
