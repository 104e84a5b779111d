"""Packed projections (jaxlora/models/packed.py: q/k/v and gate/up as one kernel each) compute what
the separate kernels do, with and without adapters, and train as they do."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.lora.plan import build_plan
from jaxlora.lora.project import LoraInputs
from jaxlora.models.packed import pack_projections
from tests.jaxlora.parallel.fixtures import CONFIG, random_pool, tiny_model


def _relative_error(got, want):
    got, want = got[0], want[0]  # (logits, cache)
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def test_packed_model_equals_the_separate_one():
    model = tiny_model(CONFIG)  # with q/k/v biases (attention_bias)
    packed = pack_projections(model)
    assert "layers.qkv_proj.kernel" in packed.weights and "layers.q_proj.kernel" not in packed.weights
    assert "layers.qkv_proj.bias" in packed.weights and "layers.gate_up_proj.kernel" in packed.weights
    assert "layers.q_proj.kernel" in model.weights  # the original keeps its kernels
    assert packed.weights["layers.o_proj.kernel"][...] is model.weights["layers.o_proj.kernel"][...]  # shared
    tokens = jax.random.randint(jax.random.key(3), (2, 11), 0, CONFIG.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(11), (2, 11))
    want = model(tokens, positions)
    assert _relative_error(packed(tokens, positions), want) <= 1e-5
    assert _relative_error(pack_projections(packed)(tokens, positions), want) <= 1e-5  # packing twice: no-op


def test_packed_model_adds_each_projections_adapter():
    model = tiny_model(CONFIG)
    packed = pack_projections(model)
    tokens = jax.random.randint(jax.random.key(4), (1, 13), 0, CONFIG.vocab_size)
    positions = jnp.arange(13)[None]
    slots = np.array([0, 0, 1, 1, 3, -1, 2, 2, 0, 1, -1, 2, 3], np.int32)
    lora = LoraInputs(random_pool(), build_plan(slots))
    want = model(tokens, positions, lora=lora)
    assert _relative_error(want, model(tokens, positions)) > 1e-3  # the adapters change the output
    assert _relative_error(packed(tokens, positions, lora=lora), want) <= 1e-5


@pytest.mark.parametrize("backend", ["onehot", "fused"])
def test_packed_model_trains_as_the_separate_one(backend):
    """Training inputs (LoRA dropout; a fused backend) on a packed model take each projection's own
    columns: the same loss and adapter gradients as the separate kernels, bit for bit (what lets a
    server train on its packed serving model, serve.finetune)."""
    model = tiny_model(CONFIG)
    packed = pack_projections(model)
    tokens = jax.random.randint(jax.random.key(5), (1, 12), 0, CONFIG.vocab_size)
    positions = jnp.arange(12)[None]
    plan = build_plan(np.array([0, 0, 1, 1, 2, 2, -1, 3, 3, 0, 1, 2], np.int32))
    rate = jnp.full(4, 0.25) if backend == "onehot" else None
    key = jax.random.key(7) if backend == "onehot" else None

    pool = random_pool()
    factors = {m: {"a": arrays["a"], "b": arrays["b"]} for m, arrays in pool.items()}

    def loss(net, factors):
        merged = {m: {**pool[m], **factors[m]} for m in pool}
        logits, _ = net(tokens, positions, lora=LoraInputs(merged, plan, rate, key), lora_backend=backend)
        return jnp.sum(logits ** 2)

    want = jax.value_and_grad(lambda f: loss(model, f))(factors)
    got = jax.value_and_grad(lambda f: loss(packed, f))(factors)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
