"""SGMV/BGMV Triton kernels compiled on a real GPU (default tiles from the heuristic/table)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import reference as ref
from tests.pallas_kernels.cases import TOL, arrays, rel_err, segments

pytestmark = pytest.mark.gpu_only


def _batch(dtype, seed=0):
    """T=300 (no multiple of the row tile), SmolLM2-like k=576, n=1536, 8 adapters, r_max=64."""
    meta = segments([40, 0, 70, 33, 1, 90, 50, 0], [3, 0, -1, 7, 2, 5, 0, -1],
                    [8, 16, 64, 64, 32, 16, 8, 0])
    return (*arrays(seed, 300, 576, 1536, 64, 8, dtype), *meta)


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_sgmv_on_gpu(dtype):
    x, lora_a, lora_b, y, starts, slots, ranks, scales = _batch(dtype)
    assert pk.resolve_impl(None) == ("gpu", False)
    v = jax.jit(pk.sgmv_shrink)(x, lora_a, starts, slots, ranks)
    assert rel_err(v, ref.sgmv_shrink_ref(x, lora_a, starts, slots, ranks)) <= TOL[dtype]
    out = jax.jit(pk.sgmv_expand)(y, v, lora_b, starts, slots, ranks, scales)
    expected = ref.sgmv_expand_ref(y, v, lora_b, starts, slots, ranks, scales)
    assert rel_err(out - y, expected - y) <= TOL[dtype]
    np.testing.assert_array_equal(np.asarray(out)[40:110], np.asarray(y)[40:110])  # slot -1


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_bgmv_on_gpu(dtype):
    x, lora_a, lora_b, y = arrays(1, 64, 576, 1536, 64, 8, dtype)
    rng = np.random.default_rng(0)
    row_slot = jnp.asarray(rng.integers(-1, 8, 64), jnp.int32)
    row_rank = jnp.asarray(rng.choice([8, 16, 32, 64], 64), jnp.int32)
    row_scale = jnp.asarray(rng.uniform(0.5, 2, 64), jnp.float32)
    v = jax.jit(pk.bgmv_shrink)(x, lora_a, row_slot, row_rank)
    assert rel_err(v, ref.bgmv_shrink_ref(x, lora_a, row_slot, row_rank)) <= TOL[dtype]
    out = jax.jit(pk.bgmv_expand)(y, v, lora_b, row_slot, row_rank, row_scale)
    expected = ref.bgmv_expand_ref(y, v, lora_b, row_slot, row_rank, row_scale)
    assert rel_err(out - y, expected - y) <= TOL[dtype]


def test_lora_delta_grads_on_gpu():
    x, lora_a, lora_b, y, *meta = _batch(jnp.float32, seed=2)

    def grads(impl):
        def loss(x, lora_a, lora_b, scales):
            delta = pk.sgmv_lora_delta(x, lora_a, lora_b, *meta[:3], scales, impl=impl)
            return jnp.sum(y * delta)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, lora_a, lora_b, meta[3])

    errors = {name: rel_err(got, expected)
              for name, got, expected in zip(("dx", "dA", "dB", "dscale"), grads("gpu"),
                                             grads("reference"))}
    assert max(errors.values()) <= 1e-5, errors
