"""Rematerialisation of the decoder layers (`make_grad_step(..., remat=)`) changes what the
backward keeps, not what it computes: the same losses and adapter gradients as without (f32)."""

import jax
import numpy as np
import pytest

from jaxlora.buckets import bucket
from jaxlora.lora.plan import build_plan
from jaxlora.lora.trainable import split_pool
from jaxlora.parallel.grad_step import make_grad_step
from tests.jaxlora.parallel.fixtures import NUM_SLOTS, packed_batch, random_pool, tiny_model


@pytest.mark.parametrize("remat", ["layer", "save_dots"])
def test_remat_matches_no_remat(remat):
    batch, token_slot = packed_batch(batch=3, length=13, adapters=(0, 1, 2, 3, -1), seed=5)
    trainable, frozen = split_pool(random_pool(seed=4))
    plan = build_plan(token_slot, bucket(NUM_SLOTS + 1, 4))
    model = tiny_model()
    expected_loss, expected = make_grad_step(model, NUM_SLOTS, "gather")(trainable, frozen, batch, plan)
    step = make_grad_step(model, NUM_SLOTS, "gather", remat=remat)
    loss, grads = step(trainable, frozen, batch, plan)
    assert "remat" in str(jax.make_jaxpr(step)(trainable, frozen, batch, plan))  # the layer is rematerialised
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for module in expected:
        for key in ("a", "b"):
            want, got = np.asarray(expected[module][key]), np.asarray(grads[module][key])
            assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want), (module, key)
            assert np.linalg.norm(want) > 0


def test_remat_is_refused_under_shard_map():
    from jaxlora import sharding

    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="remat"):
        make_grad_step(tiny_model(), NUM_SLOTS, mesh=mesh, remat="layer")
