"""One serving step (`paged_forward`) with the engine's `ServingPlan` (rows ordered once, SGMV for
prefill chunks + BGMV for one-token rows, no gathers) gives the logits and greedy tokens of the old
path (a `LoraPlan`: rows gathered into adapter order and back in every projection), in float32,
on a tiny random model with fresh random adapters, tokens and KV cache."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.plan import build_plan, build_serving_plan, serving_order
from jaxlora.lora.pool import AdapterPool
from jaxlora.nn.model_config import LlamaConfig
from jaxlora.nn.model_config import PROJECTIONS
from jaxlora.models.llama import Llama, LoraInputs
from jaxlora.models.paged import PagedBatch, PagedKVCache, paged_forward
from tests.jaxlora.hf_checkpoints import relative_error

CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, max_position_embeddings=128)
PAGE_SIZE, NUM_PAGES, NUM_SLOTS, NUM_SEGMENTS = 4, 64, 10, 4

# Rows as (slot, start position, tokens) in the scheduler's order; slot -1: base model.
STEPS = {
    "mixed": [(3, 0, 6), (0, 9, 1), (-1, 0, 5), (1, 0, 3), (3, 12, 1), (-1, 7, 1), (6, 4, 1)],
    "decode_only": [(s, 5 + s, 1) for s in (2, 0, 9, -1, 4, 4, 7)],
    "single_decode": [(5, 10, 1)],
    "single_prefill": [(5, 0, 7)],
    "more_adapters_than_segments": [(0, 0, 2), (1, 3, 3), (2, 0, 2)] + [(s, s, 1) for s in range(3, 10)],
}


@pytest.fixture(scope="module")
def setup():
    """(model, pool arrays of NUM_SLOTS random adapters of mixed ranks and targets, KV cache
    with random contents)."""
    model = Llama(CONFIG, rngs=nnx.Rngs(0))
    pool = AdapterPool(CONFIG, num_slots=NUM_SLOTS, max_rank=16)
    for i in range(NUM_SLOTS):
        targets = PROJECTIONS if i % 3 else ("q_proj", "v_proj", "down_proj")
        pool.load(random_adapter(f"a{i}", CONFIG, LoraConfig(r=(4, 8, 16)[i % 3], lora_alpha=16,
                                                             target_modules=targets), seed=i, b_std=0.3))
    rng = np.random.default_rng(7)
    shape = PagedKVCache.zeros(CONFIG, NUM_PAGES, PAGE_SIZE).k.shape
    cache = PagedKVCache(*(rng.normal(size=shape).astype(np.float32) for _ in range(2)))
    return model, pool.arrays, cache


def step_batch(rows, num_tokens: int, seed: int):
    """(PagedBatch, token_slot [T], one_token [T]) of `rows` in `serving_order` with random tokens."""
    rng = np.random.default_rng(seed)
    rows = [rows[i] for i in serving_order([r[0] for r in rows], [r[2] for r in rows])]
    tokens = rng.integers(0, CONFIG.vocab_size, num_tokens).astype(np.int32)
    positions, token_row = np.zeros(num_tokens, np.int32), np.full(num_tokens, -1, np.int32)
    token_slot, one_token = np.full(num_tokens, -1, np.int32), np.zeros(num_tokens, bool)
    pages = rng.permutation(NUM_PAGES)[: len(rows) * 4].reshape(len(rows), 4).astype(np.int32)
    logit_indices, offset = np.zeros(num_tokens, np.int32), 0
    for r, (slot, start, count) in enumerate(rows):
        span = slice(offset, offset + count)
        positions[span], token_row[span] = np.arange(start, start + count), r
        token_slot[span], one_token[span] = slot, count == 1
        offset += count
        logit_indices[r] = offset - 1
    tables = np.zeros((num_tokens, 4), np.int32)
    tables[: len(rows)] = pages
    return PagedBatch(tokens, positions, token_row, tables, logit_indices), token_slot, one_token, len(rows)


@jax.jit
def _logits(model, batch, cache, lora):
    return paged_forward(model, batch, cache, lora, "pallas_gpu")[0]


@pytest.mark.parametrize("step", sorted(STEPS))
def test_serving_plan_step_equals_the_gathering_path(setup, step):
    model, pool, cache = setup
    rows = STEPS[step]
    batch, token_slot, one_token, num_rows = step_batch(rows, 32, seed=len(step))
    decode_only = all(count == 1 for _, _, count in rows)
    serving = build_serving_plan(token_slot, one_token, 0 if decode_only else NUM_SEGMENTS)
    assert (serving.seg_starts is None) == decode_only
    new = np.asarray(_logits(model, batch, cache, LoraInputs(pool, serving)))[:num_rows]
    old = np.asarray(_logits(model, batch, cache, LoraInputs(pool, build_plan(token_slot, 16))))[:num_rows]
    base = np.asarray(paged_forward(model, batch, cache)[0])[:num_rows]
    adapter_rows = np.array([token_slot[i] >= 0 for i in batch.logit_indices[:num_rows]])
    for r in range(num_rows):
        assert relative_error(new[r], old[r]) <= 1e-5, f"row {r}"
    assert np.array_equal(new.argmax(-1), old.argmax(-1))
    assert np.array_equal(new[~adapter_rows], base[~adapter_rows])  # base rows: no LoRA at all
    assert relative_error(new[adapter_rows], base[adapter_rows]) > 1e-2  # the adapters matter


def _pool_arrays_in_layer_body(model, batch, cache, lora):
    """(whole, sliced): how many of the layer scan body's inputs are shaped like a module's
    stacked A/B [L, slots, ., .] (the pool passed whole) or like one layer's [slots, ., .]."""
    shapes = [tuple(m[key].shape) for m in lora.pool.values() for key in ("a", "b")]
    step = lambda pool, batch: paged_forward(model, batch, cache, LoraInputs(pool, lora.plan), "pallas_gpu")
    (scan,) = [e for e in jax.make_jaxpr(step)(lora.pool, batch).eqns if e.primitive.name == "scan"]
    body = [tuple(v.aval.shape) for v in scan.params["jaxpr"].jaxpr.invars]
    return (sum(shape in shapes for shape in body),
            sum(shape in {s[1:] for s in shapes} for shape in body))


def test_serving_step_passes_the_whole_pool_stack_to_each_layer(setup):
    """With a ServingPlan the layer scan takes the pool whole (the kernels index layer x slot in
    place); with a LoraPlan it slices the pool per layer as before."""
    model, pool, cache = setup
    rows = STEPS["mixed"]
    batch, token_slot, one_token, _ = step_batch(rows, 32, seed=3)
    serving = LoraInputs(pool, build_serving_plan(token_slot, one_token, NUM_SEGMENTS))
    assert _pool_arrays_in_layer_body(model, batch, cache, serving) == (2 * len(PROJECTIONS), 0)
    gathering = LoraInputs(pool, build_plan(token_slot, 16))
    assert _pool_arrays_in_layer_body(model, batch, cache, gathering) == (0, 2 * len(PROJECTIONS))
