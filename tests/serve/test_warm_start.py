"""The server's warm start (`serve.warm_start`, issue 35): an engine built on zero weights whose step
programs load while the checkpoint is written into its arrays holds the weights of an engine built
on the loaded model, bit for bit (packed, windowed, biases, fused files, tied embeddings), serves
the same tokens, and compiles nothing once serving; `jaxlora-serve` takes it for a HF directory and
a bad checkpoint still exits with the file's name."""

import os
import time

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.models.packed import pack_projections
from jaxlora.sampling import SamplingParams
from jaxlora.weights import load_llama
from jaxlora.weights.fill import fill_weights
from serve import warm_start
from serve.engine import Engine, EngineConfig
from serve.placement import Handover
from tests.jaxlora.hf_checkpoints import save_random_model, tiny_llama_config, tiny_phi3_config, tiny_qwen2_config

ENGINE = dict(page_size=8, num_pages=16, max_model_len=32, max_num_seqs=4, token_budget=32, prefill_chunk=16,
              max_lora_rank=8, max_adapters_on_device=2)
CONFIGS = {"llama": tiny_llama_config, "phi3": tiny_phi3_config, "qwen2": tiny_qwen2_config}


def loaded_engine(directory: str, dtype, config: EngineConfig, adapters=None) -> Engine:
    """The engine built on the loaded model (the start-up before)."""
    return Engine(pack_projections(load_llama(directory, dtype)), (2,), config, adapters)


def warm_engine(directory: str, dtype, config: EngineConfig, adapters=None) -> Engine:
    """The engine built on zero weights, its programs started, the checkpoint written in."""
    model, plan = warm_start.placeholder_model(directory, dtype)
    engine = Engine(pack_projections(model), (2,), config, adapters, handover=Handover.ZEROS)  # as jaxlora-serve
    warm_start.load_into(engine, plan, time.perf_counter(), jnp.dtype(dtype).name)
    return engine


@pytest.mark.parametrize("family", sorted(CONFIGS) + ["llama, a float16 layer"])
def test_the_written_weights_are_the_loaded_ones(tmp_path, family):
    directory = str(tmp_path / "model")
    save_random_model(CONFIGS[family.split(",")[0]](), directory)
    if "float16" in family:  # one layer's tensor in another dtype: widened like the loader's
        from tests.jaxlora.test_parallel_read import cast_file

        cast_file(directory, np.float16, only="model.layers.0.mlp.down_proj.weight")  # the first
    for dtype in (jnp.float32, jnp.bfloat16):
        config = EngineConfig(**ENGINE, background_compile=False)
        model, plan = warm_start.placeholder_model(directory, dtype)
        after = Engine(pack_projections(model), (2,), config)
        fill_weights(plan, after.weight_variables())  # `load_into` without the programs (the test below)
        old, new = loaded_engine(directory, dtype, config).weight_variables(), after.weight_variables()
        assert set(old) == set(new) and any("window" in key for key in new)  # the adapter window's columns too
        for key in old:
            a, b = np.asarray(old[key][...]), np.asarray(new[key][...])
            assert a.dtype == b.dtype and a.shape == b.shape, key
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=key)


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_split_layers_are_written_as_the_loaded_engines(tmp_path, family):
    """With `EngineConfig.split_layers` each stacked weight's layer goes into its own array: the same
    bits as the split engine built on the loaded model."""
    directory = str(tmp_path / "model")
    save_random_model(CONFIGS[family](), directory)
    config = EngineConfig(**ENGINE, background_compile=False, split_layers=True)
    model, plan = warm_start.placeholder_model(directory, jnp.bfloat16)
    after = Engine(pack_projections(model), (2,), config)
    fill_weights(plan, after.weight_variables(), split_layers=True)
    old, new = loaded_engine(directory, jnp.bfloat16, config).weight_variables(), after.weight_variables()
    assert set(old) == set(new) and any(key.startswith("layer_1.") for key in new)
    for key in old:
        np.testing.assert_array_equal(np.asarray(old[key][...]).view(np.uint8), np.asarray(new[key][...]).view(np.uint8),
                                      err_msg=key)
    with pytest.raises(KeyError):  # the stacked names are not there to write
        fill_weights(plan, after.weight_variables())


@pytest.mark.parametrize("split", [False, True])
def test_the_engine_frees_the_placeholder_it_takes_and_remakes_its_zeros(tmp_path, split, monkeypatch):
    """`Handover.ZEROS`: once the engine's layout is final, the caller's placeholder arrays it does not
    hold are deleted (the adapter window's widened kernels and split layers' copies replace them), so
    the device holds what an engine holds whose caller dropped its model; the engine's weights are
    zeros of the same shapes and dtypes, written by `fill_weights` as before (tests above)."""
    import gc
    import weakref

    import jax

    directory = str(tmp_path / "model")
    save_random_model(tiny_llama_config(), directory)
    config = EngineConfig(**{**ENGINE, "num_pages": None}, background_compile=False, split_layers=split)

    def live_bytes() -> int:
        gc.collect()
        return sum(array.nbytes for array in jax.live_arrays())

    before = live_bytes()
    given = pack_projections(warm_start.placeholder_model(directory, jnp.bfloat16)[0])
    kept = Engine(given, (2,), config)
    held = live_bytes() - before  # the caller's model still holds the kernels the engine replaced
    del given
    dropped = live_bytes() - before
    assert dropped < held
    shapes = {key: (v[...].shape, v[...].dtype) for key, v in kept.weight_variables().items()}
    del kept
    placeholder = warm_start.placeholder_model(directory, jnp.bfloat16)[0]
    unpacked = [weakref.ref(array) for array in jax.tree.leaves(nnx.state(placeholder))]
    sized = []
    monkeypatch.setattr("serve.engine.kv_pages_that_fit", lambda *args: sized.append(
        sum(ref() is not None and not ref().is_deleted() for ref in unpacked)))  # None: the CPU's default pages
    gc.disable()  # the collector's own timing decides nothing here (on an H200 it moved the pages by 4k)
    try:
        given = pack_projections(placeholder)  # as jaxlora-serve: the unpacked model is left to the collector
        del placeholder
        taken = Engine(given, (2,), config, handover=Handover.ZEROS)
    finally:
        gc.enable()
    assert sized == [0]  # the pages are sized with no array of the unpacked placeholder left
    assert live_bytes() - before == dropped  # though `given` is still referenced here
    assert any(array.is_deleted() for array in jax.tree.leaves(nnx.state(given)))
    weights = taken.weight_variables()
    assert {key: (v[...].shape, v[...].dtype) for key, v in weights.items()} == shapes
    assert all(not np.asarray(v[...]).any() for v in weights.values())


