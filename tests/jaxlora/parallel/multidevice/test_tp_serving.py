"""Tensor-parallel serving (serve.engine.Engine(mesh=...)): a TP=2 engine serves the same greedy
tokens as the one-device engine, and its forward gives the same logits, with adapters swapped
through one device slot; weights, pool and KV pages are placed Megatron / S-LoRA / by KV heads."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxlora import sharding
from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.plan import build_plan
from jaxlora.nn.model_config import PROJECTIONS
from jaxlora.models.llama import LoraInputs
from jaxlora.models.paged import PagedBatch, paged_forward
from jaxlora.sampling import SamplingParams
from serve.engine import Engine, EngineConfig
from tests.jaxlora.parallel.fixtures import CONFIG, tiny_model

# GQA (4 query heads, 2 KV heads): each of the 2 shards holds 2 query heads and their 1 KV head.
GQA = dataclasses.replace(CONFIG, num_kv_heads=2)
# One slot for two adapters: the second replaces the first, through the sharded slot update.
# max_model_len 32 with 8-token pages keeps the block-table width at one bucket (few compiles).
ENGINE = EngineConfig(max_adapters_on_device=1, max_lora_rank=8, page_size=8, num_pages=32, max_model_len=32,
                      max_num_seqs=8, token_budget=16, prefill_chunk=8)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model():
    return tiny_model(GQA)


@pytest.fixture(scope="module")
def adapters():
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS)
    return {f"ad{i}": random_adapter(f"ad{i}", GQA, lora, seed=10 + i, b_std=0.3) for i in range(2)}


def _mesh(tensor=2, data=1):
    return sharding.make_mesh(data=data, tensor=tensor, devices=jax.devices()[: data * tensor])


def _requests(names=(None, "ad0", "ad1", "ad0", None, "ad1", "ad1"), seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, GQA.vocab_size, int(rng.integers(3, 20))).tolist(), name) for name in names]


def _serve(engine, requests):
    got = {i: [] for i in range(len(requests))}
    for i, (prompt, name) in enumerate(requests):
        engine.submit(i, prompt, name, SamplingParams(MAX_TOKENS), lambda e, i=i: got[i].append(e))
    engine.run_until_idle()
    assert all(events[-1].finish_reason == "length" for events in got.values())
    return [[e.token for e in got[i] if e.token is not None] for i in range(len(requests))]


@pytest.fixture(scope="module")
def engines(model, adapters):
    """(one-device engine, TP=2 engine, their outputs): mixed requests, then base-only ones (the
    step without LoRA inputs)."""
    batches = [_requests(), _requests((None, None), seed=1)]
    single = Engine(model, (), ENGINE, adapters)
    expected = [_serve(single, requests) for requests in batches]
    tp = Engine(model, (), ENGINE, adapters, mesh=_mesh())
    return single, tp, expected, [_serve(tp, requests) for requests in batches]


def test_tp2_serves_the_same_greedy_tokens(engines):
    single, tp, expected, got = engines
    assert got == expected
    assert len({tuple(tokens) for tokens in expected[0]}) == len(expected[0])  # adapters change the outputs
    assert tp.stats.adapter_loads >= 2 and tp.stats.base_only_steps >= 1


def test_tp2_placement(model, engines):
    _, tp, _, _ = engines
    assert tp.tensor_parallel == 2
    weights = tp._state["weights"]
    assert weights["layers.q_proj.kernel"][...].sharding.spec == P(None, None, "tensor")
    assert weights["layers.down_proj.kernel"][...].sharding.spec == P(None, "tensor", None)
    # the caller's model stays where it was
    assert model.weights["layers.q_proj.kernel"][...].sharding.is_fully_replicated
    assert len(model.weights["layers.q_proj.kernel"][...].devices()) == 1
    # after loads and evictions the pool keeps the S-LoRA layout and the cache its KV-head split
    pool = tp.pool.arrays
    assert pool["o_proj"]["a"].sharding.spec == P(None, None, "tensor", None)
    assert pool["o_proj"]["b"].sharding.is_fully_replicated
    assert pool["up_proj"]["b"].sharding.spec == P(None, None, None, "tensor")
    assert pool["up_proj"]["a"].sharding.is_fully_replicated
    assert tp.cache.k.sharding.spec == P(None, None, None, "tensor")  # trailing Nones are dropped
    assert tp.cache.k.addressable_shards[0].data.shape[3] == GQA.num_kv_heads // 2


def test_tp2_per_row_sampling_state_matches_one_device(engines):
    """Rows with penalties, a logit bias, min_tokens and logprobs (the "sample_state" program and
    its replicated per-sequence state) give the same tokens and log-probabilities under TP=2."""
    single, tp, _, _ = engines
    params = [SamplingParams(MAX_TOKENS, repetition_penalty=1.7, logprobs=3),
              SamplingParams(MAX_TOKENS, frequency_penalty=1.2, presence_penalty=0.5, temperature=0.8, seed=3),
              SamplingParams(MAX_TOKENS, logit_bias=((5, 4.0), (7, -50.0)), min_tokens=3, stop_token_ids=(9,)),
              SamplingParams(MAX_TOKENS)]
    outputs = []
    for engine in (single, tp):
        got = {i: [] for i in range(len(params))}
        for i, ((prompt, name), sampling) in enumerate(zip(_requests(seed=2), params)):
            engine.submit(i, prompt, name, sampling, lambda e, i=i: got[i].append(e))
        engine.run_until_idle()
        outputs.append([[(e.token, e.logprobs) for e in got[i] if e.token is not None] for i in range(len(params))])
    assert [[t for t, _ in row] for row in outputs[1]] == [[t for t, _ in row] for row in outputs[0]]
    for (_, one), (_, two) in zip(outputs[0][0], outputs[1][0]):
        np.testing.assert_allclose(two[0], one[0], rtol=1e-5, atol=1e-5)
    assert tp.sampler_slots.arrays.output_counts.sharding.is_fully_replicated


def test_tp2_donates_cache_and_pool(engines):
    _, tp, _, _ = engines
    cache, pool = tp.cache, tp.pool.arrays
    tp.submit("one", [1, 2, 3], "ad0", SamplingParams(2), lambda e: None)
    tp.run_until_idle()
    assert cache.k.is_deleted() and cache.v.is_deleted()  # the step wrote the pages in place
    tp.pool.evict(0)
    assert pool["q_proj"]["b"].is_deleted()  # the slot update too
    assert tp.pool.arrays["q_proj"]["b"].sharding.spec == P(None, None, None, "tensor")


def _logits(engine, slot_of_row):
    """f32 logits of a 2-row prefill step (rows of 7 and 5 tokens) through the engine's own state."""
    lengths = (7, 5)
    tokens = np.random.default_rng(5).integers(0, GQA.vocab_size, sum(lengths)).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    token_row = np.repeat(np.arange(2), lengths).astype(np.int32)
    tables = np.array([[0], [1]], np.int32)
    batch = PagedBatch(tokens, positions, token_row, tables, np.cumsum(lengths).astype(np.int32) - 1)
    token_slot = np.asarray(slot_of_row, np.int32)[token_row]
    lora = LoraInputs(engine.pool.arrays, build_plan(token_slot, engine._num_segments))
    graphdef = engine._graphdef

    @jax.jit
    def forward(state, cache, batch, lora):
        return paged_forward(nnx.merge(graphdef, state), batch, cache, lora, engine.config.lora_backend)[0]

    return np.asarray(forward(engine._state, engine.cache, batch, lora))


