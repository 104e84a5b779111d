"""Loading a slot is one jitted update (the slot traced, so one compile serves every slot and
eviction); a prepared adapter loads the same values as a raw one; a donating pool writes in place."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import AdapterError, LoraConfig
from jaxlora.lora.pool import AdapterPool, write_slot, write_slot_donated
from tests.jaxlora.test_merge import CONFIG

SLOTS, RANK = 5, 8  # a layout no other test uses, so the compile count below is this test's own
MODULES = ("q_proj", "v_proj", "down_proj")


def _adapters(count):
    return [random_adapter(f"a{i}", CONFIG, LoraConfig(r=(4, 8)[i % 2], lora_alpha=16,
                                                       target_modules=MODULES[: 1 + i % 3]), seed=i)
            for i in range(count)]


def _expected_slot(adapter, module):
    """The slot's a, b, scale, rank as the pool should hold them (zero-padded to RANK)."""
    layers = CONFIG.num_layers
    if module not in adapter.modules:
        return None
    weights = adapter.modules[module]
    width = weights.a.shape[2]
    a = np.zeros(weights.a.shape[:2] + (RANK,), np.float32)
    b = np.zeros((layers, RANK, weights.b.shape[2]), np.float32)
    a[:, :, :width], b[:, :width] = weights.a, weights.b
    return a, b, weights.scale, weights.rank


def _check_slot(pool, slot, adapter):
    for module, arrays in pool.arrays.items():
        expected = _expected_slot(adapter, module)
        got = [np.asarray(arrays[key][:, slot]) for key in ("a", "b", "scale", "rank")]
        if expected is None:
            assert not any(part.any() for part in got)
        else:
            for part, want in zip(got, expected):
                np.testing.assert_array_equal(part, want)


@pytest.mark.parametrize("donate", [False, True])
def test_every_slot_reuses_one_compiled_update(donate):
    update = write_slot_donated if donate else write_slot
    pool = AdapterPool(CONFIG, SLOTS, RANK, MODULES, donate=donate)
    adapters = _adapters(SLOTS)
    before = update._cache_size()
    for slot, adapter in enumerate(adapters):
        held = pool.arrays["q_proj"]["a"]
        assert pool.load(pool.prepare(adapter) if slot % 2 else adapter, slot=slot) == slot
        assert held.is_deleted() == donate  # donated: written in place; otherwise the old array stays valid
    pool.evict(2)
    pool.load(adapters[2], slot=2)
    pool.evict(4)
    assert update._cache_size() - before == 1
    for slot, adapter in enumerate(adapters[:4]):
        _check_slot(pool, slot, adapter)
    assert pool.slot_names == ["a0", "a1", "a2", "a3", None]
    assert not any(np.asarray(arrays[key][:, 4]).any() for arrays in pool.arrays.values() for key in arrays)


def test_prepared_adapter_is_checked_against_the_pool_layout():
    pool = AdapterPool(CONFIG, SLOTS, RANK, MODULES, donate=True)
    pool.load(_adapters(1)[0])
    other = AdapterPool(CONFIG, SLOTS, 16, MODULES)
    prepared = other.prepare(_adapters(2)[1])
    snapshot = {m: {k: np.asarray(v).copy() for k, v in a.items()} for m, a in pool.arrays.items()}
    with pytest.raises(AdapterError, match="another pool layout"):
        pool.load(prepared, slot=1)
    assert pool.slot_names[1] is None
    for module, parts in snapshot.items():
        for key, value in parts.items():
            np.testing.assert_array_equal(np.asarray(pool.arrays[module][key]), value)


