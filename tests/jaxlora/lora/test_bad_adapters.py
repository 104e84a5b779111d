"""Bad adapters are refused with a message naming the problem, and the pool stays as it was."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import AdapterError, LoraConfig
from jaxlora.lora.peft_io import load_peft_adapter, save_peft_adapter
from jaxlora.lora.pool import AdapterPool
from jaxlora.nn.model_config import LlamaConfig
from tests.jaxlora.test_merge import CONFIG

LORA = LoraConfig(r=8, lora_alpha=16, target_modules=("q_proj", "v_proj", "down_proj"))


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "adapter")
    save_peft_adapter(random_adapter("good", CONFIG, LORA, seed=1), path)
    return path


@pytest.fixture
def pool():
    pool = AdapterPool(CONFIG, num_slots=2, max_rank=8)
    pool.load(random_adapter("resident", CONFIG, LORA, seed=0))
    return pool


def _snapshot(pool):
    return list(pool.slot_names), {m: {k: np.asarray(v).copy() for k, v in a.items()} for m, a in pool.arrays.items()}


def _assert_unchanged(pool, snapshot):
    names, arrays = snapshot
    assert pool.slot_names == names
    for module, parts in arrays.items():
        for key, value in parts.items():
            np.testing.assert_array_equal(np.asarray(pool.arrays[module][key]), value)


def _edit_config(path, **changes):
    file = os.path.join(path, "adapter_config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(changes)
    with open(file, "w") as f:
        json.dump(config, f)


def _edit_tensors(path, edit):
    file = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def _try_load(path, pool, base=CONFIG):
    """Loads and puts into the pool, as a server would; returns the error."""
    snapshot = _snapshot(pool)
    with pytest.raises(AdapterError) as caught:
        pool.load(load_peft_adapter(path, base))
    _assert_unchanged(pool, snapshot)
    return str(caught.value)


def test_good_adapter_loads(saved, pool):
    assert pool.load(load_peft_adapter(saved, CONFIG)) == 1


def test_shapes_for_another_base_model(saved, pool):
    other = LlamaConfig(**{**CONFIG.__dict__, "hidden_size": 96, "head_dim": 24})
    message = _try_load(saved, pool, base=other)
    assert "has shape (64, 8), expected (96, 8)" in message and "down_proj is 128->96" in message


def test_missing_keys(saved, pool):
    _edit_tensors(saved, lambda t: t.pop("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"))
    assert "missing tensors model.layers.1.mlp.down_proj.lora_B" in _try_load(saved, pool)


@pytest.mark.parametrize("change, words", [
    (dict(use_dora=True), "DoRA"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "embeddings"),
    (dict(bias="all"), "bias='all'"),
    (dict(peft_type="IA3"), "peft_type"),
])
def test_unsupported_options(saved, pool, change, words):
    _edit_config(saved, **change)
    assert words in _try_load(saved, pool)


def test_nan_and_inf_values(saved, pool):
    def poison(tensors):
        tensors["base_model.model.model.layers.2.self_attn.v_proj.lora_A.weight"][0, 0] = np.nan
    _edit_tensors(saved, poison)
    assert "v_proj lora_A of layer 2 holds NaN or Inf" in _try_load(saved, pool)


def test_truncated_file(saved, pool):
    file = os.path.join(saved, "adapter_model.safetensors")
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)
    assert "truncated or corrupt" in _try_load(saved, pool)


def test_malformed_config(saved, pool):
    with open(os.path.join(saved, "adapter_config.json"), "w") as f:
        f.write("{not json")
    assert "not valid JSON" in _try_load(saved, pool)


def test_pool_refuses_rank_above_max_and_full_pool(pool):
    snapshot = _snapshot(pool)
    big = random_adapter("big", CONFIG, LoraConfig(r=16, target_modules=("q_proj",)))
    with pytest.raises(AdapterError, match="rank 16 > the pool's max rank 8"):
        pool.load(big)
    _assert_unchanged(pool, snapshot)
    pool.load(random_adapter("second", CONFIG, LORA))
    snapshot = _snapshot(pool)
    with pytest.raises(AdapterError, match="pool is full"):
        pool.load(random_adapter("third", CONFIG, LORA))
    _assert_unchanged(pool, snapshot)


def test_evict_frees_the_slot_and_zeroes_it(pool):
    slot = pool.load(random_adapter("second", CONFIG, LORA, seed=5))
    pool.evict(slot)
    assert pool.slot_names[slot] is None and pool.free_slot() == slot
    for arrays in pool.arrays.values():
        assert not np.asarray(arrays["a"][:, slot]).any() and not np.asarray(arrays["rank"][:, slot]).any()
    assert np.asarray(pool.arrays["q_proj"]["a"][:, 0]).any()  # the resident adapter is untouched


def test_nonfinite_on_the_bits_of_16_bit_floats_matches_isfinite_on_every_bit_pattern():
    """`nonfinite` tests bfloat16/float16 on their exponent bits: for all 65536 bit patterns it
    agrees with np.isfinite of the values widened to float32."""
    import ml_dtypes

    from jaxlora.lora.adapter import nonfinite

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    for dtype in (ml_dtypes.bfloat16, np.float16):
        values = bits.view(dtype)
        np.testing.assert_array_equal(nonfinite(values), ~np.isfinite(values.astype(np.float32)))
    floats = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    floats[[3, 500]] = [np.nan, -np.inf]
    np.testing.assert_array_equal(nonfinite(floats), ~np.isfinite(floats))
