"""The adapter window (jaxlora/models/packed.py `add_adapter_window`, serve/window.py): a serving
step whose adapters sit in the window (their A as extra columns of the packed base kernels, their
B block-diagonal per group, `WindowPlan`) gives the logits of the gathering path on the unpacked
model (float32, tiny random model, random adapters of mixed ranks and targets, random KV cache);
base and kernel steps on the windowed model drop the window's columns; the window's bookkeeping
keeps, fills and evicts the right slots."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxlora.lora.plan import build_plan, build_serving_plan, build_window_plan
from jaxlora.nn.model_config import PROJECTIONS
from jaxlora.models.llama import LoraInputs
from jaxlora.models.packed import add_adapter_window, fill_window_slot, pack_projections, window_keys, window_layout
from jaxlora.models.paged import paged_forward
from serve.window import WindowSlots
from tests.jaxlora.hf_checkpoints import relative_error
from tests.serve.test_lora_step import CONFIG, NUM_SEGMENTS, NUM_SLOTS, setup, step_batch  # noqa: F401 (fixture)

WINDOW = 4
# Rows as (pool slot, start position, tokens); at most WINDOW distinct adapters a step.
STEPS = {
    "mixed": [(3, 0, 6), (0, 9, 1), (-1, 0, 5), (1, 0, 3), (3, 12, 1), (-1, 7, 1), (8, 4, 1)],
    "decode_only": [(s, 5 + s, 1) for s in (2, 0, 9, -1, 9, 2, 0)],
    "single_decode": [(5, 10, 1)],
    "single_prefill": [(5, 0, 7)],
}


def windowed(model, pool, pool_slots):
    """(packed model with a window of WINDOW slots holding `pool_slots` in order, {pool slot:
    window slot})."""
    packed = pack_projections(model)
    layout = window_layout(CONFIG, WINDOW, 16, PROJECTIONS)
    assert {batched for _, _, batched in layout.groups} == {True, False}  # gate/up batched, q/k/v block-diagonal
    add_adapter_window(packed, layout)
    keys = window_keys(layout)
    weights = {key: packed.weights[key][...] for key in keys}
    for window_slot, pool_slot in enumerate(pool_slots):
        weights = fill_window_slot(layout, weights, pool, np.int32(window_slot), np.int32(pool_slot))
    for key in keys:
        packed.weights[key].set_value(weights[key])
    return packed, {slot: w for w, slot in enumerate(pool_slots)}


@pytest.mark.parametrize("step", sorted(STEPS))
def test_window_step_equals_the_gathering_path(setup, step):
    model, pool, cache = setup
    rows = STEPS[step]
    batch, token_slot, _, num_rows = step_batch(rows, 32, seed=len(step))
    used = sorted({slot for slot, _, _ in rows if slot >= 0})
    # the window holds the step's adapters among others, in another order than the pool's
    others = [s for s in range(NUM_SLOTS) if s not in used][: WINDOW - len(used)]
    packed, window_of = windowed(model, pool, (others + used)[::-1])
    lookup = np.array([window_of.get(int(s), -1) for s in range(NUM_SLOTS)] + [-1], np.int32)
    plan = build_window_plan(lookup[token_slot], WINDOW, 16)
    got = np.asarray(paged_forward(packed, batch, cache, LoraInputs({}, plan), "pallas_gpu")[0])[:num_rows]
    want = np.asarray(paged_forward(model, batch, cache, LoraInputs(pool, build_plan(token_slot, 16)))[0])[:num_rows]
    base = np.asarray(paged_forward(model, batch, cache)[0])[:num_rows]
    adapter_rows = np.array([token_slot[i] >= 0 for i in batch.logit_indices[:num_rows]])
    for r in range(num_rows):
        assert relative_error(got[r], want[r]) <= 1e-5, f"row {r}"
    assert relative_error(got[~adapter_rows], base[~adapter_rows]) <= 1e-6 if (~adapter_rows).any() else True
    assert relative_error(got[adapter_rows], base[adapter_rows]) > 1e-2  # the adapters matter


def test_window_gpu_kernel_step_equals_the_reference_step(setup, monkeypatch):
    """The forward with the window's GPU kernel (`pallas_kernels.window_expand`, interpret mode;
    the layer scan hands it the B stacks whole with the layer's index) equals the plain-jnp form
    that the CPU runs, on a step of prefill, decode and base rows."""
    import pallas_kernels.window_expand as window_expand

    model, pool, cache = setup
    rows = STEPS["mixed"]
    batch, token_slot, _, num_rows = step_batch(rows, 32, seed=3)
    packed, window_of = windowed(model, pool, [3, 0, 1, 8])
    lookup = np.array([window_of.get(int(s), -1) for s in range(NUM_SLOTS)] + [-1], np.int32)
    plan = build_window_plan(lookup[token_slot], WINDOW, 16)
    want = np.asarray(paged_forward(packed, batch, cache, LoraInputs({}, plan), "pallas_gpu")[0])[:num_rows]
    calls = []
    real_gpu = window_expand.window_expand_gpu
    monkeypatch.setattr(window_expand, "resolve_impl", lambda impl: ("gpu", True))
    monkeypatch.setattr(window_expand, "window_expand_gpu", lambda *a, **k: calls.append(a[5]) or real_gpu(*a, **k))
    got = np.asarray(paged_forward(packed, batch, cache, LoraInputs({}, plan), "pallas_gpu")[0])[:num_rows]
    # the four packed groups of the traced layer body, each given the stacks and the layer index (not a slice)
    assert len(calls) == 4 and all(layer is not None for layer in calls)
    assert relative_error(got, want) <= 1e-5


def test_windowed_model_runs_base_and_kernel_steps_without_the_window(setup):
    """The window's columns are dropped from base steps and from steps through the LoRA kernels."""
    model, pool, cache = setup
    packed, _ = windowed(model, pool, [0, 1, 2, 3])  # a full window: its columns are not zero
    rows = STEPS["mixed"]
    batch, token_slot, one_token, num_rows = step_batch(rows, 32, seed=5)
    base = paged_forward(model, batch, cache)[0][:num_rows]
    assert relative_error(np.asarray(paged_forward(packed, batch, cache)[0][:num_rows]), np.asarray(base)) <= 1e-6
    serving = LoraInputs(pool, build_serving_plan(token_slot, one_token, NUM_SEGMENTS))
    want = paged_forward(model, batch, cache, LoraInputs(pool, build_plan(token_slot, 16)))[0][:num_rows]
    got = jax.jit(lambda m, b, c, l: paged_forward(m, b, c, l, "pallas_gpu")[0])(packed, batch, cache, serving)
    assert relative_error(np.asarray(got[:num_rows]), np.asarray(want)) <= 1e-5


def test_window_plan_refuses_slots_outside_the_window():
    with pytest.raises(ValueError, match="window slots"):
        build_window_plan(np.array([0, 4]), 4, 8)


def test_window_slots_keep_fill_and_evict_least_recently_used():
    window = WindowSlots(2)
    placed, fills = window.assign([(5, 1)])
    assert placed == {5: 0} and fills == [(0, 5)]
    placed, fills = window.assign([(5, 1), (7, 1)])
    assert placed == {5: 0, 7: 1} and fills == [(1, 7)]
    assert window.assign([(5, 1), (7, 1), (2, 1)]) is None  # more adapters than the window holds
    placed, fills = window.assign([(7, 1)])  # slot 0 (pool slot 5) is now the least recently used
    assert placed == {7: 1} and fills == []
    placed, fills = window.assign([(3, 1), (7, 1)])
    assert placed == {3: 0, 7: 1} and fills == [(0, 3)]
    placed, fills = window.assign([(7, 2)])  # pool slot 7 written again: its copy is stale
    assert placed == {7: 0} and fills == [(0, 7)]
    with pytest.raises(ValueError):
        WindowSlots(0)
