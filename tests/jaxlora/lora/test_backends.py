"""The LoRA backend registry (`jaxlora.lora.backends`): every backend's declared facts hold.

Each backend gives a projection with adapters the reference's output on every plan it takes; a
custom-kernel backend runs a `pallas_call` on the plans it routes to kernels and an XLA one none;
a serving backend serves (the engine's greedy tokens equal merged-weight generation, on a tiny
model); a training backend runs a training step with the reference backend's loss and gradients;
the configs accept exactly the backends that serve / train. The mesh facts (a partitionable
backend runs under a 2-device GSPMD mesh, the others are refused by `check_mesh`) need simulated
devices: tests/jaxlora/parallel/multidevice/test_backends.py."""

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.generate import SamplingParams, generate
from jaxlora.lora import backends
from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.plan import LoraPlan, ServingPlan, build_plan
from jaxlora.lora.project import LoraInputs, layer_lora, project
from jaxlora.lora.trainable import split_pool
from jaxlora.models.merge import merge_adapter
from jaxlora.parallel.grad_step import make_grad_step
from serve.engine import Engine, EngineConfig
from tests.jaxlora.hf_checkpoints import relative_error
from tests.jaxlora.lora.test_serving_plan import IN_DIM, OUT_DIM, STEPS, random_pool, step_plan
from tests.jaxlora.parallel.fixtures import CONFIG, packed_batch, tiny_model
from tests.jaxlora.parallel.fixtures import random_pool as random_stacked_pool
from tests.serve.conftest import exact_weights

ENGINE = EngineConfig(max_adapters_on_device=2, max_lora_rank=8, page_size=8, num_pages=32, max_model_len=32,
                      max_num_seqs=8, token_budget=16, prefill_chunk=8)
MAX_TOKENS = 4
# Grouped (q/v: one input) and single (down) projections, few enough to keep the interpreted kernels cheap.
TARGETS = ("q_proj", "v_proj", "down_proj")


def _plans(backend) -> dict:
    """{label: (token_slot, plan)}: a `LoraPlan` for every backend, and for a backend that takes a
    `ServingPlan` the mixed and decode-only serving steps too."""
    token_slot, serving = step_plan(STEPS["mixed"])
    plans = {"lora_plan": (token_slot, build_plan(token_slot))}
    if backend.plan_type is ServingPlan:
        plans["serving_mixed"] = (token_slot, serving)
        plans["serving_decode"] = step_plan(STEPS["decode_only"])
    return plans


def _reference(x, kernel, pool, token_slot):
    """x @ W + scale[slot] * x @ A[slot] @ B[slot] per row (numpy, float64)."""
    x, slot = np.asarray(x, np.float64), np.maximum(token_slot, 0)
    a, b, scale = (np.asarray(pool[key], np.float64) for key in ("a", "b", "scale"))
    delta = scale[slot, None] * np.einsum("nr,nrm->nm", np.einsum("nk,nkr->nr", x, a[slot]), b[slot])
    return x @ np.asarray(kernel, np.float64) + np.where(token_slot[:, None] >= 0, delta, 0.0)


@pytest.mark.parametrize("name", backends.names())
def test_every_backend_projects_like_the_reference_and_runs_kernels_as_declared(name):
    backend = backends.get(name)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    pool = random_pool(rng)
    kernel = jnp.asarray(rng.normal(0, IN_DIM**-0.5, (IN_DIM, OUT_DIM)), jnp.float32)
    for label, (token_slot, plan) in _plans(backend).items():
        x = jnp.asarray(rng.normal(size=(token_slot.size, IN_DIM)), jnp.float32)
        context = layer_lora(LoraInputs({}, plan), {"q_proj": pool}, name, jnp.int32(0))
        run = lambda x: project(x, {"q_proj.kernel": kernel}, "q_proj", context)
        assert relative_error(run(x), _reference(x, kernel, pool, token_slot)) <= 1e-5, label
        assert ("pallas_call" in str(jax.make_jaxpr(run)(x))) == backend.for_plan(plan).custom_kernel, label


