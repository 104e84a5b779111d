"""The engine serving a compressed collection (Compress-then-Serve) next to ordinary adapters:
every request's greedy tokens equal generation with its adapter's reconstruction merged."""

import dataclasses

import numpy as np
import pytest

from jaxlora.compress.collection import Source, compress
from jaxlora.generate import SamplingParams, generate
from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.models.merge import merge_adapter
from serve.engine import Engine, EngineConfig
from tests.jaxlora.parallel.fixtures import CONFIG, tiny_model
from tests.serve.conftest import exact_weights

ENGINE = EngineConfig(max_adapters_on_device=1, max_lora_rank=8, page_size=8, num_pages=32, max_model_len=32,
                      max_num_seqs=8, token_budget=16, prefill_chunk=8, lora_backend="compressed")
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def setup():
    model = tiny_model()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))
    sources = [Source(random_adapter(f"c{i}", CONFIG, lora, seed=60 + i, b_std=0.4)) for i in range(4)]
    collection = compress(sources, CONFIG, "jd-diag", rank=6, clusters=2)
    ordinary = {f"p{i}": random_adapter(f"p{i}", CONFIG, LoraConfig(r=8, lora_alpha=16), seed=70 + i, b_std=0.4)
                for i in range(2)}
    return model, collection, ordinary


def _expected(model, prompt, adapter):
    with exact_weights(model):
        if adapter is not None:
            merge_adapter(model, adapter)
        return generate(model, [prompt], SamplingParams(max_new_tokens=MAX_TOKENS))[0]


def test_compressed_and_ordinary_requests_in_one_engine_match_merged_generation(setup):
    model, collection, ordinary = setup
    engine = Engine(model, (), ENGINE, ordinary, compressed=collection.serving_set())
    assert set(engine.adapter_names()) == set(ordinary) | set(collection.names)
    rng = np.random.default_rng(5)
    # two ordinary adapters for one pool slot (one waits for the other), four compressed adapters
    names = ["c0", "p0", "c2", None, "c1", "p1", "c3", "c0"]
    requests = [(rng.integers(0, CONFIG.vocab_size, int(rng.integers(3, 12))).tolist(), name) for name in names]
    got = {i: [] for i in range(len(requests))}
    for i, (prompt, name) in enumerate(requests):
        engine.submit(i, prompt, name, SamplingParams(max_new_tokens=MAX_TOKENS), lambda e, i=i: got[i].append(e))
    engine.run_until_idle()
    tokens = [[e.token for e in got[i] if e.token is not None] for i in range(len(requests))]
    for i, (prompt, name) in enumerate(requests):
        adapter = None if name is None else ordinary.get(name) or collection.as_adapter(name)
        assert tokens[i] == _expected(model, prompt, adapter), name
    assert engine.stats.adapter_loads >= 2  # ordinary adapters go through the pool; compressed ones never load
    assert engine.snapshot()["adapters_known"] == 6


def test_compressed_collections_need_the_shared_basis_backend_and_matching_shapes(setup):
    model, collection, _ = setup
    with pytest.raises(ValueError, match="needs a shared-basis LoRA backend.*not 'gather'"):
        Engine(model, (), dataclasses.replace(ENGINE, lora_backend="gather"), compressed=collection.serving_set())
    other = dataclasses.replace(collection, shapes={**collection.shapes, "q_proj": (64, 32)},
                                tensors={**collection.tensors, "q_proj.basis_out": collection.tensors["q_proj.basis_out"][..., :32]})
    with pytest.raises(ValueError, match="q_proj has \\(layers, in, out\\) \\(2, 64, 32\\)"):
        Engine(model, (), ENGINE, compressed=other.serving_set())


def test_removing_a_compressed_adapter(setup):
    model, collection, _ = setup
    engine = Engine(model, (), ENGINE, compressed=collection.serving_set())
    engine.remove_adapter("c1")
    engine.step()
    assert "c1" not in engine.adapter_names()
    done = []
    engine.submit(0, [1, 2, 3], "c2", SamplingParams(max_new_tokens=2), done.append)
    engine.run_until_idle()
    assert done[-1].finish_reason == "length"
