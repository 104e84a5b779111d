"""The engine: continuous batching over 8 adapters + base equals merged-weight generation, also
with fewer device slots than adapters (eviction and reload), and seeded sampling is batch-independent."""

import dataclasses

import pytest

from jaxlora.generate import generate
from jaxlora.models.merge import merge_adapter
from jaxlora.sampling import SamplingParams
from serve.engine import Engine, EngineConfig, Event
from tests.serve.conftest import SMALL_ENGINE, exact_weights

MAX_TOKENS = 8
TOPICS = ["The capital of France is", "My favourite food is", "Once upon a time", "The best way to learn is",
          "Water boils at", "In 1492,", "The quick brown fox", "Dear diary, today"]


def _requests(tokenizer):
    """32 (prompt ids, adapter name or None) pairs over ad0..ad7 and the base model."""
    names = [f"ad{i}" for i in range(8)] + [None]
    return [(tokenizer.encode(f"{TOPICS[i % 8]}{' so' * (i // 8)}"), names[i % 9]) for i in range(32)]


@pytest.fixture(scope="module")
def expected(smollm2, adapters8):
    """Greedy outputs of each request generated with its adapter merged into the weights (one
    batch per adapter: batched generation equals one at a time, tests/jaxlora/test_generate.py)."""
    model, tokenizer = smollm2
    requests = _requests(tokenizer)
    outputs = [None] * len(requests)
    params = SamplingParams(max_new_tokens=MAX_TOKENS)
    for name in sorted({n for _, n in requests}, key=str):
        rows = [i for i, (_, n) in enumerate(requests) if n == name]
        with exact_weights(model):
            if name is not None:
                merge_adapter(model, adapters8[name])
            batch = generate(model, [requests[i][0] for i in rows], params, tokenizer.eos_token_ids)
            for i, output in zip(rows, batch):
                outputs[i] = output
    return requests, outputs


def _serve_all(engine, requests, options=SamplingParams(MAX_TOKENS)):
    got = {i: [] for i in range(len(requests))}
    for i, (prompt, name) in enumerate(requests):
        engine.submit(i, prompt, name, options, lambda e, i=i: got[i].append(e))
    engine.run_until_idle()
    for events in got.values():
        assert events[-1].finish_reason in ("stop", "length")
    return [[e.token for e in got[i] if e.token is not None] for i in range(len(requests))]


@pytest.mark.parametrize("slots", [8, 3])
def test_continuous_batching_equals_merged_generation(smollm2, adapters8, expected, slots):
    model, tokenizer = smollm2
    requests, outputs = expected
    assert len({tuple(o) for o in outputs}) > 20  # the adapters really change the outputs
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(max_adapters_on_device=slots, **SMALL_ENGINE),
                    adapters8)
    initial = engine.free_pages
    assert _serve_all(engine, requests) == outputs
    assert engine.free_pages == initial and engine.stats.steps > MAX_TOKENS
    assert engine.stats.adapter_loads == 8  # queued requests of resident adapters go first: one load each
    placed = engine.slot_adapters()
    assert len(placed) == slots and None not in placed and set(placed) <= set(adapters8)
    if slots < 8:  # a second wave needs adapters that were evicted: loaded again, same outputs
        assert _serve_all(engine, requests[:9]) == outputs[:9]
        assert engine.stats.adapter_loads >= 8 + 9 - slots


@pytest.mark.parametrize("slots, window", [(4, 2), (2, 2)])
def test_adapter_window_steps_equal_merged_generation(smollm2, adapters8, expected, slots, window):
    """Steps whose adapters fit the adapter window run through it (no LoRA kernel), the others
    through the LoRA backend; with as many pool slots as window slots, every adapter load rewrites
    a pool slot the window holds a copy of (the stale copy is replaced before use). Greedy tokens
    of the merged weights either way."""
    model, tokenizer = smollm2
    requests, outputs = expected
    config = EngineConfig(max_adapters_on_device=slots, adapter_window=window, **SMALL_ENGINE)
    engine = Engine(model, tokenizer.eos_token_ids, config, adapters8)
    assert engine.window is not None and engine.window.slots == window
    assert _serve_all(engine, requests) == outputs
    kinds = {kind.split()[0] for kind in engine.stats.kind_steps}
    assert "window" in kinds and ("lora" in kinds) == (slots > window)
    assert engine.stats.window_fills >= (8 if slots == window else 1)


