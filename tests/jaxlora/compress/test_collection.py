"""Compressing whole adapters: every layer and module, clusters, the on-disk format, adding
adapters (projection and recompression), and refusing mismatched adapters by name."""

import dataclasses
import json
import os

import numpy as np
import pytest

from jaxlora.compress import store
from jaxlora.compress.collection import Source, add, compress, recompress, source_parameter_count
from jaxlora.lora.adapter_config import AdapterError
from jaxlora.nn.model_config import LlamaConfig
from tests.jaxlora.compress.fixtures import (CONFIG, MODULES, dense_delta, random_sources, shared_space_sources,
                                             total_error)


def test_svd_collection_is_exact_at_the_adapters_rank_and_reports_its_errors():
    sources = random_sources(4, ranks=(3, 5))
    exact = compress(sources, CONFIG, "svd", rank=5)
    err, norm = total_error(exact, sources)
    assert err <= 1e-10 * norm
    low = compress(sources, CONFIG, "svd", rank=2)
    for source in sources:
        for m in MODULES:
            dense = [dense_delta(source.adapter, m, l) for l in range(CONFIG.num_layers)]
            rebuilt = [low.delta_weight(source.name, m, l) for l in range(CONFIG.num_layers)]
            want = np.sqrt(sum(np.sum((r - d) ** 2) for r, d in zip(rebuilt, dense)) / sum(np.sum(d**2) for d in dense))
            assert low.errors[source.name][m] == pytest.approx(want, rel=1e-3)
            assert 0 < want < 1


def test_two_clusters_of_shared_subspaces_are_found_and_reconstructed_exactly():
    first = shared_space_sources(3, shared_rank=4, seed=1, name="x")
    second = shared_space_sources(3, shared_rank=4, seed=2, name="y")
    sources = [first[0], second[0], first[1], second[1], first[2], second[2]]
    collection = compress(sources, CONFIG, "jd-full", rank=4, clusters=2)
    labels = dict(zip(collection.names, collection.cluster))
    assert len({labels[s.name] for s in first}) == 1 and len({labels[s.name] for s in second}) == 1
    assert labels["x0"] != labels["y0"]
    err, norm = total_error(collection, sources)
    assert err <= 1e-10 * norm
    one_basis = compress(sources, CONFIG, "jd-full", rank=4, clusters=1)
    assert total_error(one_basis, sources)[0] > 1e-2 * norm  # one 4-dim basis cannot hold both


def test_save_load_round_trip_and_manifest(tmp_path):
    sources = random_sources(5, seed=3)
    collection = compress(sources, CONFIG, "jd-diag", rank=6, clusters=2, base_model="tiny")
    store.save(collection, str(tmp_path))
    loaded = store.load(str(tmp_path))
    assert loaded.names == collection.names and loaded.method == "jd-diag" and loaded.rank == 6
    np.testing.assert_array_equal(loaded.cluster, collection.cluster)
    for source in sources:
        np.testing.assert_array_equal(loaded.delta_weight(source.name, "o_proj", 1),
                                      collection.delta_weight(source.name, "o_proj", 1))
    manifest = json.load(open(tmp_path / "manifest.json"))
    assert manifest["clusters"] == 2 and manifest["base_model"] == "tiny"
    assert set(manifest["adapters"][0]["errors"]) == set(MODULES)
    assert len(manifest["adapters"][0]["sha256"]) == 64
    assert manifest["parameters"] < source_parameter_count(sources)


def test_a_corrupt_collection_is_refused_with_the_file_named(tmp_path):
    collection = compress(random_sources(3, seed=4), CONFIG, "jd-full", rank=3)
    store.save(collection, str(tmp_path))
    manifest = json.load(open(tmp_path / "manifest.json"))
    manifest["rank"] = 4
    json.dump(manifest, open(tmp_path / "manifest.json", "w"))
    with pytest.raises(store.CollectionError, match="q_proj.basis_in"):
        store.load(str(tmp_path))
    with open(tmp_path / "tensors.safetensors", "wb") as f:
        f.write(b"not safetensors")
    with pytest.raises(store.CollectionError, match="tensors.safetensors"):
        store.load(str(tmp_path))
    with pytest.raises(store.CollectionError, match="not found"):
        store.load(str(tmp_path / "missing"))


def test_adding_projects_on_the_existing_bases_and_recompression_redoes_them():
    shared = shared_space_sources(5, shared_rank=4, seed=5)
    collection = compress(shared[:4], CONFIG, "jd-full", rank=4)
    outsider = random_sources(1, seed=6)[0]
    grown = add(collection, [shared[4], outsider], CONFIG)
    assert grown.names[-2:] == ["sh4", "ad0"]
    # in the span of the bases: exact (the reported error, ||ΔW||^2 - ||Σ||^2 in float32, has a
    # floor of about sqrt(float32 eps))
    assert max(grown.errors["sh4"].values()) < 2e-3
    err, norm = total_error(grown, shared[4:])
    assert err <= 1e-10 * norm
    assert min(grown.errors["ad0"].values()) > 0.5  # a random adapter is mostly outside them
    err, norm = total_error(grown, shared)
    assert err <= 1e-8 * norm  # the members did not move
    rebuilt = grown.delta_weight("ad0", "q_proj", 0)
    dense = dense_delta(outsider.adapter, "q_proj", 0)
    assert 0.5 < np.linalg.norm(rebuilt - dense) / np.linalg.norm(dense) < 1
    redone = recompress(collection, shared[:4], [outsider], CONFIG)
    assert redone.names == grown.names[:4] + ["ad0"]
    assert redone.errors["ad0"]["q_proj"] < grown.errors["ad0"]["q_proj"]
    changed = [dataclasses.replace(shared[0], adapter=random_sources(1, seed=7)[0].adapter)] + shared[1:4]
    changed[0].adapter.name = "sh0"
    with pytest.raises(AdapterError, match="'sh0' has changed"):
        recompress(collection, changed, [], CONFIG)


def test_mismatched_adapters_are_refused_naming_the_adapter():
    sources = random_sources(3, seed=8)
    other_modules = random_sources(1, seed=9, modules=("q_proj", "k_proj"))[0]
    other_modules.adapter.name = "odd_modules"
    with pytest.raises(AdapterError, match="'odd_modules' targets"):
        compress(sources + [other_modules], CONFIG, "jd-full", rank=3)
    wider = LlamaConfig(**{**CONFIG.__dict__, "hidden_size": 40, "head_dim": 10, "num_heads": 4})
    other_shape = random_sources(1, seed=10, config=wider)[0]
    other_shape.adapter.name = "odd_shape"
    with pytest.raises(AdapterError, match="'odd_shape': q_proj has"):
        compress(sources + [other_shape], CONFIG, "svd", rank=3)
    other_base = Source(sources[0].adapter, base_model="another-model")
    with pytest.raises(AdapterError, match="'ad0' was trained on base model 'another-model'"):
        compress([other_base] + sources[1:], CONFIG, "jd-diag", rank=3, base_model="tiny")
    with pytest.raises(ValueError, match="rank must be in"):
        compress(sources, CONFIG, "jd-full", rank=31)  # q/o_proj are 30 x 30
    with pytest.raises(ValueError, match="unknown compression method"):
        compress(sources, CONFIG, "pca", rank=3)
