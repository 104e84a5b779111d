"""Merged inference on the packed serving model (jaxlora/models/merged.py): merge -> unmerge gives
the base kernels back bit for bit (float32 and bfloat16, window columns included), switching
straight from one merged adapter to another equals merging it from the base, and a step on the
merged weights gives the logits of the unmerged LoRA path for the merged adapter's rows (float32,
tiny random model, random adapters, tokens and KV cache); so does a mixed (deLoRA) step, where
the rows of other adapters and of the base model add the merged adapter's LoRA with negated scale
from a window slot (`WindowPlan.token_extra`)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.lora.plan import build_plan, build_window_plan
from jaxlora.nn.model_config import PROJECTIONS
from jaxlora.models.llama import LoraInputs
from jaxlora.models.merged import base_copy, merge_layout, set_merged
from jaxlora.models.packed import add_adapter_window, fill_window_slot, pack_projections, window_keys, window_layout
from jaxlora.models.paged import paged_forward
from tests.jaxlora.hf_checkpoints import relative_error
from tests.serve.test_lora_step import CONFIG, setup, step_batch  # noqa: F401 (fixture)

ROWS = [(2, 0, 6), (2, 9, 1), (2, 0, 5), (2, 12, 1)]  # every row on pool slot 2 (targets all projections)


def serving_model(model, pool, dtype=jnp.float32):
    """The packed model with a 2-slot window holding pool slots 0 and 1, in `dtype`; its merge
    layout over every projection; {kernel key: array}."""
    packed = pack_projections(model)
    window = window_layout(CONFIG, 2, 16, PROJECTIONS)
    add_adapter_window(packed, window)
    for key, param in packed.weights.items():
        param.set_value(param[...].astype(dtype))
    weights = {key: packed.weights[key][...] for key in window_keys(window)}
    for w in range(2):
        weights = fill_window_slot(window, weights, pool, np.int32(w), np.int32(w))
    for key, value in weights.items():
        packed.weights[key].set_value(value)
    layout = merge_layout(CONFIG, packed.weights.keys(), PROJECTIONS)
    return packed, layout, {key: packed.weights[key][...] for key in layout.kernel_keys}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_merge_then_unmerge_restores_the_kernels_bit_identically(setup, dtype):
    model, pool, _ = setup
    _, layout, kernels = serving_model(model, pool, dtype)
    before = {key: np.asarray(value) for key, value in kernels.items()}
    base = base_copy(layout, kernels)
    merged = set_merged(layout, kernels, base, pool, np.int32(2), True)
    for key in before:
        assert not np.array_equal(np.asarray(merged[key]), before[key]), key  # ΔW went in
    merged = set_merged(layout, merged, base, pool, np.int32(1), True)  # another adapter, straight away
    restored = set_merged(layout, merged, base, pool, np.int32(0), False)
    for key in before:
        assert np.asarray(restored[key]).view(np.uint8).tobytes() == before[key].view(np.uint8).tobytes(), key


def test_switching_adapters_equals_merging_from_the_base(setup):
    model, pool, _ = setup
    _, layout, kernels = serving_model(model, pool)
    base = base_copy(layout, kernels)
    direct = {k: np.asarray(v) for k, v in set_merged(layout, dict(kernels), base, pool, np.int32(3), True).items()}
    _, _, kernels = serving_model(model, pool)
    switched = set_merged(layout, set_merged(layout, kernels, base, pool, np.int32(2), True), base, pool,
                          np.int32(3), True)
    for key in direct:
        np.testing.assert_array_equal(np.asarray(switched[key]), direct[key])


def test_merged_weights_give_the_unmerged_logits(setup):
    model, pool, cache = setup
    packed, layout, kernels = serving_model(model, pool)
    base = base_copy(layout, kernels)
    for key, value in set_merged(layout, kernels, base, pool, np.int32(2), True).items():
        packed.weights[key].set_value(value)
    batch, token_slot, _, num_rows = step_batch(ROWS, 32, seed=3)
    got = np.asarray(paged_forward(packed, batch, cache)[0])[:num_rows]  # plain base path, no LoRA
    want = np.asarray(paged_forward(model, batch, cache, LoraInputs(pool, build_plan(token_slot, 16)))[0])[:num_rows]
    unadapted = np.asarray(paged_forward(model, batch, cache)[0])[:num_rows]
    for r in range(num_rows):
        assert relative_error(got[r], want[r]) <= 1e-5, f"row {r}"
    assert relative_error(unadapted, want) > 1e-2  # the adapter matters


def test_layout_finds_separate_and_packed_kernels(setup):
    model, _, _ = setup
    separate = merge_layout(CONFIG, model.weights.keys(), ("k_proj", "up_proj"))
    assert separate.targets == (("k_proj", "layers.k_proj.kernel", 0, CONFIG.kv_size),
                                ("up_proj", "layers.up_proj.kernel", 0, CONFIG.intermediate_size))
    packed = merge_layout(CONFIG, pack_projections(model).weights.keys(), ("k_proj", "up_proj"))
    assert packed.targets == (("k_proj", "layers.qkv_proj.kernel", CONFIG.q_size, CONFIG.kv_size),
                              ("up_proj", "layers.gate_up_proj.kernel", CONFIG.intermediate_size,
                               CONFIG.intermediate_size))
    with pytest.raises(ValueError, match="no kernel"):
        merge_layout(CONFIG, ["layers.o_proj.kernel"], ("q_proj",))


def test_mixed_step_gives_the_unmerged_logits(setup):
    """Pool slot 2 merged; the window holds slots 0 and 1 and, in window slot 2, slot 2 with its
    scale negated: rows of slot 2 run the base path, the others keep their own window slot and the
    branch's (the base rows only the branch's)."""
    model, pool, cache = setup
    packed = pack_projections(model)
    window = window_layout(CONFIG, 3, 16, PROJECTIONS)
    add_adapter_window(packed, window)
    negated = {name: {**arrays, "scale": -arrays["scale"]} for name, arrays in pool.items()}
    weights = {key: packed.weights[key][...] for key in window_keys(window)}
    for w, (source, slot) in enumerate([(pool, 0), (pool, 1), (negated, 2)]):
        weights = fill_window_slot(window, weights, source, np.int32(w), np.int32(slot))
    for key, value in weights.items():
        packed.weights[key].set_value(value)
    layout = merge_layout(CONFIG, packed.weights.keys(), PROJECTIONS)
    kernels = {key: packed.weights[key][...] for key in layout.kernel_keys}
    for key, value in set_merged(layout, kernels, base_copy(layout, kernels), pool, np.int32(2), True).items():
        packed.weights[key].set_value(value)
    rows = [(2, 0, 6), (0, 9, 1), (-1, 0, 5), (1, 0, 3), (2, 12, 1), (-1, 7, 1), (0, 4, 1)]
    batch, token_slot, _, num_rows = step_batch(rows, 32, seed=4)
    own = np.where(token_slot == 2, -1, token_slot)  # slot s in window slot s; the merged rows: base path
    padding = batch.token_row < 0
    extra = np.where((token_slot != 2) & ~padding, 2, -1)
    plan = build_window_plan(own, 3, 16, extra)
    got = np.asarray(paged_forward(packed, batch, cache, LoraInputs({}, plan))[0])[:num_rows]
    want = np.asarray(paged_forward(model, batch, cache, LoraInputs(pool, build_plan(token_slot, 16)))[0])[:num_rows]
    for r in range(num_rows):
        assert relative_error(got[r], want[r]) <= 1e-5, f"row {r}"
    without = np.asarray(paged_forward(packed, batch, cache, LoraInputs({}, build_window_plan(own, 3, 16)))[0])
    assert relative_error(without[:num_rows], want) > 1e-2  # the branch matters
