"""shard_map tensor/data parallel and the GPipe pipeline (jaxlora.parallel): same loss and adapter
gradients as one device, with the reference backend and with the Pallas SGMV kernels."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxlora import sharding
from jaxlora.parallel.plans import local_plans
from jaxlora.parallel.grad_step import make_grad_step
from tests.jaxlora.parallel.fixtures import NUM_SLOTS, tiny_model
from tests.jaxlora.parallel.multidevice.reference import NUM_SEGMENTS, assert_close_tree, case, reference_grads


def _run(kind, backend, data, stage, tensor, microbatches=1):
    batch, token_slot, _, trainable, frozen = case(kind)
    mesh = sharding.make_mesh(data=data, stage=stage, tensor=tensor, devices=jax.devices()[: data * stage * tensor])
    pipeline = microbatches > 1 or stage > 1
    rules = sharding.ShardingRules().pipelined() if pipeline else sharding.ShardingRules()
    model = sharding.shard_model(tiny_model(), mesh, rules)
    arrays = {**batch, "token_slot": token_slot}
    if pipeline:
        arrays = {k: v.reshape(microbatches, -1, *v.shape[1:]) for k, v in arrays.items()}
    spec = P(None, "data") if pipeline else P("data")
    placed = {k: sharding.put(v, mesh, spec) for k, v in arrays.items()}
    plans = jax.tree.map(lambda leaf: sharding.put(leaf, mesh, spec),
                         local_plans(arrays["token_slot"], data, NUM_SEGMENTS))
    step = make_grad_step(model, NUM_SLOTS, backend, mesh=mesh, rules=rules, pipeline=pipeline)
    return step(sharding.shard_pool(trainable, mesh, rules),
                sharding.shard_pool(frozen, mesh, rules), placed, plans)


def test_local_plans_group_each_data_shard():
    _, token_slot, _, _, _ = case("multi")
    plans = local_plans(token_slot, 2, NUM_SEGMENTS)
    assert plans.token_slot.shape == (2, token_slot.size // 2)
    for shard in range(2):
        grouped = plans.token_slot[shard][plans.perm[shard]]
        slots = np.where(grouped < 0, 99, grouped)
        assert np.all(np.diff(slots) >= 0)  # rows grouped by slot, base rows last
        np.testing.assert_array_equal(plans.token_slot[shard], token_slot[2 * shard: 2 * shard + 2].reshape(-1))


@pytest.mark.parametrize("kind", ["single", "multi"])
@pytest.mark.parametrize("data,tensor", [(2, 4), (4, 2)])
def test_tensor_parallel_gather(kind, data, tensor):
    loss, grads = _run(kind, "gather", data, 1, tensor)
    expected_loss, expected_grads = reference_grads(kind)
    assert_close_tree(loss, expected_loss)
    assert_close_tree(grads, expected_grads)


def test_tensor_parallel_pallas_kernels():
    """The SGMV Pallas kernels (interpret mode on CPU) inside shard_map, TP 4 x DP 2."""
    loss, grads = _run("multi", "pallas", 2, 1, 4)
    expected_loss, expected_grads = reference_grads("multi", backend="pallas")
    assert_close_tree(loss, expected_loss)
    assert_close_tree(grads, expected_grads, rtol=3e-4)


@pytest.mark.parametrize("data,stage,tensor,microbatches", [(2, 2, 2, 2), (1, 2, 1, 4), (1, 2, 4, 2)])
def test_pipeline_matches_one_device(data, stage, tensor, microbatches):
    loss, grads = _run("multi", "gather", data, stage, tensor, microbatches)
    expected_loss, expected_grads = reference_grads("multi")
    assert_close_tree(loss, expected_loss)
    assert_close_tree(grads, expected_grads)
