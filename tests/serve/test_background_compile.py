"""Start-up (issue 35): `warmup` with background compiling turns ready after the programs that can
serve any step, steps run in the smallest compiled larger bucket until their own is compiled (no
step waits on a compile), and forwards with scanned layers (from `scan_layers_from_tokens` tokens)
give the tokens of unrolled ones."""

import itertools
import threading

import jax
import pytest

from jaxlora.sampling import SamplingParams
from serve.engine import Engine, EngineConfig
import serve.step
from serve.step import SAMPLERS

# One block-table width (32 tokens = 4 pages) and three token buckets (8, 16, 32): few programs, and
# one (16) that is neither the largest nor the smallest holding every row (`first_shapes`).
TINY_ENGINE = dict(page_size=8, num_pages=16, max_model_len=32, max_num_seqs=4, token_budget=32, prefill_chunk=16,
                   max_lora_rank=8, max_adapters_on_device=2)
PROMPTS = ["The capital of France is", "Once upon a time", "Water boils at", "Dear diary, today"]


def hold_background(engine) -> threading.Event:
    """Makes `engine`'s background compile wait (once `warmup` starts it) until the returned event is set."""
    release, compile_rest = threading.Event(), engine.startup.compile_rest

    def held(shapes):
        release.wait(timeout=300)
        compile_rest(shapes)

    engine.startup.compile_rest = held
    return release


def _serve(engine, tokenizer):
    """Greedy tokens of four requests (two on ad0, one on ad1, one on the base model)."""
    got = {i: [] for i in range(len(PROMPTS))}
    for i, (prompt, name) in enumerate(zip(PROMPTS, ["ad0", "ad1", None, "ad0"])):
        engine.submit(i, tokenizer.encode(prompt), name, SamplingParams(6), lambda e, i=i: got[i].append(e))
    engine.run_until_idle()
    return [[e.token for e in got[i] if e.token is not None] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def expected(smollm2, adapters8):
    """Tokens of an engine that compiled everything first, every forward a scan (the CPU default)."""
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(**TINY_ENGINE),
                    {name: adapters8[name] for name in ("ad0", "ad1")})
    engine.warmup()
    return _serve(engine, tokenizer)


def test_platform_defaults_and_bounds():
    gpu, cpu, tpu = (EngineConfig().for_platform(p) for p in ("gpu", "cpu", "tpu"))
    assert (gpu.scan_layers_from_tokens, gpu.background_compile, gpu.compile_worker) == (512, True, True)
    assert (cpu.scan_layers_from_tokens, cpu.background_compile, cpu.compile_worker) == (1, False, False)
    assert (tpu.background_compile, tpu.compile_worker) == (True, False)  # a TPU opens to one process
    assert EngineConfig(compile_worker=False).for_platform("gpu").compile_worker is False
    with pytest.raises(ValueError, match="scan_layers_from_tokens"):
        EngineConfig(scan_layers_from_tokens=-1)


def test_first_shapes_serve_every_variant_with_scanned_programs(smollm2, adapters8):
    model, tokenizer = smollm2
    config = EngineConfig(**TINY_ENGINE, scan_layers_from_tokens=16)
    engine = Engine(model, tokenizer.eos_token_ids, config, {"ad0": adapters8["ad0"]})
    shapes = engine.step_shapes()
    first = engine.builder.first_shapes(shapes)
    forwards = [s for s in shapes if s.program == "forward"]
    variants = {(s.width, s.lora, s.decode_only, s.window) for s in forwards}
    assert len(variants) >= 3  # base, LoRA, window (and the decode-only LoRA variant where it exists)
    for variant in variants:
        tokens = [s.tokens for s in forwards if (s.width, s.lora, s.decode_only, s.window) == variant]
        for end in (min(tokens), max(tokens)):  # the smallest (a decode step of few rows) and the largest
            assert any((s.width, s.lora, s.decode_only, s.window, s.tokens) == (*variant, end) for s in first)
    fits_all_rows = min(s.tokens for s in forwards if s.tokens >= engine.max_rows)
    assert {s.tokens for s in first if s.program == "forward"} <= {fits_all_rows, max(s.tokens for s in forwards),
                                                                   min(s.tokens for s in forwards)}
    assert {s.rows for s in first if s.program != "forward"} == {s.rows for s in first if s.program == "forward"}
    masked = {name for name in SAMPLERS if name.endswith("_masked")}
    assert masked and {s.program for s in first} == {"forward", *SAMPLERS} - masked  # grammars' samplers: later
    assert len(first) < len(shapes)
    # more rows than the smallest bucket: the smallest (a decode step of few rows) and the one of all rows
    wide = Engine(model, tokenizer.eos_token_ids, EngineConfig(**dict(TINY_ENGINE, max_num_seqs=16, token_budget=64),
                                                               scan_layers_from_tokens=16))
    base = {s.tokens for s in wide.builder.first_shapes(wide.step_shapes()) if s.program == "forward" and not s.lora}
    assert base == {8, 16, 64}  # not 32