def test_tp2_logits_match_one_device(engines, adapters):
    single, tp, _, _ = engines
    for engine in (single, tp):
        engine.pool.load(engine.prepare_adapter(adapters["ad1"]), slot=0)
    expected, got = _logits(single, [0, -1]), _logits(tp, [0, -1])
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
    assert np.abs(_logits(single, [-1, -1]) - expected)[0].max() > 1e-3  # the adapter is in row 0's logits


def test_tp_rejects_pallas_other_axes_and_uneven_shapes(model):
    with pytest.raises(ValueError, match="gather, onehot"):
        Engine(model, (), dataclasses.replace(ENGINE, lora_backend="pallas"), mesh=_mesh())
    with pytest.raises(ValueError, match="tensor"):
        Engine(model, (), ENGINE, mesh=_mesh(tensor=2, data=2))
    with pytest.raises(ValueError, match="num_kv_heads=2 does not split over tensor=4"):
        Engine(model, (), ENGINE, mesh=_mesh(tensor=4))


def test_cli_mesh_takes_the_first_devices():
    from serve.cli import tensor_parallel_mesh

    mesh = tensor_parallel_mesh(2, "onehot")
    assert dict(mesh.shape) == {"data": 1, "stage": 1, "tensor": 2}
    assert list(mesh.devices.flat) == jax.devices()[:2]