def serve(engine: Engine, vocab: int) -> list[list[int]]:
    """Greedy tokens of four requests (two on ad0, one on ad1, one on the base model)."""
    rng = np.random.default_rng(0)
    got = {i: [] for i in range(4)}
    for i, name in enumerate(["ad0", "ad1", None, "ad0"]):
        prompt = [int(t) for t in rng.integers(3, vocab, 5 + 3 * i)]
        engine.submit(i, prompt, name, SamplingParams(6), lambda e, i=i: got[i].append(e))
    engine.run_until_idle()
    return [[e.token for e in got[i] if e.token is not None] for i in range(4)]


def test_the_warm_start_serves_the_same_tokens_and_compiles_nothing_while_serving(tmp_path):
    directory = str(tmp_path / "model")
    save_random_model(tiny_llama_config(), directory)
    model_config = load_llama(directory).config
    adapters = {f"ad{i}": random_adapter(f"ad{i}", model_config, LoraConfig(r=8, target_modules=("q_proj", "v_proj",
                "gate_proj")), seed=i, b_std=0.2) for i in range(2)}
    reference = loaded_engine(directory, jnp.float32, EngineConfig(**ENGINE), adapters)
    reference.warmup()
    expected = serve(reference, model_config.vocab_size)
    for split in (False, True):  # stacked layers (the default) and split ones (`--split-layers`)
        config = EngineConfig(**ENGINE, scan_layers_from_tokens=16, background_compile=True,  # the GPU's start-up
                              split_layers=split)
        engine = warm_engine(directory, jnp.float32, config, adapters)
        info = engine.warmup()  # waits for the programs `load_into` started
        assert info["programs"] > 0 and info["background"] > 0
        try:
            assert serve(engine, model_config.vocab_size) == expected
            assert engine.stats.step_compiles == 0
        finally:
            engine.stop()
            engine.startup.background.join(timeout=600)
        assert engine.stats.step_compiles == 0


@pytest.mark.parametrize("split", [False, True])
def test_jaxlora_serve_takes_the_warm_start_and_names_a_bad_file(tmp_path, caplog, split):
    from serve.cli import build_app, build_parser

    directory = str(tmp_path / "model")
    save_random_model(tiny_llama_config(), directory)
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "</s>": 2}, unk_token="<unk>")).save(
        os.path.join(directory, "tokenizer.json"))
    argv = ["--model", directory, "--compile-cache", "", "--max-model-len", "32", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "32", "--background-compile", "on"] + (["--split-layers"] if split else [])
    with caplog.at_level("INFO", logger="jaxlora.serve"):
        app = build_app(build_parser().parse_args(argv))
    messages = [record.getMessage() for record in caplog.records]
    assert any(m.startswith("model planned (headers read, zero weights)") for m in messages)
    assert any(m.startswith("model loaded in") for m in messages)
    engine = app.state.server.engine
    assert engine.config.split_layers is split
    engine.warmup()
    engine.stop()
    engine.startup.background.join(timeout=600)  # no compile left running at the interpreter's exit
    weights = os.path.join(directory, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(SystemExit, match=r"model\.safetensors: cannot read safetensors \(truncated or corrupt\?\)"):
        build_app(build_parser().parse_args(argv))


def test_stored_executables_are_loaded_without_a_trace_and_serve_the_same_tokens(tmp_path):
    from serve.executables import ExecutableStore

    directory = str(tmp_path / "model")
    save_random_model(tiny_llama_config(), directory)
    model_config = load_llama(directory).config
    adapters = {f"ad{i}": random_adapter(f"ad{i}", model_config, LoraConfig(r=8, target_modules=("q_proj", "v_proj")),
                                         seed=i, b_std=0.2) for i in range(2)}
    config = EngineConfig(**ENGINE, background_compile=False)
    reference = loaded_engine(directory, jnp.float32, config, adapters)
    reference.warmup()
    expected = serve(reference, model_config.vocab_size)

    def stored_engine() -> Engine:
        engine = loaded_engine(directory, jnp.float32, config, adapters)
        engine.programs.store = ExecutableStore(str(tmp_path / "executables"))
        engine.warmup()
        return engine

    for run in range(2):  # the first stores every program, the second loads them all
        engine = stored_engine()
        store, programs = engine.programs.store, len(engine.programs)
        assert (store.hits, store.misses) == ((programs, 0) if run else (0, programs))
        assert run == 0 or engine.programs.lower_s == 0  # nothing traced
        assert serve(engine, model_config.vocab_size) == expected and engine.stats.step_compiles == 0
    for path in (tmp_path / "executables").iterdir():  # a file that does not load is compiled again
        path.write_bytes(b"not an executable")
    engine = stored_engine()
    assert engine.programs.store.hits == 0 and serve(engine, model_config.vocab_size) == expected