def test_seeded_sampling_does_not_depend_on_the_batch(smollm2, adapters8):
    model, tokenizer = smollm2
    requests = _requests(tokenizer)[:6]
    options = SamplingParams(MAX_TOKENS, temperature=0.8, top_p=0.9, seed=7)
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(max_adapters_on_device=8, **SMALL_ENGINE), adapters8)
    together = _serve_all(engine, requests, options)
    alone = [_serve_all(engine, [r], options)[0] for r in requests[:2]]
    assert together[:2] == alone
    greedy = _serve_all(engine, requests[:2])
    assert together[:2] != greedy


def test_aborted_request_frees_its_pages(smollm2):
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(**SMALL_ENGINE))
    events = []
    engine.submit("r", tokenizer.encode("Count: 1, 2, 3,"), None, SamplingParams(60), events.append)
    for _ in range(3):
        engine.step()
    assert engine.free_pages < SMALL_ENGINE["num_pages"]
    engine.abort("r")
    engine.step()
    assert engine.free_pages == SMALL_ENGINE["num_pages"] and events[-1].finish_reason == "abort"
    assert not engine.scheduler.has_work()


def test_early_abort_drops_late_waiting_requests_and_keeps_running_ones(smollm2):
    model, tokenizer = smollm2
    config = EngineConfig(**{**SMALL_ENGINE, "max_num_seqs": 1}, ttft_slo_s=3600.0)
    engine = Engine(model, tokenizer.eos_token_ids, config)
    events = {name: [] for name in ("first", "second")}
    for name in events:
        engine.submit(name, tokenizer.encode("Count: 1, 2, 3,"), None, SamplingParams(6), events[name].append)
    engine.step()  # "first" runs; "second" waits (one row per step)
    engine.config = dataclasses.replace(config, ttft_slo_s=1e-6)  # now nothing waiting can meet it
    engine.run_until_idle()
    assert events["second"] == [Event(None, "overloaded", events["second"][0].error)]
    assert "time-to-first-token" in events["second"][0].error
    assert events["first"][-1].finish_reason in ("stop", "length") and len(events["first"]) > 1
    assert engine.stats.dropped == 1 and engine.free_pages == SMALL_ENGINE["num_pages"]


def test_failed_step_fails_its_requests_and_the_engine_keeps_serving(smollm2, monkeypatch):
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(**SMALL_ENGINE))
    real_step = engine.step_fn

    def broken(*args):
        raise RuntimeError("device on fire")

    monkeypatch.setattr(engine, "step_fn", broken)
    events = []
    engine.submit("a", tokenizer.encode("Hi"), None, SamplingParams(4), events.append)
    engine.run_until_idle()
    assert events[-1].finish_reason == "error" and "device on fire" in events[-1].error
    assert engine.free_pages == SMALL_ENGINE["num_pages"]
    monkeypatch.setattr(engine, "step_fn", real_step)
    events.clear()
    engine.submit("b", tokenizer.encode("Hi"), None, SamplingParams(4), events.append)
    engine.run_until_idle()
    assert events[-1].finish_reason in ("stop", "length") and len(events) >= 1


def test_full_queue_and_bad_requests_are_refused(smollm2, adapters8):
    from serve.engine import EngineBusy, RequestError, UnknownAdapter

    model, tokenizer = smollm2
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(max_waiting=2, **SMALL_ENGINE),
                    {"ad0": adapters8["ad0"]})
    noop = lambda event: None
    for i in range(2):
        engine.submit(i, [1, 2], "ad0", SamplingParams(4), noop)
    with pytest.raises(EngineBusy):
        engine.submit(2, [1, 2], None, SamplingParams(4), noop)
    with pytest.raises(UnknownAdapter):
        engine.submit(3, [1, 2], "nope", SamplingParams(4), noop)
    with pytest.raises(RequestError, match="context"):
        engine.submit(4, [1] * SMALL_ENGINE["max_model_len"], None, SamplingParams(4), noop)
    with pytest.raises(RequestError, match="max_tokens"):
        engine.submit(5, [1, 2], None, SamplingParams(SMALL_ENGINE["max_model_len"]), noop)
    engine.abort(0)
    engine.abort(1)
    engine.run_until_idle()
    assert engine.free_pages == SMALL_ENGINE["num_pages"]


