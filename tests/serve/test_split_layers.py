"""`EngineConfig.split_layers` (issue 35): an engine whose decoder layers' weights are arrays of their own
(`jaxlora.models.llama.split_layers`, every forward unrolled over them) gives the greedy tokens of the
stacked engine, adapter window included, and says no to what it does not serve."""
import pytest

from jaxlora.models.llama import SplitLayersLlama
from serve.engine import Engine, EngineConfig
from tests.serve.test_background_compile import TINY_ENGINE, _serve


def _engine(smollm2, adapters8, **config):
    model, tokenizer = smollm2
    return Engine(model, tokenizer.eos_token_ids, EngineConfig(**TINY_ENGINE, **config),
                  {name: adapters8[name] for name in ("ad0", "ad1")})


def test_split_layers_engine_gives_the_stacked_engines_tokens(smollm2, adapters8, monkeypatch):
    model, tokenizer = smollm2
    stacked = _engine(smollm2, adapters8, adapter_window=2)
    split = _engine(smollm2, adapters8, adapter_window=2, split_layers=True)
    assert isinstance(split.model_view(), SplitLayersLlama) and type(model) is not SplitLayersLlama  # the caller's stays
    names = set(split.weight_variables())
    assert not any(name.startswith("layers.") for name in names)
    assert any(name.startswith("layer_0.") and name.endswith("window_b") for name in names)  # the window, split
    assert not split.programs.stand_ins()
    assert _serve(split, tokenizer) == _serve(stacked, tokenizer)
    assert split.stats.window_fills > 0  # the window's fills wrote the per-layer arrays
    # the first programs compile on up to 8 threads (split layers too: 16 were slower on an H200's 16
    # cores); never more than the cores this process may use
    for cores, want_split, want_stacked in ((64, 8, 8), (12, 8, 8), (2, 2, 2)):
        monkeypatch.setattr("os.sched_getaffinity", lambda pid, n=cores: set(range(n)), raising=False)
        assert (split.builder.compile_threads(), stacked.builder.compile_threads()) == (want_split, want_stacked)


def test_split_layers_rejects_what_it_does_not_serve(smollm2, adapters8):
    with pytest.raises(ValueError, match="unmerged"):
        EngineConfig(split_layers=True, inference_mode="merged")
    split = _engine(smollm2, adapters8, split_layers=True)
    with pytest.raises(NotImplementedError, match="paged forward"):
        split.model_view()(None, None)


def test_split_layers_refuses_fine_tuning(smollm2, adapters8, tmp_path):
    from serve.finetune import check_engine

    split = _engine(smollm2, adapters8, split_layers=True, adapter_dir=str(tmp_path))
    with pytest.raises(ValueError, match="split-layers"):
        check_engine(split)


def test_cli_flag_reaches_the_engine_config():
    from serve.cli import build_parser, engine_config

    for argv, split in (([], False), (["--split-layers"], True)):
        args = build_parser().parse_args(["--model", "unused", "--lora-backend", "gather", *argv])
        assert engine_config(args, 16, 256, None).split_layers is split


def test_split_layers_scores_prompts_as_the_stacked_engine(smollm2, adapters8):
    """Prompt log-probabilities (a scoring step: no scanned bucket exists with split layers, so it runs in
    the largest) equal the stacked engine's."""
    from jaxlora.sampling import SamplingParams

    model, tokenizer = smollm2
    prompt = tokenizer.encode("The capital of France is")

    def scored(engine):
        events = []
        engine.submit(0, prompt, "ad0", SamplingParams(2, prompt_logprobs=2), events.append)
        engine.run_until_idle()
        return [e.prompt_logprobs for e in events if e.prompt_logprobs is not None]

    split, stacked = scored(_engine(smollm2, adapters8, split_layers=True)), scored(_engine(smollm2, adapters8))
    assert split and len(split[0]) == len(stacked[0]) == len(prompt) - 1
    for (token, logprob, top), (want_token, want_logprob, want_top) in zip(split[0], stacked[0]):
        assert token == want_token and [i for i, _ in top] == [i for i, _ in want_top]
        assert abs(logprob - want_logprob) < 1e-4


def test_split_layers_leave_the_decode_variant_to_the_background(tmp_path):
    """With split layers the decode-only LoRA programs are not among the first (every program is
    unrolled: each costs seconds of a cold start): while the background compile runs, a decode step of
    LoRA rows runs the mixed LoRA variant (the same tokens, nothing compiled while serving)."""
    from jaxlora.lora.adapter import random_adapter
    from jaxlora.lora.adapter_config import LoraConfig
    from jaxlora.weights import load_llama
    from tests.jaxlora.hf_checkpoints import save_random_model, tiny_llama_config
    from tests.serve.test_background_compile import hold_background
    from tests.serve.test_warm_start import ENGINE, serve

    directory = str(tmp_path / "model")
    save_random_model(tiny_llama_config(), directory)
    model = load_llama(directory)
    adapters = {f"ad{i}": random_adapter(f"ad{i}", model.config, LoraConfig(r=8, target_modules=("q_proj", "v_proj")),
                                         seed=i, b_std=0.2) for i in range(2)}
    kernels = dict(ENGINE, lora_backend="hybrid", adapter_window=0)  # LoRA steps on the kernels: a decode-only variant
    expected = serve(Engine(model, (2,), EngineConfig(**kernels), adapters), model.config.vocab_size)
    split = Engine(model, (2,), EngineConfig(**kernels, split_layers=True, background_compile=True), adapters)
    release = hold_background(split)
    split.warmup()
    decode_variant = {s for s in split.step_shapes() if s.program == "forward" and s.decode_only}
    assert decode_variant and not decode_variant & set(split.programs.shapes())
    seen, step_fn = [], split.step_fn
    split.step_fn = lambda step, cache: (seen.append(step.shapes[0]), step_fn(step, cache))[1]
    try:
        assert serve(split, model.config.vocab_size) == expected
        assert split.stats.step_compiles == 0
        lora = [s for s in seen if s.lora]
        assert lora and not any(s.decode_only for s in lora)
    finally:
        split.stop()  # the background compile ends between two programs
        release.set()
        split.startup.background.join(timeout=600)
    # once the background is done, decode steps take the decode-only variant again (`decode_variant`:
    # the stacked engine's path, tests/serve/test_engine.py::test_accelerator_token_buckets_...)