def test_prepared_adapter_is_compact_and_padded_only_when_written():
    """A prepared adapter keeps each module at its own rank in its own dtype (bf16 stays bf16, never
    padded to the pool's max rank); a float32 one written into a bfloat16 pool is cast there."""
    import ml_dtypes

    pool = AdapterPool(CONFIG, 2, RANK, MODULES, dtype=jnp.bfloat16, donate=True)
    adapter = _adapters(1)[0]  # rank 4 < RANK
    stored = adapter.modules["q_proj"]
    adapter.modules["q_proj"] = dataclasses.replace(stored, a=stored.a.astype(ml_dtypes.bfloat16),
                                                    b=stored.b.astype(ml_dtypes.bfloat16))
    prepared = pool.prepare(adapter)
    assert set(prepared.values) == {"q_proj"}
    assert prepared.values["q_proj"]["a"].shape == stored.a.shape and stored.a.shape[2] == 4
    assert prepared.values["q_proj"]["a"].dtype == ml_dtypes.bfloat16
    assert prepared.nbytes == stored.a.nbytes // 2 + stored.b.nbytes // 2 + stored.scale.nbytes + stored.rank.nbytes
    pool.load(prepared, slot=1)
    assert pool.arrays["q_proj"]["a"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(pool.arrays["q_proj"]["a"][:, 1, :, :4]),
                                  np.asarray(jnp.asarray(stored.a, jnp.bfloat16)))
    assert not np.asarray(pool.arrays["q_proj"]["a"][:, 1, :, 4:], np.float32).any()
    f32 = AdapterPool(CONFIG, 2, RANK, MODULES, dtype=jnp.float32)
    f32.load(prepared, slot=0)  # bf16 host copy -> float32 slot
    np.testing.assert_array_equal(np.asarray(f32.arrays["q_proj"]["b"][:, 0, :4]),
                                  stored.b.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_float32_adapter_is_cast_once_for_a_bfloat16_pool_and_loaded_without_a_host_copy():
    """Issue 34: a float32 adapter prepared for a bfloat16 pool is held in bfloat16 (cast once, at
    `prepare`); a full-rank module's slot arrays are the prepared arrays themselves (no per-write
    pad or cast); a lower-rank one is padded; the slot equals the adapter cast to bfloat16."""
    import ml_dtypes

    pool = AdapterPool(CONFIG, 2, RANK, MODULES, dtype=jnp.bfloat16, donate=True)
    adapter = random_adapter("full", CONFIG, LoraConfig(r=RANK, lora_alpha=16, target_modules=MODULES), seed=11)
    prepared = pool.prepare(adapter)
    for module, weights in adapter.modules.items():
        held = prepared.values[module]
        assert held["a"].dtype == ml_dtypes.bfloat16 and held["b"].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(held["a"], weights.a.astype(ml_dtypes.bfloat16))
    slot_values = pool.padded(prepared)
    for module in MODULES:
        assert slot_values[module]["a"] is prepared.values[module]["a"]
        assert slot_values[module]["b"] is prepared.values[module]["b"]
    pool.load(prepared, slot=0)
    for module, weights in adapter.modules.items():
        np.testing.assert_array_equal(np.asarray(pool.arrays[module]["b"][:, 0], np.float32),
                                      weights.b.astype(ml_dtypes.bfloat16).astype(np.float32))
    low = pool.prepare(_adapters(1)[0])  # rank 4 < RANK: padded per write
    padded = pool.padded(low)["q_proj"]
    assert padded["a"].shape[2] == RANK and padded["a"] is not low.values["q_proj"]["a"]
    assert not np.asarray(padded["a"][:, :, 4:], np.float32).any()


@pytest.mark.parametrize("rows", [False, True])
def test_pinned_host_adapters_load_the_same_slots(rows):
    """A pool with `pinned=True` holds prepared A/B as jax arrays in pinned host memory and writes
    slots equal to a numpy-held pool's (full and lower rank; the row pool too); `to_device` puts
    them in device memory."""
    from jaxlora.lora.rows import RowPool

    def make(pinned):
        if rows:
            return RowPool(CONFIG, 2, RANK, 2 * RANK, MODULES, dtype=jnp.float32,
                           rows_of=lambda slot: list(range(slot * RANK, (slot + 1) * RANK)), pinned=pinned)
        return AdapterPool(CONFIG, 2, RANK, MODULES, dtype=jnp.float32, donate=True, pinned=pinned)

    adapters = [random_adapter("full", CONFIG, LoraConfig(r=RANK, lora_alpha=16, target_modules=MODULES), seed=3),
                _adapters(1)[0]]  # rank RANK, rank 4
    pinned, plain = make(True), make(False)
    for slot, adapter in enumerate(adapters):
        held = pinned.prepare(adapter)
        assert all(v["a"].sharding.memory_kind == "pinned_host" for v in held.values.values())
        assert pinned.to_device(pinned.padded(held))["q_proj"]["a"].sharding.memory_kind == "device"
        pinned.load(held, slot=slot)
        plain.load(plain.prepare(adapter), slot=slot)
    for module in MODULES:
        for key, value in plain.arrays[module].items():
            np.testing.assert_array_equal(np.asarray(pinned.arrays[module][key]), np.asarray(value))


@pytest.mark.parametrize("rows", [False, True])
def test_values_already_on_the_device_are_written_without_a_second_device_put(rows, monkeypatch):
    """A prefetched copy (`serve.adapter_copies`: padded slot arrays already in device memory) is
    written as it is; host-held values still go through `to_device` once; the slot is the same."""
    from jaxlora.lora.rows import RowPool

    def make():
        if rows:
            return RowPool(CONFIG, 2, RANK, 2 * RANK, MODULES, dtype=jnp.float32,
                           rows_of=lambda slot: list(range(slot * RANK, (slot + 1) * RANK)), pinned=True)
        return AdapterPool(CONFIG, 2, RANK, MODULES, dtype=jnp.float32, donate=True, pinned=True)

    pool, reference = make(), make()
    adapter = _adapters(2)[1]
    on_device = pool.to_device(pool.padded(pool.prepare(adapter)))
    puts = []
    original = pool.to_device
    monkeypatch.setattr(pool, "to_device", lambda values: puts.append(1) or original(values))
    pool.write_padded(1, "a1", on_device)
    assert puts == []
    pool.write_padded(0, "a0", pool.padded(pool.prepare(adapter)))  # pinned host values: one put
    assert puts == [1]
    reference.load(reference.prepare(adapter), slot=1)
    reference.load(reference.prepare(adapter), slot=0)
    for module in MODULES:
        for key, value in reference.arrays[module].items():
            np.testing.assert_array_equal(np.asarray(pool.arrays[module][key]), np.asarray(value))


def test_reserve_host_puts_one_pinned_block_and_changes_no_slot(monkeypatch):
    """`reserve_host` grows the pinned host memory with one block of the bytes asked (a pinned
    `device_put`, freed at once), leaves the pool's arrays as they were, and does nothing for a
    pool without pinned copies or for 0 bytes."""
    pool = AdapterPool(CONFIG, 2, RANK, MODULES, dtype=jnp.float32, donate=True, pinned=True)
    pool.load(pool.prepare(_adapters(1)[0]), slot=0)
    before = {m: {k: np.asarray(v) for k, v in arrays.items()} for m, arrays in pool.arrays.items()}
    puts, original = [], jax.device_put

    def recording(x, sharding=None, **kwargs):
        puts.append((getattr(x, "nbytes", None), getattr(sharding, "memory_kind", None)))
        return original(x, sharding, **kwargs)

    monkeypatch.setattr(jax, "device_put", recording)
    assert pool.reserve_host(3 << 20) == 3 << 20
    assert puts == [(3 << 20, "pinned_host")]
    assert pool.reserve_host(0) == 0 and len(puts) == 1
    plain = AdapterPool(CONFIG, 2, RANK, MODULES, dtype=jnp.float32, donate=True)
    assert plain.reserve_host(3 << 20) == 0 and len(puts) == 1
    for module, arrays in before.items():
        for key, value in arrays.items():
            np.testing.assert_array_equal(np.asarray(pool.arrays[module][key]), value)


@pytest.mark.parametrize("pinned", [False, True])
def test_the_slot_update_compiled_by_an_eviction_serves_the_loads_after_it(pinned):
    """The pool's arrays are committed to the device from the start, like every write's outputs, so
    the slot update an eviction compiles (what `Engine.warmup` runs) is the one later loads call: no
    second signature of `write_slot_donated` after it (a fresh server compiled it again at its first
    adapter load, on the engine thread)."""
    pool = AdapterPool(CONFIG, 3, RANK, MODULES, dtype=jnp.float32, donate=True, pinned=pinned)
    pool.evict(0)
    compiled = write_slot_donated._cache_size()
    for slot, adapter in enumerate(_adapters(2), start=1):
        prepared = pool.prepare(adapter)
        values = pool.to_device(pool.padded(prepared)) if pinned else pool.padded(prepared)
        pool.write_padded(slot, adapter.name, values)
    assert write_slot_donated._cache_size() == compiled


def test_modules_an_adapter_does_not_target_are_written_from_zeros_kept_on_the_device():
    """A q/v adapter in a pool of more modules: the others' slot arrays are one set of zeros made
    once and held in device memory (no host zeros shipped per load), and the slot reads as zeros there."""
    pool = AdapterPool(CONFIG, SLOTS, RANK, MODULES, donate=True)
    adapter = random_adapter("qv", CONFIG, LoraConfig(r=RANK, lora_alpha=16, target_modules=("q_proj", "v_proj")),
                             seed=11)
    prepared = pool.prepare(adapter)
    first, second = pool.padded(prepared), pool.padded(prepared)
    zeros = first["down_proj"]
    assert all(isinstance(zeros[key], jax.Array) and zeros[key] is second["down_proj"][key] for key in zeros)
    assert all(not np.asarray(value).any() for value in zeros.values())
    assert pool.padded(None)["down_proj"]["a"] is zeros["a"]  # an empty slot's too
    pool.load(pool.prepare(_adapters(3)[2]), slot=1)  # down_proj written with real values first
    pool.load(prepared, slot=1)
    _check_slot(pool, 1, adapter)  # q/v the adapter's, down_proj zero again