def test_steps_run_in_larger_compiled_buckets_until_their_own_is_compiled(smollm2, adapters8, expected, monkeypatch):
    model, tokenizer = smollm2
    # as on a GPU, the stand-ins compile with cuBLAS GEMMs (XLA's CPU compiler takes the option too)
    monkeypatch.setattr(serve.step, "_backend", lambda: "gpu")
    options, compile_lowered = [], jax.stages.Lowered.compile

    def spy(self, compiler_options=None, **kwargs):
        options.append(compiler_options)
        return compile_lowered(self, compiler_options=compiler_options, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", spy)
    config = EngineConfig(**TINY_ENGINE, scan_layers_from_tokens=16, background_compile=True)
    engine = Engine(model, tokenizer.eos_token_ids, config, {name: adapters8[name] for name in ("ad0", "ad1")})
    release = hold_background(engine)  # the background thread waits until the first requests are served
    info = engine.warmup()
    assert info["background"] > 0 and len(engine.programs) < len(engine.step_shapes())
    # the first programs below scan_layers_from_tokens were compiled scanned: stand-ins until the
    # background compiles them unrolled
    stand_ins = engine.programs.stand_ins()
    assert stand_ins and all(s.tokens < 16 and s.program == "forward" for s in stand_ins)
    assert options.count(serve.step.STAND_IN_GPU_OPTIONS) == len(stand_ins)  # only they
    try:
        assert _serve(engine, tokenizer) == expected  # steps ran in stand-ins and larger compiled buckets
        assert engine.stats.step_compiles == 0
    finally:
        release.set()
        engine.startup.background.join(timeout=300)
    assert set(engine.step_shapes()) <= set(engine.programs.shapes())
    assert not engine.programs.stand_ins()  # replaced by their unrolled programs
    assert _serve(engine, tokenizer) == expected  # now in their own (unrolled) 8-token programs
    assert engine.stats.step_compiles == 0


def test_explicit_shapes_compile_in_the_foreground(smollm2):
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(**TINY_ENGINE, background_compile=True))
    shapes = [s for s in engine.step_shapes() if not s.lora][:2]
    info = engine.warmup(shapes, threads=1)
    assert info["background"] == 0 and engine.startup.background is None
    assert set(shapes) <= set(engine.programs.shapes())


def test_background_compile_ends_with_the_scoring_programs(smollm2):
    model, tokenizer = smollm2
    config = EngineConfig(**TINY_ENGINE, scan_layers_from_tokens=16, background_compile=True)
    engine = Engine(model, tokenizer.eos_token_ids, config)
    engine.warmup()
    engine.startup.background.join(timeout=300)
    scoring = [s for s in engine.programs.shapes() if s.score]
    assert scoring and all(s.tokens >= 16 and not s.window and not s.decode_only for s in scoring)
    got = []  # a scoring request (its prompt spans both buckets) compiles nothing now
    engine.submit(0, tokenizer.encode("The capital of France is Paris, and"), None,
                  SamplingParams(2, prompt_logprobs=1), got.append)
    engine.run_until_idle()
    assert got[0].prompt_logprobs and engine.stats.step_compiles == 0