def test_base_only_steps_run_without_the_pool(smollm2, adapters8, expected, monkeypatch):
    """Steps whose rows all use the base model call the model with lora=None (the base model's own
    compiled step) and give the base outputs; steps with an adapter row still get the pool."""
    model, tokenizer = smollm2
    requests, outputs = expected
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(max_adapters_on_device=2, **SMALL_ENGINE),
                    adapters8)
    assert _serve_all(engine, requests[:1]) == outputs[:1]  # ad0 now resident in the pool
    real_step, used_pool = engine.step_fn, []

    def recording(step, cache):
        used_pool.append(step.lora is not None)
        return real_step(step, cache)

    monkeypatch.setattr(engine, "step_fn", recording)
    base = [i for i, (_, name) in enumerate(requests) if name is None]
    steps_before = engine.stats.steps
    assert _serve_all(engine, [requests[i] for i in base]) == [outputs[i] for i in base]
    assert used_pool and not any(used_pool)
    assert engine.stats.base_only_steps == len(used_pool) == engine.stats.steps - steps_before
    used_pool.clear()
    assert _serve_all(engine, requests[:2]) == outputs[:2]  # ad0 and ad1: the pool again
    assert all(used_pool)


def test_pallas_backend_serves_the_same_tokens(smollm2, adapters8, expected):
    """The engine with the SGMV kernels (interpret mode on a CPU) decodes like the XLA path."""
    model, tokenizer = smollm2
    requests, outputs = expected
    engine = Engine(model, tokenizer.eos_token_ids,
                    EngineConfig(max_adapters_on_device=8, lora_backend="pallas", **SMALL_ENGINE), adapters8)
    assert _serve_all(engine, requests[:6]) == outputs[:6]


def test_hybrid_backend_runs_bgmv_and_the_segment_gemm_never_sgmv(smollm2, adapters8, expected, monkeypatch):
    """"hybrid": one-token rows through the BGMV kernels, prefill chunks through the segment GEMM
    (no SGMV call at all); greedy tokens as with the merged weights."""
    import pallas_kernels

    model, tokenizer = smollm2
    requests, outputs = expected
    bgmv_calls = []
    real_bgmv = pallas_kernels.bgmv_lora_grouped

    def no_sgmv(*args, **kwargs):
        raise AssertionError("hybrid ran an SGMV kernel")

    def counting_bgmv(*args, **kwargs):
        bgmv_calls.append(1)
        return real_bgmv(*args, **kwargs)

    monkeypatch.setattr(pallas_kernels, "sgmv_lora_stacked", no_sgmv)
    monkeypatch.setattr(pallas_kernels, "bgmv_lora_grouped", counting_bgmv)
    engine = Engine(model, tokenizer.eos_token_ids,
                    EngineConfig(max_adapters_on_device=8, lora_backend="hybrid", **SMALL_ENGINE), adapters8)
    assert _serve_all(engine, requests[:6]) == outputs[:6]
    assert bgmv_calls, "no decode-only step went through BGMV"


def test_hybrid_segment_window_bounds_the_prompt_chunks_of_a_step(smollm2, adapters8, expected, monkeypatch):
    """With hybrid's segment window at 2 (the engine's is 16) the engine plans 2 segments, its
    scheduler admits prompt chunks of at most 2 adapters a step (a plan with a third would be a
    ValueError), the segment GEMM covers every segment and BGMV only the listed one-token rows;
    the greedy tokens are those of the merged weights."""
    from jaxlora.lora import backends, ops

    monkeypatch.setattr(ops, "SEGMENT_WINDOW", 2)
    monkeypatch.setitem(backends._REGISTRY, "hybrid",
                        dataclasses.replace(backends._REGISTRY["hybrid"], segment_window=2))
    model, tokenizer = smollm2
    requests, outputs = expected
    engine = Engine(model, tokenizer.eos_token_ids,
                    EngineConfig(max_adapters_on_device=8, lora_backend="hybrid", adapter_window=0, **SMALL_ENGINE),
                    adapters8)
    assert engine._num_segments == 2 and engine.scheduler.config.max_prefill_adapters == 2
    assert _serve_all(engine, requests[:12]) == outputs[:12]


