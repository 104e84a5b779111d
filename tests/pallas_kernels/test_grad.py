"""Gradients of sgmv_lora_delta (custom_vjp over the kernels) against jax.grad of the reference."""

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from pallas_kernels import reference as ref
from tests.pallas_kernels.cases import IMPLS, SMALL_TILES, TOL, mixed_batch, rel_err


def _grads(delta_fn, x, lora_a, lora_b, meta, weights):
    """d/d(x, A, B, seg_scale) of sum(weights * delta)."""
    starts, slots, ranks, scales = meta

    def loss(x, lora_a, lora_b, scales):
        delta = delta_fn(x, lora_a, lora_b, starts, slots, ranks, scales)
        return jnp.sum(weights * delta.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2, 3))(x, lora_a, lora_b, scales)


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
@pytest.mark.parametrize("impl", IMPLS)
def test_lora_delta_grads_match_reference(impl, dtype):
    x, lora_a, lora_b, y, *meta = mixed_batch(dtype, seed=10)
    weights = y.astype(jnp.float32)
    kernel = lambda *args: pk.sgmv_lora_delta(*args, impl=impl, tiles=SMALL_TILES)
    got = _grads(kernel, x, lora_a, lora_b, meta, weights)
    expected = _grads(ref.sgmv_lora_delta_ref, x, lora_a, lora_b, meta, weights)
    for name, g, e in zip(("x", "A", "B", "scale"), got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype, name
        assert rel_err(g, e) <= TOL[dtype], name
    unused_slot = 5
    assert not jnp.any(got[1][unused_slot]) and not jnp.any(got[2][unused_slot])

