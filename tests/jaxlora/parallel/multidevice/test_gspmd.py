"""GSPMD tensor + data parallel (jaxlora.sharding): same logits, loss and adapter gradients as one device."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxlora import sharding
from jaxlora.models.llama import LoraInputs
from jaxlora.parallel.grad_step import make_grad_step
from tests.jaxlora.parallel.fixtures import NUM_SLOTS, tiny_model
from tests.jaxlora.parallel.multidevice.reference import assert_close_tree, case, reference_grads

MESHES = [(2, 4), (4, 2), (1, 4), (4, 1)]  # (data, tensor)


def _mesh(data, tensor):
    return sharding.make_mesh(data=data, tensor=tensor, devices=jax.devices()[: data * tensor])


def test_weights_and_pool_follow_megatron_and_slora():
    mesh = _mesh(2, 4)
    model = sharding.shard_model(tiny_model(), mesh)
    specs = {name: model.weights[name][...].sharding.spec for name in model.weights}
    assert specs["layers.q_proj.kernel"] == jax.sharding.PartitionSpec(None, None, "tensor")
    assert specs["layers.o_proj.kernel"] == jax.sharding.PartitionSpec(None, "tensor", None)
    assert specs["layers.down_proj.kernel"] == jax.sharding.PartitionSpec(None, "tensor", None)
    _, _, _, trainable, _ = case("multi")
    pool = sharding.shard_pool(trainable, mesh)
    # Column-parallel: A replicated, B split by output columns. Row-parallel: A split by input rows.
    assert pool["up_proj"]["a"].sharding.is_fully_replicated
    assert pool["up_proj"]["b"].sharding.spec == jax.sharding.PartitionSpec(None, None, None, "tensor")
    assert pool["o_proj"]["a"].sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor", None)
    assert pool["o_proj"]["b"].sharding.is_fully_replicated
    local = pool["down_proj"]["a"].addressable_shards[0].data.shape
    assert local[2] == trainable["down_proj"]["a"].shape[2] // 4


@pytest.mark.parametrize("data,tensor", MESHES[:2])
def test_logits_match_one_device(data, tensor):
    batch, token_slot, plan, trainable, frozen = case("multi")
    pool = {m: {**trainable[m], **frozen[m]} for m in trainable}

    def forward(model, pool, batch, plan):
        return model(batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"],
                     lora=LoraInputs(pool, plan))[0]

    expected = nnx.jit(forward)(tiny_model(), pool, batch, plan)
    mesh = _mesh(data, tensor)
    model = sharding.shard_model(tiny_model(), mesh)
    logits = nnx.jit(forward)(model, sharding.shard_pool(pool, mesh), sharding.shard_batch(batch, mesh),
                              sharding.shard_plan(plan, mesh))
    assert logits.sharding.spec[0] == "data" or data == 1
    assert_close_tree(logits, expected)


@pytest.mark.parametrize("kind", ["single", "multi"])
@pytest.mark.parametrize("data,tensor", MESHES)
def test_loss_and_grads_match_one_device(kind, data, tensor):
    dropout = kind == "multi"  # LoRA dropout draws the same mask under GSPMD
    batch, _, plan, trainable, frozen = case(kind)
    expected_loss, expected_grads = reference_grads(kind, dropout=dropout)
    mesh = _mesh(data, tensor)
    model = sharding.shard_model(tiny_model(), mesh)
    rate, key = (np.full(NUM_SLOTS, 0.25, np.float32), jax.random.key(7)) if dropout else (None, None)
    step = make_grad_step(model, NUM_SLOTS)
    loss, grads = step(sharding.shard_pool(trainable, mesh), sharding.shard_pool(frozen, mesh),
                       sharding.shard_batch(batch, mesh), sharding.shard_plan(plan, mesh),
                       None if rate is None else sharding.replicate(rate, mesh), key)
    assert_close_tree(loss, expected_loss)
    assert_close_tree(grads, expected_grads)
    if tensor > 1:  # the gradient of B keeps B's column split
        assert grads["q_proj"]["b"].sharding.spec[3] == "tensor"


def test_mesh_must_divide_heads():
    from dataclasses import replace

    from jaxlora.models.llama import Llama

    model = Llama(replace(tiny_model().config, num_heads=6, num_kv_heads=2), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_heads=6"):
        sharding.shard_model(model, _mesh(2, 4))