def test_pallas_steps_use_the_serving_plan_without_recompiling(smollm2, adapters8, expected, monkeypatch):
    """With a Pallas backend every LoRA step gets a `ServingPlan` (rows ordered once on the host):
    mixed prefill + decode steps with SGMV segments and decode-only steps without; base-model
    requests in the same batch; greedy tokens as with the merged weights; and no step compiles
    beyond one variant per (tokens, block-table width, decode-only) bucket."""
    from jaxlora.lora.plan import ServingPlan

    model, tokenizer = smollm2
    requests, outputs = expected
    picked = [0, 8, 3, 12, 17, 5, 26]  # ad0, base, ad3, ad3, base, ad5, base
    engine = Engine(model, tokenizer.eos_token_ids,
                    EngineConfig(max_adapters_on_device=4, lora_backend="pallas", adapter_window=0, **SMALL_ENGINE),
                    adapters8)
    real_step, seen = engine.step_fn, []
    lora_programs = lambda: sum(shape.lora for shape in engine.programs.shapes())

    def recording(step, cache):
        if step.lora is not None:
            plan = step.lora.plan
            assert isinstance(plan, ServingPlan)
            seen.append((step.batch.tokens.shape, step.batch.block_tables.shape, plan.seg_starts is None,
                         step.sampling is not None))
        return real_step(step, cache)

    monkeypatch.setattr(engine, "step_fn", recording)
    compiled_before = lora_programs()
    assert _serve_all(engine, [requests[i] for i in picked]) == [outputs[i] for i in picked]
    decode_only = [key[2] for key in seen]
    assert any(decode_only) and not all(decode_only)
    assert lora_programs() - compiled_before <= len(set(seen)) < len(seen)


class _HeldCopy:
    """A prefetch copy that reports itself not done until `release` is set (then the real one's)."""

    def __init__(self, real, release):
        self.real, self.release = real, release

    def done(self) -> bool:
        return self.release.is_set() and self.real.done()

    def result(self):
        self.release.wait(timeout=60)
        return self.real.result()


@pytest.mark.parametrize("slots, rows, pinned, max_bytes", [(8, 4, False, None), (3, 2, False, None),
                                                            (3, 2, True, None), (8, 4, True, 1)])
def test_prefetched_adapters_copy_in_the_background(smollm2, adapters8, expected, monkeypatch, slots, rows, pinned,
                                                    max_bytes):
    """Adapters of queued requests (few rows per step: requests queue) are copied to the device
    while steps run (pageable host copies on the prefetch thread; pinned ones by an asynchronous
    copy started on the engine thread) and written into their slots before the first step that
    uses them (here the copies stay not done until a step needs one, so steps run while copies are
    on their way): the same greedy tokens as with the merged weights. With a bound of one byte on
    the copies in flight, at most one copy is issued and not yet written at any time."""
    import threading

    import serve.adapter_copies as copies_module

    model, tokenizer = smollm2
    requests, outputs = expected
    real_start, copies, waited, release = copies_module.start_copy, [], [], threading.Event()
    in_flight = []

    def held_start(pool, prepared, stats):
        copies.append(prepared.name)
        return _HeldCopy(real_start(pool, prepared, stats), release)

    monkeypatch.setattr(copies_module, "start_copy", held_start)
    config = EngineConfig(**{**SMALL_ENGINE, "max_adapters_on_device": slots, "max_num_seqs": rows,
                             "pinned_host_adapters": pinned})
    engine = Engine(model, tokenizer.eos_token_ids, config, adapters8)
    assert engine.pool.pinned is pinned
    engine.background_prefetch = True  # off by default on a CPU backend
    if max_bytes is not None:
        engine.copies.max_bytes = max_bytes
    real_commit = engine._commit_staged

    def commit(needed):
        staged = engine.copies.staged
        pending = [slot for slot, entry in staged.items() if slot in needed and not (entry.copy and entry.copy.done())]
        waited.extend(pending)
        in_flight.append(sum(entry.copy is not None for entry in staged.values()))
        if pending:
            release.set()
        real_commit(needed)

    engine._commit_staged = commit
    assert _serve_all(engine, requests) == outputs
    assert copies and waited  # prefetched copies, and a step that needed one not done yet
    engine._commit_staged(set())
    assert not engine.copies.staged or all(entry.copy is None or entry.copy.done()
                                           for entry in engine.copies.staged.values())
    if max_bytes is not None:
        assert max(in_flight) == 1
    else:
        assert max(in_flight) >= 1