def test_masked_samplers_lead_the_background_compile_and_a_grammar_step_compiles_nothing(smollm2):
    """The structured-output samplers are not among the first programs (a cold start does not wait for
    them) but the first the background thread compiles; once it is done, every sampler is compiled."""
    model, tokenizer = smollm2
    config = EngineConfig(**TINY_ENGINE, scan_layers_from_tokens=16, background_compile=True)
    engine = Engine(model, tokenizer.eos_token_ids, config)
    order, compile_one = [], engine.programs.compile

    def recording(shape, args, scan=None, worker=None):
        order.append((threading.current_thread().name, shape))
        return compile_one(shape, args, scan, worker)

    engine.programs.compile = recording
    engine.warmup()
    engine.startup.background.join(timeout=300)
    foreground = [shape for thread, shape in order if not thread.startswith("jaxlora-compile-background")]
    background = [shape for thread, shape in order if thread.startswith("jaxlora-compile-background")]
    assert foreground and not any(s.program.endswith("_masked") for s in foreground)
    leading = list(itertools.takewhile(lambda shape: shape.program != "forward", background))
    assert leading and {s.program for s in leading} == {name for name in SAMPLERS if name.endswith("_masked")}
    compiled = set(engine.programs.shapes())
    assert all(shape in compiled for shape in engine.step_shapes() if shape.program != "forward")


def test_background_compile_takes_short_gil_turns():
    import sys
    import types

    from serve.step_builder import BACKGROUND_SWITCH_S, StepBuilder, short_gil_turns

    before, seen = sys.getswitchinterval(), []
    fake = types.SimpleNamespace(_compile_rest=lambda *args: seen.append(sys.getswitchinterval()))
    StepBuilder.compile_rest(fake, [], None, lambda: False)
    assert seen == [min(before, BACKGROUND_SWITCH_S)] and seen[0] < 0.005
    assert sys.getswitchinterval() == before  # restored
    with pytest.raises(RuntimeError):
        with short_gil_turns(1e-4):
            assert sys.getswitchinterval() == pytest.approx(1e-4)
            raise RuntimeError
    assert sys.getswitchinterval() == before


def test_samplers_compile_as_soon_as_a_forward_over_their_rows_is(smollm2, monkeypatch):
    """On several threads a sampler (which takes its forward's logits sharding) starts once a forward
    over its rows is compiled, not after the slowest forward (the largest bucket's)."""
    import time

    model, tokenizer = smollm2
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(**TINY_ENGINE))
    shapes = engine.step_shapes()
    largest = max(s.tokens for s in shapes if s.program == "forward")
    events, lock = [], threading.Lock()

    def compile_all(shape_args, threads, progress=None, scan=None, worker=None):
        for shape, _ in shape_args:
            with lock:
                events.append(("start", shape, time.perf_counter()))
            time.sleep(1.0 if shape.program == "forward" and shape.tokens == largest else 0.02)
            with lock:
                events.append(("end", shape, time.perf_counter()))

    monkeypatch.setattr(engine.programs, "compile_all", compile_all)
    engine.builder.compile(shapes, 4, lambda shape: ())
    started = [shape for kind, shape, _ in events if kind == "start"]
    assert sorted(started) == sorted(shapes)  # each once
    at = {(kind, shape): t for kind, shape, t in events}
    slowest = max(at[("end", s)] for s in shapes if s.program == "forward")
    for sampler in (s for s in shapes if s.program != "forward"):
        assert any(at[("end", f)] <= at[("start", sampler)] for f in shapes
                   if f.program == "forward" and f.rows == sampler.rows)
        assert at[("end", sampler)] < slowest


def test_warmup_compiles_the_input_copies_the_steps_use(smollm2, adapters8, expected):
    """With stable step inputs (`serve.step_inputs`, a GPU's default) warmup compiles each forward's
    input copy; the steps then find theirs (no copy compiled while serving) and answer as before."""
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(**TINY_ENGINE, stable_step_inputs=True),
                    {name: adapters8[name] for name in ("ad0", "ad1")})
    engine.warmup()
    forwards = [shape for shape in engine.step_shapes() if shape.program == "forward"]
    assert len(engine.step_inputs._copies) == len(forwards)
    assert _serve(engine, tokenizer) == expected
    held = set(engine.step_inputs._held)
    assert held and held <= set(engine.step_inputs._copies)
