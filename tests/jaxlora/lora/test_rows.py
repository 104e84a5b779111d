"""The paged device pool (jaxlora/lora/rows.py): adapters written into the rows a caller hands out
(scattered, exactly their rank) read back as the padded pool holds them, through the row table
(`slot_view`, and `paged_ops.padded_view` per layer); an emptied slot and a write with no rows
leave rank 0; the XLA delta over the rows equals the padded pool's."""

import jax.numpy as jnp
import numpy as np

from jaxlora.lora import ops
from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.paged_ops import padded_view
from jaxlora.lora.plan import build_plan
from jaxlora.lora.pool import AdapterPool
from jaxlora.lora.rows import RowPool, adapter_rank, slot_view
from tests.jaxlora.test_merge import CONFIG

MODULES = ("q_proj", "v_proj", "down_proj")
SLOTS, RANK, ROWS = 3, 16, 40


def _pools():
    """(padded pool, row pool, rows given per slot) holding adapters of ranks 4, 16, 8 (the rank-16
    one on q only), the row pool's rows taken from a shuffled free list."""
    adapters = [random_adapter(f"a{i}", CONFIG, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets), seed=i)
                for i, (r, targets) in enumerate(((4, MODULES), (16, ("q_proj",)), (8, MODULES)))]
    free = list(np.random.default_rng(0).permutation(ROWS))
    given: dict = {}
    rows = RowPool(CONFIG, SLOTS, RANK, ROWS, MODULES, rows_of=lambda slot: given[slot])
    padded = AdapterPool(CONFIG, SLOTS, RANK, MODULES)
    for slot, adapter in enumerate(adapters):
        prepared = rows.prepare(adapter)
        given[slot] = [int(free.pop()) for _ in range(adapter_rank(prepared))]
        rows.load(prepared, slot=slot)
        padded.load(adapter, slot=slot)
    return padded, rows, given


def test_rows_read_back_as_the_padded_slots():
    padded, rows, given = _pools()
    assert [len(r) for r in given.values()] == [4, 16, 8]  # exactly the rank, no max-rank padding
    for slot in range(SLOTS):
        view = slot_view(rows.arrays, np.int32(slot))
        for module in MODULES:
            for key in ("a", "b", "scale", "rank"):
                np.testing.assert_array_equal(np.asarray(view[module][key][:, 0]),
                                              np.asarray(padded.arrays[module][key][:, slot]))
    layer = {key: value[1] for key, value in rows.arrays["down_proj"].items()}
    view = padded_view(layer)
    for key in ("a", "b", "rank"):
        np.testing.assert_array_equal(np.asarray(view[key]), np.asarray(padded.arrays["down_proj"][key][1]))
    assert rows.row_bytes * ROWS == sum(m[k].nbytes for m in rows.arrays.values() for k in ("a_rows", "b_rows"))


def test_delta_over_rows_equals_the_padded_pools():
    padded, rows, _ = _pools()
    x = jnp.asarray(np.random.default_rng(1).normal(size=(7, CONFIG.hidden_size)), jnp.float32)
    plan = build_plan(np.array([0, 1, -1, 2, 2, 0, 1]))
    layer_rows = {key: value[0] for key, value in rows.arrays["q_proj"].items()}
    layer_padded = {key: value[0] for key, value in padded.arrays["q_proj"].items()}
    got = ops.gather_delta(x, ops.layer_pool(layer_rows), plan)
    want = ops.gather_delta(x, layer_padded, plan)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) <= 1e-6


def test_evict_and_a_write_without_rows_leave_rank_zero():
    _, rows, given = _pools()
    rows.evict(0)
    given[1] = []  # the slot's adapter was evicted before a staged copy landed
    rows.load(rows.prepare(random_adapter("late", CONFIG, LoraConfig(r=4, target_modules=MODULES))), slot=1)
    for module in MODULES:
        rank = np.asarray(rows.arrays[module]["rank"])
        assert not rank[:, :2].any() and rows.slot_names[0] is None


def test_padded_passes_the_compact_arrays_as_they_are():
    """A row pool pads nothing on the host (rows hold exactly the rank): a rank-4 adapter's arrays
    go to the write as prepared (no copy), an untargeted module as width 0 with rank 0."""
    rows = RowPool(CONFIG, SLOTS, RANK, ROWS, MODULES, rows_of=lambda slot: list(range(4)))
    prepared = rows.prepare(random_adapter("low", CONFIG, LoraConfig(r=4, target_modules=("q_proj",)), seed=3))
    values = rows.padded(prepared)
    assert values["q_proj"]["a"] is prepared.values["q_proj"]["a"]
    assert values["v_proj"]["a"].shape[2] == 0 and not values["v_proj"]["rank"].any()
    rows.load(prepared, slot=2)
    view = slot_view(rows.arrays, np.int32(2))
    np.testing.assert_array_equal(np.asarray(view["q_proj"]["a"][:, 0, :, :4]), np.asarray(prepared.values["q_proj"]["a"]))
    assert not np.asarray(view["q_proj"]["a"][:, 0, :, 4:]).any() and not np.asarray(view["v_proj"]["rank"]).any()