def test_staged_copy_that_fails_to_start_loads_from_the_host(smollm2, adapters8, expected, monkeypatch):
    """A prefetch copy that cannot start (a device error) is not lost: the slot is loaded from the
    host copy when a step needs it, and the tokens are those of the merged weights."""
    import serve.adapter_copies as copies_module

    model, tokenizer = smollm2
    requests, outputs = expected
    starts = []

    def failing_start(pool, prepared, stats):
        starts.append(prepared.name)
        return copies_module._FailedCopy(RuntimeError("simulated device error"))

    monkeypatch.setattr(copies_module, "start_copy", failing_start)
    config = EngineConfig(**{**SMALL_ENGINE, "max_adapters_on_device": 3, "max_num_seqs": 2,
                             "pinned_host_adapters": True})
    engine = Engine(model, tokenizer.eos_token_ids, config, adapters8)
    engine.background_prefetch = True
    assert _serve_all(engine, requests) == outputs
    assert starts


def test_accelerator_token_buckets_pad_steps_and_serve_the_same_tokens(smollm2, adapters8, expected, monkeypatch):
    """With the GPU/TPU bucket minimums (here 16 tokens a step, 32 for a LoRA step with a prefill
    row; no adapter window, so that LoRA steps run the kernels) every step pads up to them, runs a program of `step_shapes()`, and the greedy tokens are
    those of the merged weights."""
    model, tokenizer = smollm2
    requests, outputs = expected
    config = EngineConfig(max_adapters_on_device=8, lora_backend="hybrid", min_step_tokens=16,
                          min_lora_mixed_tokens=32, adapter_window=0, **SMALL_ENGINE)
    engine = Engine(model, tokenizer.eos_token_ids, config, adapters8)
    shapes = set(engine.step_shapes())
    forwards = [shape for shape in shapes if shape.program == "forward"]
    assert min(shape.tokens for shape in forwards) == 16
    assert min(shape.tokens for shape in forwards if shape.lora and not shape.decode_only) == 32
    real_step, seen = engine.step_fn, []

    def recording(step, cache):
        seen.append(step.shapes[0])
        return real_step(step, cache)

    monkeypatch.setattr(engine, "step_fn", recording)
    assert _serve_all(engine, requests[:6]) == outputs[:6]
    assert set(seen) <= shapes
    assert any(s.lora and s.decode_only for s in seen) and any(s.lora and not s.decode_only for s in seen)


def test_window_mixed_adapters_sends_larger_mixed_steps_to_the_kernels(smollm2, adapters8, expected):
    """With `window_mixed_adapters` 1, steps with a prefill row and more than one adapter run the
    LoRA kernels ("lora mixed") while decode steps of several adapters still use the window
    ("window decode"); the greedy tokens are those of the merged weights either way."""
    model, tokenizer = smollm2
    requests, outputs = expected
    config = EngineConfig(**{**SMALL_ENGINE, "max_adapters_on_device": 8, "adapter_window": 8,
                             "window_mixed_adapters": 1})
    engine = Engine(model, tokenizer.eos_token_ids, config, adapters8)
    assert _serve_all(engine, requests) == outputs
    kinds = engine.stats.steps_by_kind()
    assert "lora mixed" in kinds and "window decode" in kinds
    assert "window mixed" not in kinds or kinds["window mixed"]["steps"] < kinds["lora mixed"]["steps"]
    with pytest.raises(ValueError, match="window_mixed_adapters"):
        EngineConfig(window_mixed_adapters=-1)
