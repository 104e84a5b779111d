"""Flash attention inside packed segments (GPU and TPU kernels in interpret mode) against the
masked-softmax reference: forward and dQ/dK/dV, f32 and bf16, GQA, empty-free odd segment layouts,
segments that are not contiguous; the GPU kernel's block skipping (`attention_gpu.segment_spans`)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import FlashBlocks, flash_supported, segment_attention, segment_attention_reference
from pallas_kernels.attention_gpu import segment_spans
from tests.pallas_kernels.cases import IMPLS, TOL, rel_err

LENGTH, HEADS, KV_HEADS, HEAD_DIM = 256, 4, 2, 32
SEGMENTS = {
    "one sample": [256],
    "odd samples and padding": [50, 1, 149, 56],  # the last is padding: segment 0 at the end
    "many short": [7] * 36 + [4],
}
KERNELS = [("gpu", "spans"), ("gpu", "jax"), ("tpu", "spans")]  # (impl, FlashBlocks.kernel); TPU has one kernel


def packed_inputs(seed, sizes, dtype):
    """q [1, T, H, D], k/v [1, T, Hkv, D] random normal; segment ids [1, T] (last group id 0 when
    there are several groups, like padding in `train.microbatch.pack_microbatch`)."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (1, LENGTH, HEADS, HEAD_DIM), dtype)
    k = jax.random.normal(kk, (1, LENGTH, KV_HEADS, HEAD_DIM), dtype)
    v = jax.random.normal(kv, (1, LENGTH, KV_HEADS, HEAD_DIM), dtype)
    ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(sizes)])
    if len(sizes) > 1:
        ids[-sizes[-1]:] = 0
    return q, k, v, jnp.asarray(ids[None], jnp.int32)


@pytest.mark.parametrize("impl,kernel", KERNELS)
@pytest.mark.parametrize("layout", sorted(SEGMENTS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_and_gradients_match_reference(impl, kernel, layout, dtype):
    q, k, v, ids = packed_inputs(len(layout), SEGMENTS[layout], dtype)
    assert_matches_reference(q, k, v, ids, impl, FlashBlocks(block_q=64, block_k=32, block_backward=32, kernel=kernel))


@pytest.mark.parametrize("impl", IMPLS)
def test_segments_that_are_not_contiguous(impl):
    """An id that comes back later in the row still attends to its earlier run (the spans use each
    id's first and last position, not the run's)."""
    q, k, v, _ = packed_inputs(3, [LENGTH], jnp.float32)
    ids = np.repeat(np.array([1, 2, 1, 3, 2, 0, 3, 1]), LENGTH // 8)
    assert_matches_reference(q, k, v, jnp.asarray(ids[None], jnp.int32), impl,
                             FlashBlocks(block_q=64, block_k=32, block_backward=32))


@pytest.mark.parametrize("window", [40, 100])
def test_gpu_kernel_sliding_window_matches_reference(window):
    """A sliding window (traced, as a layer scan passes it) and a non-default scale, forward and
    gradients, in the GPU "spans" kernel: the loops skip the blocks the window cannot reach."""
    q, k, v, ids = packed_inputs(4, SEGMENTS["odd samples and padding"], jnp.float32)
    blocks = FlashBlocks(block_q=64, block_k=32, block_backward=32)
    assert_matches_reference(q, k, v, ids, "gpu", blocks, sm_scale=0.1, window=jnp.int32(window))
    full = segment_attention_reference(q, k, v, ids, 0.1)
    assert rel_err(segment_attention_reference(q, k, v, ids, 0.1, window), full) > 1e-2  # the window matters


def test_window_is_refused_by_kernels_without_one():
    q, k, v, ids = packed_inputs(4, [LENGTH], jnp.float32)
    with pytest.raises(ValueError, match="sliding window"):
        segment_attention(q, k, v, ids, impl="tpu", window=8)


def assert_matches_reference(q, k, v, ids, impl, blocks, sm_scale=None, window=None):
    """Kernel output and dQ/dK/dV against the masked-softmax reference, relative-norm error."""
    dtype = q.dtype.type
    weights = jax.random.normal(jax.random.key(7), (1, LENGTH, HEADS, HEAD_DIM), jnp.float32)

    def loss(fn, q, k, v):
        return (fn(q, k, v).astype(jnp.float32) * weights).sum()

    kernel = lambda q, k, v: segment_attention(q, k, v, ids, impl=impl, blocks=blocks, sm_scale=sm_scale,
                                               window=window)
    reference = lambda q, k, v: segment_attention_reference(q, k, v, ids, sm_scale, window)
    assert rel_err(kernel(q, k, v), reference(q, k, v)) <= TOL[dtype]
    grads = jax.grad(lambda *a: loss(kernel, *a), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2))(q, k, v)
    for name, got, want in zip("qkv", grads, expected):
        assert rel_err(got, want) <= TOL[dtype], f"d{name}"


def test_segment_spans_are_first_and_last_position_of_each_id():
    ids = np.array([[5, 5, 2, 2, 2, 5, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], np.int32)
    first, last = segment_spans(jnp.asarray(ids))
    np.testing.assert_array_equal(first, [[0, 0, 2, 2, 2, 0, 6, 6], [0] * 8])
    np.testing.assert_array_equal(last, [[5, 5, 4, 4, 4, 5, 7, 7], [7] * 8])


def test_gpu_kernel_never_visits_blocks_of_other_segments():
    """NaN in the first sample's q/k/v: with block-aligned samples the spans kernel never loads
    those blocks for the later samples (forward and all gradients stay finite there), where
    JAX's kernel, which walks every block below the diagonal, lets the NaN through (0 * NaN)."""
    q, k, v, ids = packed_inputs(1, [64, 64, 128], jnp.float32)
    poison = lambda t: t.at[:, :64].set(jnp.nan)
    q, k, v = poison(q), poison(k), poison(v)
    blocks = FlashBlocks(block_q=64, block_k=32, block_backward=32)

    def later_samples(kernel):
        fn = lambda q, k, v: segment_attention(q, k, v, ids, impl="gpu",
                                               blocks=dataclasses.replace(blocks, kernel=kernel))
        out, vjp = jax.vjp(fn, q, k, v)
        grads = vjp(jnp.ones_like(out).at[:, :64].set(0))
        return [t[:, 64:] for t in (out, *grads)]

    assert all(bool(jnp.isfinite(t).all()) for t in later_samples("spans"))
    assert not all(bool(jnp.isfinite(t).all()) for t in later_samples("jax"))


def test_reference_never_mixes_segments():
    """Changing another segment's keys and values leaves a segment's outputs bit-identical."""
    q, k, v, ids = packed_inputs(0, [100, 100, 56], jnp.float32)
    out = segment_attention_reference(q, k, v, ids)
    changed = segment_attention_reference(q, k.at[:, 100:].multiply(3.0), v.at[:, 100:].add(1.0), ids)
    np.testing.assert_array_equal(out[:, :100], changed[:, :100])
    assert not np.allclose(out[:, 100:200], changed[:, 100:200])


def test_unsupported_shapes_are_refused():
    assert flash_supported(4096, 128) and not flash_supported(4000, 128) and not flash_supported(4096, 96)
    q, k, v, ids = packed_inputs(0, [256], jnp.float32)
    with pytest.raises(ValueError, match="multiple"):
        segment_attention(q[:, :100], k[:, :100], v[:, :100], ids[:, :100], impl="gpu")
    with pytest.raises(ValueError, match="key/value heads"):
        segment_attention(q[:, :, :3], k, v, ids, impl="gpu")
