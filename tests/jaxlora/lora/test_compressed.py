"""The shared-basis (compressed) LoRA backend: a projection's delta against a dense reference,
and a model batch mixing compressed adapters of two clusters, an ordinary pool adapter and base
rows equal to each row run alone with its reconstructed ΔW merged into the weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.compress.collection import Source, compress
from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.compressed import SharedBasisSet, compressed_delta, with_compressed
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.plan import build_plan
from jaxlora.lora.pool import AdapterPool
from jaxlora.lora.project import LoraInputs
from jaxlora.models.merge import merge_adapter
from tests.jaxlora.hf_checkpoints import relative_error
from tests.jaxlora.parallel.fixtures import CONFIG, tiny_model
from tests.serve.conftest import exact_weights

K, N_OUT, RANK, CLUSTERS, COMPRESSED = 23, 19, 5, 2, 6
SLOTS = 3


def _layer(arrays: dict) -> dict:
    return {key: value[0] for key, value in arrays.items()}


@pytest.mark.parametrize("diagonal", [False, True])
def test_projection_mixes_pool_slots_and_compressed_adapters(diagonal):
    rng = np.random.default_rng(7 + diagonal)
    cluster = np.array([0, 1, 1, 0, 1, 0], np.int32)
    core = (1, COMPRESSED, RANK) if diagonal else (1, COMPRESSED, RANK, RANK)
    tensors = {"basis_in": rng.normal(size=(1, CLUSTERS, K, RANK)), "basis_out": rng.normal(size=(1, CLUSTERS, RANK, N_OUT)),
               "sigma": rng.normal(size=core)}
    shared = SharedBasisSet(tuple(f"c{j}" for j in range(COMPRESSED)), cluster, {"m": tensors})
    pool = {"a": rng.normal(size=(1, SLOTS, K, 4)), "b": rng.normal(size=(1, SLOTS, 4, N_OUT)),
            "scale": rng.uniform(0.5, 2, (1, SLOTS)), "rank": np.full((1, SLOTS), 4, np.int32)}
    pool = {key: jnp.asarray(value, jnp.int32 if key == "rank" else jnp.float32) for key, value in pool.items()}
    module_pool = _layer(with_compressed({"m": pool}, shared.device_arrays(jnp.float32))["m"])
    token_slot = np.array([SLOTS + 4, 1, -1, SLOTS + 1, 0, SLOTS + 0, SLOTS + 5, 2, SLOTS + 1, -1, SLOTS + 2], np.int32)
    x = rng.normal(size=(len(token_slot), K)).astype(np.float32)
    got = compressed_delta(jnp.asarray(x), module_pool, build_plan(token_slot))
    want = np.zeros((len(token_slot), N_OUT))
    for t, slot in enumerate(token_slot):
        if 0 <= slot < SLOTS:
            delta = float(pool["scale"][0, slot]) * np.asarray(pool["a"][0, slot], np.float64) @ np.asarray(pool["b"][0, slot])
        elif slot >= SLOTS:
            j = slot - SLOTS
            sigma = np.diag(tensors["sigma"][0, j]) if diagonal else tensors["sigma"][0, j]
            c = cluster[j]
            delta = tensors["basis_in"][0, c] @ sigma @ tensors["basis_out"][0, c]
        else:
            continue
        want[t] = x[t].astype(np.float64) @ delta
    assert relative_error(got, want) <= 1e-5


@pytest.fixture(scope="module")
def collection():
    """A JD-Full collection of 5 random adapters in 2 clusters (q_proj, v_proj, down_proj)."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))
    sources = [Source(random_adapter(f"c{i}", CONFIG, lora, seed=40 + i, b_std=0.3)) for i in range(5)]
    return compress(sources, CONFIG, "jd-full", rank=6, clusters=2)


def test_compressed_rows_equal_the_merged_reconstruction_mixed_with_an_ordinary_adapter(collection):
    model = tiny_model()
    ordinary = random_adapter("plain", CONFIG, LoraConfig(r=8, lora_alpha=16, target_modules=("q_proj", "o_proj")),
                              seed=3, b_std=0.3)
    pool = AdapterPool(CONFIG, num_slots=2, max_rank=8)
    pool.load(ordinary, slot=1)
    arrays = with_compressed(pool.arrays, collection.serving_set().device_arrays(jnp.float32))
    row_adapter = ["c3", None, "plain", "c0", "c1", "c4"]  # clusters of both kinds, base, ordinary
    index = {name: 2 + j for j, name in enumerate(collection.names)} | {"plain": 1, None: -1}
    tokens = np.random.default_rng(4).integers(0, CONFIG.vocab_size, (len(row_adapter), 7))
    positions = np.broadcast_to(np.arange(7), tokens.shape)
    token_slot = np.repeat([index[name] for name in row_adapter], 7).reshape(tokens.shape)
    run = jax.jit(lambda t, p, lora: model(t, p, lora=lora, lora_backend="compressed")[0])
    got = np.asarray(run(tokens, positions, LoraInputs(arrays, build_plan(token_slot))))
    assert len(set(collection.cluster.tolist())) == 2
    for row, name in enumerate(row_adapter):
        with exact_weights(model):
            if name is not None:
                merge_adapter(model, ordinary if name == "plain" else collection.as_adapter(name))
            alone = np.asarray(model(tokens[row: row + 1], positions[:1])[0][0])
        assert relative_error(got[row], alone) <= 1e-5, name
    base = np.asarray(model(tokens[:1], positions[:1])[0][0])
    assert relative_error(got[0], base) > 1e-3  # the adapter changes the logits