def test_registry_facts_are_consistent():
    for name in backends.names():
        backend = backends.get(name)
        assert backend.plan_type in (LoraPlan, ServingPlan)
        assert not (backend.partitionable and backend.custom_kernel)  # a pallas_call has no SPMD rule
        assert backend.fused == (backend.row_delta is None and backend.route is None)
        assert backend.serves or backend.trains
    assert backends.resolve(backends.AUTO, "cpu") in backends.names(serves=True)


def test_configs_accept_exactly_the_backends_that_serve_or_train(tmp_path):
    from train.config import ConfigError, load_train_config

    for name in backends.names():
        if backends.get(name).serves:
            assert EngineConfig(lora_backend=name).lora_backend == name
        else:
            with pytest.raises(ValueError, match=f"cannot serve.*{', '.join(backends.names(serves=True))}"):
                EngineConfig(lora_backend=name)
    with pytest.raises(ValueError, match="unknown LoRA backend 'cuda'"):
        EngineConfig(lora_backend="cuda")
    path = tmp_path / "jobs.yaml"
    path.write_text("jobs: [{name: a, dataset: a.jsonl, lora: {r: 4}}]\n")
    for name in backends.names(trains=True):
        assert load_train_config(str(path), [f"lora_backend={name}"]).lora_backend == name
    with pytest.raises(ConfigError, match="lora_backend"):
        load_train_config(str(path), ["lora_backend=cuda"])


@pytest.fixture(scope="module")
def serving_setup():
    """(tiny model, 2 adapters, requests, each request's greedy tokens with its adapter merged)."""
    model = tiny_model()
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS)
    adapters = {f"ad{i}": random_adapter(f"ad{i}", CONFIG, lora, seed=20 + i, b_std=0.3) for i in range(2)}
    rng = np.random.default_rng(3)
    requests = [(rng.integers(0, CONFIG.vocab_size, length).tolist(), name)
                for length, name in ((5, "ad0"), (12, "ad1"), (3, None), (9, "ad0"))]
    expected = []
    for prompt, name in requests:
        with exact_weights(model):
            if name is not None:
                merge_adapter(model, adapters[name])
            expected.append(generate(model, [prompt], SamplingParams(max_new_tokens=MAX_TOKENS))[0])
    return model, adapters, requests, expected


@pytest.mark.parametrize("name", backends.names(serves=True))
def test_every_serving_backend_serves_the_merged_generation(serving_setup, name):
    model, adapters, requests, expected = serving_setup
    assert len({tuple(tokens) for tokens in expected}) == len(expected)  # the adapters change the outputs
    engine = Engine(model, (), dataclasses.replace(ENGINE, lora_backend=name), adapters)
    got = {i: [] for i in range(len(requests))}
    for i, (prompt, adapter) in enumerate(requests):
        engine.submit(i, prompt, adapter, SamplingParams(max_new_tokens=MAX_TOKENS), lambda e, i=i: got[i].append(e))
    engine.run_until_idle()
    assert [[e.token for e in got[i] if e.token is not None] for i in range(len(requests))] == expected


@pytest.fixture(scope="module")
def training_setup():
    """(tiny model, trainable, frozen, batch, plan, dropout rates, key, the gather backend's step)."""
    model = tiny_model()
    pool = random_stacked_pool()
    trainable, frozen = split_pool({module: pool[module] for module in TARGETS})
    batch, token_slot = packed_batch()
    plan = build_plan(token_slot)
    inputs = (trainable, frozen, batch, plan, jnp.full(4, 0.1), jax.random.key(5))
    return model, inputs, make_grad_step(model, num_slots=4, lora_backend="gather")(*inputs)


@pytest.mark.parametrize("name", backends.names(trains=True))
def test_every_training_backend_steps_like_the_reference(training_setup, name):
    model, inputs, (loss_ref, grads_ref) = training_setup
    loss, grads = make_grad_step(model, num_slots=4, lora_backend=name)(*inputs)
    assert relative_error(loss, loss_ref) <= 1e-5
    for module in grads_ref:
        for part in ("a", "b"):
            assert np.abs(np.asarray(grads_ref[module][part])).max() > 0
            assert relative_error(grads[module][part], grads_ref[module][part]) <= 1e-4, (module, part)
