"""Multi-LoRA serving throughput and latency of `serve.engine.Engine` on a Llama-3.1-8B-shaped
model (random bf16 weights), against the same engine serving the base model only, in one run.

    PYTHONPATH=. python bench/serve.py [--layers 32] [--suite all] [--time-budget 520] [--out FILE]
    PYTHONPATH=. python bench/serve.py --tiny          # CPU smoke test (tiny model, few requests)

Workloads (docs/architecture.md, "Benchmark workloads"; no downloads):
  slora   the S-LoRA generator: adapter = floor(n * X), X ~ power(alpha); gamma inter-arrival
          times (mean 1 / rate, coefficient of variation cv); input and output lengths uniform in
          [8, 512). Spec `slora:n=100,alpha=1,cv=1[,rate=4,requests=100,mode=replay]`.
  punica  Punica's popularity cases over the same arrivals and lengths: distinct (one adapter per
          request, at most --max-adapters), uniform (ceil(sqrt(requests)) adapters), skewed
          (Zipf 1.5 over min(requests, --max-adapters) adapters), identical (one adapter).
          Spec `punica:skewed[,requests=...,mode=throughput,...]`.
Modes: `replay` submits each request at its arrival time (wall clock); `throughput` submits all
at t=0 and runs as fast as possible. Suites (`--suite`): `slora` (the default point n=100,
alpha=1, cv=1, then one-at-a-time sweeps n in {1, 20, 1000, 2000}, alpha in {0.1, 0.3, 0.6},
cv in {2, 4}), `punica` (the four cases, throughput mode), `all` (the default point, the Punica
cases, then the sweeps). `--cases` gives specs explicitly. `--time-budget` skips the cases that
would not finish in time (for a device call with a wall-clock limit).

Each case runs the trace twice on fresh engines (same config, same compiled steps): with its
adapters (once per `--lora-backend` given, e.g. `--lora-backend pallas onehot`), and with every
request on the base model (`adapter=None`; the arrivals and lengths do
not depend on the adapter column, so one base run serves every case with the same trace). The
driver calls `Engine.step()` in this thread (no HTTP, no engine thread); TTFT counts from the
scheduled arrival time, so time a request waits for a running step counts as queueing.
Reported: generated tokens/s and requests/s over the makespan (first arrival to last finish),
TTFT and TPOT (per request: (finish - first token) / (tokens - 1)) p50/p90, adapter loads, and
the engine's host time per step phase (`phase_ms_per_step`, see `serve.engine.EngineStats`).
Requests ignore EOS (random weights), so each generates exactly its output length.

Adapters (r=16, alpha=32, all seven projections): every adapter is its own host `LoraAdapter`
(own name, own `ModuleLora` objects, own per-layer scales), registered with `Engine.add_adapter`
and copied into device slots by the engine's normal path (LRU pool, prefetch). To keep host
memory and setup time bounded (one 8B-shaped r=16 adapter is 168 MB in float32; 1000 would be
168 GB), adapter i shares its A/B arrays with weight set i % --weight-sets (random, generated
once) and multiplies its scale by a per-adapter factor in [1, 1.01), so adapters still compute
different functions. Each device load copies the full A/B of the adapter, as for any adapter.
Only the adapters a trace requests are registered (unrequested ones would only sit in a dict).

Compilation: the engine buckets each step's shape (tokens, block-table width; with a Pallas
backend also decode-only or not, see `serve.engine`); before the cases `Engine.warmup` compiles
every program variant (`Engine.step_shapes`, in parallel threads), and each run's fresh engine
warms up again from JAX's in-process caches, so no timed run compiles. `compiles_in_run` in the
JSON says if one did anyway (programs a step had to compile).

Writes JSON (device, jax version, date, settings, results) to --out after every case, and a PNG
next to it when matplotlib is importable.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable

# Run as a script, this file's folder comes first on sys.path and its name would hide the
# `serve` package: look it up from the repository root instead.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlora.lora import backends as lora_backends
from jaxlora.lora.adapter import LoraAdapter, ModuleLora, random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.nn.model_config import PROJECTIONS, LlamaConfig
from jaxlora.models.llama import Llama
from jaxlora.models.presets import llama8b_config
from jaxlora.sampling import SamplingParams
from jaxlora.scheduler.serving import SCHEDULE_POLICIES, CostPolicy, ModePolicy, Sequence, StepPlan, StepRow, pages_for
from serve.engine import Engine, EngineConfig, Event

LORA = LoraConfig(r=16, lora_alpha=32, target_modules=PROJECTIONS)


# ---- workloads ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    kind: str  # "slora" | "punica"
    mode: str  # "replay" | "throughput"
    requests: int
    rate: float
    cv: float
    n: int = 0  # slora: number of adapters
    alpha: float = 1.0  # slora: power-law exponent
    popularity: str = ""  # punica: distinct | uniform | skewed | identical

    @property
    def name(self) -> str:
        if self.kind == "slora":
            head = f"slora n={self.n} a={self.alpha:g} cv={self.cv:g}"
        else:
            head = f"punica {self.popularity}"
        return f"{head} ({self.mode}, {self.requests} req" + (f" @ {self.rate:g}/s)" if self.mode == "replay" else ")")


@dataclasses.dataclass
class Trace:
    arrivals: np.ndarray  # seconds from the first arrival (0 for every request in throughput mode)
    prompt_lens: np.ndarray
    output_lens: np.ndarray
    adapters: np.ndarray  # adapter index per request

    def base_key(self) -> bytes:
        """What a base-model run depends on (everything but the adapter column)."""
        return self.arrivals.tobytes() + self.prompt_lens.tobytes() + self.output_lens.tobytes()


def make_trace(case: Case, seed: int, min_len: int, max_len: int, max_adapters: int) -> Trace:
    """Arrivals, lengths and adapters from independent streams: the first two do not depend on the
    adapter distribution, so cases differing only in n/alpha/popularity share their base run."""
    count = case.requests
    arrival_rng, length_rng, adapter_rng = (np.random.default_rng([seed, i]) for i in range(3))
    shape = 1.0 / case.cv ** 2  # gamma: mean shape * scale = 1 / rate, cv = 1 / sqrt(shape)
    gaps = arrival_rng.gamma(shape, 1.0 / (case.rate * shape), count)
    arrivals = np.cumsum(gaps) - gaps[0]
    if case.mode == "throughput":
        arrivals = np.zeros(count)
    prompt_lens = length_rng.integers(min_len, max_len, count)
    output_lens = length_rng.integers(min_len, max_len, count)
    if case.kind == "slora":
        adapters = np.minimum((case.n * adapter_rng.power(case.alpha, count)).astype(np.int64), case.n - 1)
    elif case.popularity == "distinct":
        adapters = np.arange(count) % max_adapters
    elif case.popularity == "uniform":
        adapters = adapter_rng.integers(0, math.ceil(math.sqrt(count)), count)
    elif case.popularity == "skewed":
        m = min(count, max_adapters)
        weights = np.arange(1, m + 1, dtype=np.float64) ** -1.5
        adapters = adapter_rng.choice(m, count, p=weights / weights.sum())
    elif case.popularity == "identical":
        adapters = np.zeros(count, np.int64)
    else:
        raise ValueError(f"unknown Punica case {case.popularity!r}")
    return Trace(arrivals, prompt_lens, output_lens, adapters)


def parse_case(spec: str, defaults: dict) -> Case:
    """`slora:n=100,alpha=1,cv=1,...` or `punica:skewed,...` (unset fields from `defaults`)."""
    kind, _, rest = spec.partition(":")
    fields = dict(defaults)
    fields["mode"] = defaults["slora_mode"] if kind == "slora" else defaults["punica_mode"]
    fields.pop("slora_mode"), fields.pop("punica_mode")
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            fields["popularity"] = key
            continue
        if key not in ("n", "alpha", "cv", "rate", "requests", "mode"):
            raise ValueError(f"unknown field {key!r} in case {spec!r}")
        fields[key] = value if key == "mode" else (int(value) if key in ("n", "requests") else float(value))
    if kind == "slora":
        fields.setdefault("n", 100)
        fields.pop("popularity", None)
    elif kind == "punica":
        if fields.get("popularity") not in ("distinct", "uniform", "skewed", "identical"):
            raise ValueError(f"a Punica case needs distinct|uniform|skewed|identical: {spec!r}")
    else:
        raise ValueError(f"a case is slora:... or punica:...: {spec!r}")
    if fields["mode"] not in ("replay", "throughput"):
        raise ValueError(f"mode must be replay or throughput: {spec!r}")
    return Case(kind=kind, **fields)


SLORA_DEFAULT = "slora:n=100,alpha=1,cv=1"
SLORA_SWEEPS = (["slora:n=1,alpha=1,cv=1", "slora:n=1000,alpha=1,cv=1", "slora:n=2000,alpha=1,cv=1",
                 "slora:n=20,alpha=1,cv=1"]
                + [f"slora:n=100,alpha={a},cv=1" for a in (0.1, 0.3, 0.6)]
                + [f"slora:n=100,alpha=1,cv={cv}" for cv in (2, 4)])
PUNICA = [f"punica:{p}" for p in ("distinct", "uniform", "skewed", "identical")]
SUITES = {"slora": [SLORA_DEFAULT] + SLORA_SWEEPS, "punica": PUNICA, "all": [SLORA_DEFAULT] + PUNICA + SLORA_SWEEPS}


# ---- adapters -----------------------------------------------------------------------------------

class AdapterFactory:
    """Adapter i: a distinct host object sharing A/B with weight set i % num_sets (see the module doc)."""

    def __init__(self, config: LlamaConfig, num_sets: int, seed: int = 100):
        self.sets = [random_adapter(f"set{k}", config, LORA, seed=seed + k) for k in range(num_sets)]
        self.bytes_per_set = sum(m.a.nbytes + m.b.nbytes for m in self.sets[0].modules.values())

    def __call__(self, index: int) -> LoraAdapter:
        base = self.sets[index % len(self.sets)]
        factor = np.float32(1.0 + 0.01 * ((index * 0.6180339887) % 1.0))
        modules = {name: ModuleLora(m.a, m.b, m.rank.copy(), m.scale * factor) for name, m in base.modules.items()}
        return LoraAdapter(f"adapter{index}", LORA, modules)


# ---- engine runs --------------------------------------------------------------------------------

class Record:
    __slots__ = ("submitted", "first", "end", "tokens", "reason", "error")

    def __init__(self):
        self.submitted = self.first = self.end = None
        self.tokens = 0
        self.reason = self.error = None


class Timeline:
    """What the driver's thread did over a trace run, as host intervals in seconds from the run's
    start: "serve" (an `Engine.step` that had work: planning, dispatching, reading tokens), "train"
    (an `Engine.train_step` that ran a microbatch), "idle" (a step with nothing to run, or waiting
    for the next arrival). Consecutive intervals of one kind less than 1 ms apart are merged, so a
    run of serving steps is one span. Host time: a step's device work overlaps the next step's
    planning (async scheduling)."""

    def __init__(self, start: float):
        self.start = start
        self.spans: list[list] = []  # [kind, t0, t1]

    def add(self, kind: str, t0: float, t1: float) -> None:
        t0, t1 = t0 - self.start, t1 - self.start
        if self.spans and self.spans[-1][0] == kind and t0 - self.spans[-1][2] < 1e-3:
            self.spans[-1][2] = t1
        else:
            self.spans.append([kind, t0, t1])

    def summary(self) -> dict:
        """{"seconds": {kind: total}, "fraction": {kind: share of the spans' extent}, "spans": n}."""
        totals = {}
        for kind, t0, t1 in self.spans:
            totals[kind] = totals.get(kind, 0.0) + t1 - t0
        extent = (self.spans[-1][2] - self.spans[0][1]) if self.spans else 0.0
        return {"seconds": totals, "fraction": {k: v / extent for k, v in totals.items()} if extent else {},
                "spans": len(self.spans)}


def run_trace(model, engine_config: EngineConfig, trace: Trace, prompts: list, factory: AdapterFactory | None,
              mesh=None, step_fn=None, shapes=None, compressed=None, install=None, timeline: bool = False,
              images: tuple | None = None) -> dict:
    """Serves `trace` on a fresh engine (with its adapters if `factory`, or from a compressed
    collection `compressed` (a `SharedBasisSet` naming them adapter<i>), else all on the base model;
    tensor parallel over `mesh` if given), warmed up on `shapes` (default: the greedy steps of its
    kind, `greedy_shapes`) unless `step_fn` replaces its device step (`Engine(step_fn=...)`).
    install(engine): called once the engine is ready, before the clock starts (e.g. to set its
    `training`: the driver runs `Engine.train_step` after every step, as the engine thread does).
    timeline: also return the run's `Timeline` spans and their summary ("timeline"). images: a
    vision-language model's (`serve.vision.ImageServing`, each request's `ImageInput` or None),
    `model` its language model (bench/vision_serve.py)."""
    setup_start = time.perf_counter()
    serving, request_images = images if images is not None else (None, None)
    engine = Engine(model, eos_ids=(), config=engine_config, mesh=mesh, step_fn=step_fn, compressed=compressed,
                    images=serving)
    with_adapters = factory is not None or compressed is not None
    if step_fn is None:
        engine.warmup(greedy_shapes(engine, (with_adapters,)) if shapes is None else shapes)
    if factory is not None:
        for index in sorted(set(int(a) for a in trace.adapters)):
            engine.add_adapter(f"adapter{index}", factory(index))
    if install is not None:
        install(engine)
    setup_s = time.perf_counter() - setup_start
    names = [f"adapter{int(a)}" if with_adapters else None for a in trace.adapters]
    count = len(names)
    records = [Record() for _ in range(count)]
    finished = [0]

    start = time.perf_counter()
    spans = Timeline(start) if timeline else None
    lateness = 0.0
    submitted = 0
    while finished[0] < count:
        now = time.perf_counter() - start
        while submitted < count and trace.arrivals[submitted] <= now:
            i = submitted
            records[i].submitted = start + trace.arrivals[i]
            lateness = max(lateness, now - trace.arrivals[i])
            engine.submit(i, prompts[i], names[i], SamplingParams(int(trace.output_lens[i])), recording(records[i], finished),
                          images=None if request_images is None else request_images[i])
            submitted += 1
        t0 = time.perf_counter()
        busy = engine.step()
        t1 = time.perf_counter()
        trained = engine.train_step()
        if spans is not None:
            spans.add("serve" if busy else "idle", t0, t1)
            if trained:
                spans.add("train", t1, time.perf_counter())
        if not trained and not busy and finished[0] < count:
            if submitted < count:  # idle until the next arrival
                t2 = time.perf_counter()
                time.sleep(max(0.0, min(0.05, start + trace.arrivals[submitted] - t2)))
                if spans is not None:
                    spans.add("idle", t2, time.perf_counter())
            else:
                raise RuntimeError(f"engine idle with {count - finished[0]} requests unfinished")
    end = max(r.end for r in records)
    stats = engine.stats
    result = summarize(records, start, end)
    result.update({
        "setup_s": setup_s, "adapters_registered": len(engine.adapter_names()),
        "adapter_loads": stats.adapter_loads, "adapter_load_seconds": stats.adapter_load_seconds,
        "adapter_load_max_s": stats.adapter_load_max_s, "steps": stats.steps,
        "mean_step_tokens": stats.step_tokens / max(1, stats.steps),
        "mean_step_ms": 1e3 * stats.step_seconds / max(1, stats.steps),
        "max_submit_lateness_s": lateness, "compiles_in_run": stats.step_compiles,
        "phase_ms_per_step": stats.phase_ms_per_step(), "steps_by_kind": stats.steps_by_kind(),
        "phase_ms_by_kind": stats.phase_ms_by_kind(), "slowest_steps": stats.slowest_steps(),
        "train_steps": stats.train_steps, "train_tokens": stats.train_tokens, "train_seconds": stats.train_seconds,
        **({} if engine.modes is None else {"modes": engine.modes.snapshot()}),
        **({} if spans is None else {"timeline": {**spans.summary(), "kinds": ["serve", "train", "idle"],
                                                  "spans_s": [[round(t0, 4), round(t1, 4), k] for k, t0, t1 in spans.spans]}}),
    })
    del engine
    gc.collect()
    return result


def _pct(values, q):
    return float(np.percentile(values, q)) if len(values) else float("nan")


def recording(record: Record, finished: list) -> Callable[[Event], None]:
    """An engine callback that stamps `record` (first token, tokens, end, finish reason) and counts
    the finished requests in `finished[0]`."""
    def callback(event: Event):
        now = time.perf_counter()
        if event.token is not None:
            record.tokens += 1
            if record.first is None:
                record.first = now
        if event.finish_reason is not None:
            record.end, record.reason, record.error = now, event.finish_reason, event.error
            finished[0] += 1
    return callback


def summarize(records: list, start: float, end: float) -> dict:
    ok = [r for r in records if r.reason in ("length", "stop")]
    duration = end - start
    ttft = [r.first - r.submitted for r in ok if r.first is not None]
    tpot = [(r.end - r.first) / (r.tokens - 1) for r in ok if r.tokens > 1]
    e2e = [r.end - r.submitted for r in ok]
    tokens = sum(r.tokens for r in records)
    return {
        "requests": len(records), "finished_ok": len(ok), "errors": len(records) - len(ok),
        "generated_tokens": tokens, "duration_s": duration,
        "tokens_per_s": tokens / duration, "requests_per_s": len(ok) / duration,
        "ttft_p50_ms": 1e3 * _pct(ttft, 50), "ttft_p90_ms": 1e3 * _pct(ttft, 90),
        "tpot_p50_ms": 1e3 * _pct(tpot, 50), "tpot_p90_ms": 1e3 * _pct(tpot, 90),
        "latency_mean_s": float(np.mean(e2e)) if e2e else float("nan"), "latency_p90_s": _pct(e2e, 90),
    }


def host_only_step(step, cache):
    """`--host-only`: stands in for the engine's device step (`Engine(step_fn=...)`); token 0 for
    every row, cache unchanged."""
    return np.zeros(len(step.batch.logit_indices), np.int32), cache


# ---- compilation ----------------------------------------------------------------------------------

def use_compile_cache(path: str) -> None:
    """JAX's persistent compilation cache in `path` for every program ('' or None: off)."""
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def greedy_shapes(engine: Engine, lora=(False, True)) -> list:
    """The step programs greedy requests can run: the forwards with LoRA inputs or without (`lora`:
    which of the two; a trace whose requests all have adapters runs only LoRA steps)."""
    return [shape for shape in engine.step_shapes() if shape.program == "forward" and shape.lora in lora]


def compile_all(model, config: EngineConfig, threads: int, mesh=None, shapes=None, lora=(False, True),
                compressed=None) -> dict:
    """Compiles the step programs of `shapes` (default: `greedy_shapes(.., lora)`) for an engine of
    `config` (over `mesh`; serving the `SharedBasisSet` `compressed` if given: only its shapes
    matter), `threads` at a time: later engines of the same model and sizes find them in JAX's
    caches. Returns the warm-up's counts and time."""
    engine = Engine(model, eos_ids=(), config=config, mesh=mesh, compressed=compressed)
    info = {**engine.warmup(greedy_shapes(engine, lora) if shapes is None else shapes, threads), "threads": threads}
    del engine
    gc.collect()
    return info


# ---- profile --------------------------------------------------------------------------------------

PROFILE_STEPS = {  # rows as (adapter rows first as prefill chunks, tokens per chunk, decode rows)
    "decode32": (0, 0, 32),  # the engine's decode steps averaged 32 rows on this trace (steps_by_kind)
    "decode64": (0, 0, 64),
    "decode256": (0, 0, 256),  # the most rows a step takes
    "mixed": (2, 96, 64),  # two 96-token prefill chunks + 64 one-token rows (256 tokens)
    "mixed2048": (8, 240, 64),  # the trace's full mixed steps: 8 prompts' chunks + 64 decode rows (1984 tokens)
}
DEFAULT_PROFILE_STEPS = ("decode32", "decode64", "decode256", "mixed")


def profile_plan(engine: Engine, chunks: int, chunk_tokens: int, decode_rows: int, context: int, adapters: int):
    """One step's `StepPlan`: `chunks` prefill chunks of `chunk_tokens`, then `decode_rows`
    one-token rows at position `context`; row r on pool slot r % adapters (0: every row on the
    base model); random tokens, each row its own pages."""
    counts = [chunk_tokens] * chunks + [1] * decode_rows
    config = engine.config
    width = pages_for(context + chunk_tokens + 1, config.page_size)
    rng = np.random.default_rng(0)
    rows = []
    for row, count in enumerate(counts):
        start = 0 if count > 1 else context
        prompt = rng.integers(0, engine.model_config.vocab_size, start + count).tolist()
        pages = [(row * width + page) % config.num_pages for page in range(width)]
        seq = Sequence(row, prompt, 1, pages=pages, sampling=SamplingParams(1))
        rows.append(StepRow(seq, start, count, row % adapters if adapters else -1, True))
    return StepPlan(rows, [])


def profile_variants(engine_config: EngineConfig, backends, windows) -> dict:
    """{variant: (engine config, adapters the step's rows spread over)}: "base" (an engine without
    the adapter window, every row on the base model), "base+window" (the engine of the trace:
    window columns carried, base rows), each LoRA backend (rows on as many distinct adapters as
    the pool has: more than the window holds) and "window<W>" for each W of `windows` (rows over
    W adapters, all in the window). Variants with the trace's engine config reuse its programs."""
    slots = engine_config.max_adapters_on_device
    held = min(slots, engine_config.for_platform(jax.default_backend()).adapter_window)  # the engine's window
    variants = {"base": (dataclasses.replace(engine_config, adapter_window=0), 0)}
    if held:
        variants["base+window"] = (engine_config, 0)
    for backend in backends:  # more adapters than the window holds: the backend's kernels
        variants[backend] = (dataclasses.replace(engine_config, lora_backend=backend), slots)
    for window in sorted({min(w, held) for w in windows if held}):
        variants[f"window{window}"] = (engine_config, window)
    return variants


def profile_steps(model, engine_config: EngineConfig, factory: AdapterFactory, backends, log_dir: str,
                  calls: int = 5, context: int = 384, names=DEFAULT_PROFILE_STEPS, windows=(),
                  only=None) -> list[dict]:
    """Per-kernel device time (profiler trace, `bench.timing.kernel_times`) of one engine step
    (`Engine.build_step` / `run_step`) for each PROFILE_STEPS batch and each of
    `profile_variants` (an engine each), with every pool slot holding an adapter. Returns one
    entry per (step, variant); `names`: which of PROFILE_STEPS; `only`: which variants (None: all).
    The KV pool holds just the profiled rows' pages (each row its own, `profile_plan`): the programs
    compile with the engine in place (GEMM autotuning needs room), and a pool sized to a share of the
    device (it was half) left no room for the 16 GiB the first 8B forward allocated on an H200."""
    from bench.timing import kernel_times, median_call_seconds

    chosen = {name: PROFILE_STEPS[name] for name in names}
    most_rows = max(chunks + decode_rows for chunks, _, decode_rows in chosen.values())
    most_tokens = max(chunks * tokens + decode_rows for chunks, tokens, decode_rows in chosen.values())
    most_chunk = max(tokens for _, tokens, _ in chosen.values())
    num_pages = most_rows * pages_for(context + most_chunk + 1, engine_config.page_size)
    engine_config = dataclasses.replace(  # room for the largest profiled step (--tiny's engine is smaller)
        engine_config, max_num_seqs=max(engine_config.max_num_seqs, most_rows),
        token_budget=max(engine_config.token_budget, most_tokens), num_pages=num_pages)
    out = []
    for variant, (config, adapters) in profile_variants(engine_config, backends, windows).items():
        if only and variant not in only:
            continue
        engine = Engine(model, eos_ids=(), config=config)
        prepared = [engine.prepare_adapter(factory(i)) for i in range(len(factory.sets))]
        for slot in range(config.max_adapters_on_device):
            engine.pool.load(prepared[slot % len(prepared)], slot=slot)
        for step_name, (chunks, chunk_tokens, decode_rows) in chosen.items():
            plan = profile_plan(engine, chunks, chunk_tokens, decode_rows, context, adapters)
            step = engine.build_step(plan)
            run = lambda engine=engine, step=step: engine.run_step(step)
            times = kernel_times(run, calls, os.path.join(log_dir, f"{step_name}_{variant}"))
            sync_ms = 1e3 * median_call_seconds(run, 1, rounds=10)  # dispatch + device, one step at a time
            categories, counts = {}, {}
            for kernel in times["kernels"]:
                category = kernel_category(kernel["name"])
                categories[category] = categories.get(category, 0.0) + kernel["total_ms"]
                counts[category] = counts.get(category, 0) + kernel["calls"]
            out.append({"step": step_name, "variant": variant, "tokens": len(step.batch.tokens), "sync_ms": sync_ms,
                        "device_ms": times["device_ms"], "profiled_wall_ms": times["wall_ms"],
                        "categories": categories, "kernel_counts": counts, "top_kernels": times["kernels"][:80]})
        del engine
        gc.collect()
    steps = list(PROFILE_STEPS)
    return sorted(out, key=lambda entry: steps.index(entry["step"]))


def kernel_category(name: str) -> str:
    """LoRA kernels (the Pallas SGMV/BGMV calls), matmuls (cuBLAS/XLA GEMMs: base projections,
    attention, the onehot backend's LoRA), XLA fusions, copies, other."""
    from bench.timing import kernel_category as coarse

    lowered = name.lower()
    if any(tag in lowered for tag in ("sgmv", "bgmv", "shrink", "expand")):
        return "lora kernels"
    return {"matmul (cuBLAS/XLA)": "matmul", "XLA fusions (elementwise/reduce)": "fusions"}.get(coarse(name), coarse(name))


def print_profile(entries: list[dict]) -> None:
    """Per step and variant: device ms (with the difference to the same step's base model), the
    synchronous step time (dispatch + device), and ms / kernel count by category; then the top
    kernels of each LoRA variant."""
    base = {e["step"]: e for e in entries if e["variant"] == "base"}
    categories = sorted({c for e in entries for c in e["categories"]})
    print(f"{'step':8} {'variant':11} {'device ms':>9} {'(+base)':>8} {'sync ms':>8} {'kernels':>8}  "
          + "  ".join(f"{c[:14]:>14}" for c in categories), flush=True)
    for e in entries:
        b = base[e["step"]]
        cells = "  ".join(f"{e['categories'].get(c, 0):6.2f}/{e['kernel_counts'].get(c, 0):<7.0f}" for c in categories)
        print(f"{e['step']:8} {e['variant']:11} {e['device_ms']:9.2f} {e['device_ms'] - b['device_ms']:+8.2f} "
              f"{e['sync_ms']:8.2f} {sum(e['kernel_counts'].values()):8.0f}  {cells}", flush=True)
    for e in entries:
        if e["variant"] == "base":
            continue
        base_names = {k["name"] for k in base[e["step"]]["top_kernels"]}
        print(f"-- {e['step']} {e['variant']}: top kernels (* = not in the base step)")
        for kernel in e["top_kernels"][:10]:
            mark = " " if kernel["name"] in base_names else "*"
            print(f"  {mark}{kernel['total_ms']:7.3f} ms x{kernel['calls']:<5.0f} {kernel['name'][:100]}")


def matmul_floor(config: LlamaConfig, entries: list[dict]) -> dict:
    """The matmul-only decode step (`bench.decode_floor`: every layer's seven GEMMs and the LM head,
    weights as separate arrays, nothing else; and the same GEMMs packed as the engine holds them,
    q/k/v and gate/up as one kernel each: `bench.lora_window`) at each profiled decode step's row
    count, measured now, and the base engine step's device time over each. Printed as a table."""
    from bench.decode_floor import matmul_step_ms, random_layers
    from bench.lora_window import packed_matmul_step_ms

    layers = random_layers(config)
    head = jnp.zeros((config.hidden_size, config.vocab_size), jnp.bfloat16) + 0.01
    out = {}
    print(f"{'step':10} {'rows':>5} {'matmul-only ms':>15} {'packed ms':>10} {'engine base ms':>15} {'ratio':>6} "
          f"{'/packed':>8}")
    for e in entries:
        if e["variant"] != "base" or PROFILE_STEPS[e["step"]][0]:
            continue
        rows = PROFILE_STEPS[e["step"]][2]
        matmul_ms = matmul_step_ms(layers, head, rows)
        packed_ms = packed_matmul_step_ms(layers, head, rows, config)
        out[e["step"]] = {"rows": rows, "matmul_only_ms": matmul_ms, "matmul_only_packed_ms": packed_ms,
                          "engine_base_device_ms": e["device_ms"], "engine_base_sync_ms": e["sync_ms"],
                          "ratio": e["device_ms"] / matmul_ms, "ratio_to_packed": e["device_ms"] / packed_ms}
        print(f"{e['step']:10} {rows:5d} {matmul_ms:15.2f} {packed_ms:10.2f} {e['device_ms']:15.2f} "
              f"{e['device_ms'] / matmul_ms:6.2f} {e['device_ms'] / packed_ms:8.2f}")
    return out


# ---- report ---------------------------------------------------------------------------------------

HEADER = (f"{'case':48} {'run':12} {'tok/s':>8} {'req/s':>6} {'TTFT p50':>9} {'p90':>8} {'TPOT p50':>9} "
          f"{'p90':>7} {'loads':>5}")


def decode_floor(lora: dict, base: dict, adapter_bytes: int, copy_bytes_per_s: float) -> dict | None:
    """Issue 34 item 3's figure for a trace whose rows each use an adapter of their own (Punica
    distinct): the LoRA decode step's extra ms over the base run's decode step against the floor,
    each row's adapter A/B read once at the copy bandwidth measured in the same run (rows = the LoRA
    decode steps' mean rows; `bench.timing.copy_bandwidth` counts bytes read plus written, the 4.0
    TB/s of the H200). None when either run has no decode step of that kind."""
    lora_decode = (lora.get("steps_by_kind") or {}).get("lora decode")
    base_decode = (base.get("steps_by_kind") or {}).get("base decode")
    if not lora_decode or not base_decode or not copy_bytes_per_s:
        return None
    rows = lora_decode["mean_tokens"]
    floor_ms = 1e3 * rows * adapter_bytes / copy_bytes_per_s
    extra_ms = lora_decode["mean_ms"] - base_decode["mean_ms"]
    return {"rows": rows, "adapter_bytes": adapter_bytes, "copy_tb_per_s": copy_bytes_per_s / 1e12,
            "floor_ms": floor_ms, "extra_ms": extra_ms, "extra_over_floor": extra_ms / floor_ms}


def print_row(name: str, label: str, r: dict) -> None:
    print(f"{name:48} {label:12} {r['tokens_per_s']:8.0f} {r['requests_per_s']:6.2f} {r['ttft_p50_ms']:7.0f}ms "
          f"{r['ttft_p90_ms']:6.0f}ms {r['tpot_p50_ms']:7.1f}ms {r['tpot_p90_ms']:5.1f}ms {r['adapter_loads']:5d}"
          + (f"  errors {r['errors']}" if r["errors"] else "")
          + (f"  compiled {r['compiles_in_run']}x" if r["compiles_in_run"] else ""), flush=True)


def json_then_pyplot(path: str, report: dict):
    """Writes `report` as JSON to `path`; returns matplotlib.pyplot (Agg) for its PNG, None without matplotlib."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_report(path: str, report: dict) -> None:
    plt = json_then_pyplot(path, report)
    if plt is None:
        return
    results = [r for r in report["results"] if "lora" in r]
    if not results:
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 0.45 * len(results) + 2.5), sharey=True)
    y = np.arange(len(results))
    for ax, key, title in zip(axes, ("tokens_per_s", "ttft_p90_ms", "tpot_p90_ms"),
                              ("generated tokens/s", "TTFT p90 (ms)", "TPOT p90 (ms)")):
        ax.barh(y - 0.2, [r["lora"][key] for r in results], 0.4, label="adapters")
        ax.barh(y + 0.2, [r["base"][key] for r in results], 0.4, label="base model")
        ax.set_title(title)
    for i, r in enumerate(results):  # LoRA / base throughput next to the adapters' bar
        lora_tps = r["lora"]["tokens_per_s"]
        axes[0].annotate(f"{lora_tps / r['base']['tokens_per_s']:.3f}x base", (lora_tps, i - 0.2),
                         xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    axes[0].set_yticks(y, [r["case"] for r in results], fontsize=8)
    axes[0].invert_yaxis()
    axes[0].margins(x=0.2)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper right", ncol=2)
    backends = ", ".join(report["settings"]["lora_backend"])
    fig.suptitle(f"jaxlora serving ({backends} LoRA backend), {report['device']}, "
                 f"{report['model']['layers']} layers, jax {report['jax']}")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(os.path.splitext(path)[0] + ".png", dpi=110)
    plt.close(fig)


def run_profile(args, model, engine_config: EngineConfig, factory: AdapterFactory, backends, device: str) -> None:
    """`--profile`: the step profile (`profile_steps`) printed and written to --out."""
    log_dir = os.path.join(os.path.dirname(os.path.abspath(args.out)), "serve_profile_traces")
    context = min(384, engine_config.max_model_len // 2)
    entries = profile_steps(model, engine_config, factory, backends, log_dir, context=context,
                            names=args.profile_steps, windows=args.profile_windows, only=args.profile_variants)
    print_profile(entries)
    floor = matmul_floor(model.config, entries)
    report = {"device": device, "jax": jax.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "model": {"layers": args.layers, "shape": "tiny" if args.tiny else "Llama-3.1-8B"},
              "engine": dataclasses.asdict(engine_config), "profile_steps": PROFILE_STEPS, "profile": entries,
              "matmul_only": floor}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"device: {device}, jax {jax.__version__}; wrote {args.out}", flush=True)


# ---- inference modes: V-LoRA's skew experiment ------------------------------------------------------

MODE_SKEWS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# --modes: the engine's inference modes, plus "auto-credit" ("auto" with V-LoRA's credit policy,
# `ModePolicy`, instead of the default measured-cost policy, `CostPolicy`)
SKEW_MODES = ("auto", "merged", "unmerged", "mixed", "auto-credit")
SKEW_HEADER = (f"{'share':>6} {'mode':11} {'tok/s':>8} {'ms/token':>9} {'TTFT p50':>9} {'p90':>8} {'TPOT p50':>9} "
               f"{'p90':>7} {'steps by mode':38} switches")


def skew_trace(base: Trace, share: float, adapters: int, seed: int) -> Trace:
    """`base` (arrivals, lengths) with adapter 0 on a `share` of the requests (exactly, rounded;
    at random positions) and the others uniform over adapters 1..adapters-1 (V-LoRA §6: the
    share of the most requested adapter)."""
    rng = np.random.default_rng([seed, 5, int(share * 1000)])
    count = len(base.arrivals)
    hot = rng.permutation(count) < round(share * count)
    others = rng.integers(1, max(2, adapters), count)
    return dataclasses.replace(base, adapters=np.where(hot, 0, others))


def switch_ms(model, engine_config: EngineConfig, factory: AdapterFactory, repeats: int = 10) -> dict:
    """Device milliseconds of one mode switch (merge: base copy + ΔW into every targeted kernel of
    every layer; unmerge: the base copy back), each waited for, mean and max of `repeats`."""
    engine = Engine(model, eos_ids=(), config=dataclasses.replace(engine_config, inference_mode="merged"))
    engine.add_adapter("adapter0", factory(0))
    uid = engine.resolve_adapter("adapter0").uid
    slot, _ = engine.scheduler.slots.place(uid)
    engine.pool.load(engine.adapters.host(uid), slot=slot)
    times = {"merge": [], "unmerge": []}
    for i in range(repeats + 1):  # the first pair compiles
        for kind, target in (("merge", (uid, slot)), ("unmerge", None)):
            started = time.perf_counter()
            engine.modes.switch(engine, target)
            jax.block_until_ready([engine._state["weights"][key][...] for key in engine.modes.layout.kernel_keys])
            if i:
                times[kind].append(1e3 * (time.perf_counter() - started))
    base_bytes = sum(a.nbytes for a in engine.modes.base.values())
    del engine
    gc.collect()
    return {**{f"{kind}_ms_mean": float(np.mean(t)) for kind, t in times.items()},
            **{f"{kind}_ms_max": float(np.max(t)) for kind, t in times.items()},
            "base_copy_bytes": int(base_bytes), "layers": model.config.num_layers}


def mode_config(config: EngineConfig, mode: str, switch: dict | None) -> EngineConfig:
    """The engine config of a `--modes` entry: "auto" with the cost policy whose switch prior is
    the measured merge time (`switch`, None: its default), "auto-credit" with V-LoRA's credits."""
    if mode == "auto-credit":
        return dataclasses.replace(config, inference_mode="auto", mode_policy=ModePolicy(max_batch=config.max_num_seqs))
    if mode == "auto":
        prior = {} if not switch else {"switch_s": switch["merge_ms_mean"] / 1e3}
        return dataclasses.replace(config, inference_mode=mode,
                                   mode_policy=CostPolicy(max_batch=config.max_num_seqs, **prior))
    return dataclasses.replace(config, inference_mode=mode)


def print_skew_row(share: float, mode: str, run: dict) -> None:
    """One line of `SKEW_HEADER`."""
    modes = run.get("modes", {})
    steps = str(modes.get("mode_steps", {"unmerged": run["steps"]}))
    print(f"{share:6.2f} {mode:11} {run['tokens_per_s']:8.0f} {run['token_latency_ms']:9.2f} "
          f"{run['ttft_p50_ms']:7.0f}ms {run['ttft_p90_ms']:6.0f}ms {run['tpot_p50_ms']:7.1f}ms {run['tpot_p90_ms']:5.1f}ms {steps:38} "
          f"{modes.get('mode_switches', 0)}", flush=True)


def skew_table(report: dict) -> str:
    """A markdown table of the skew experiment: per share and mode, ms per token, TTFT and TPOT
    p50/p90 (ms), and auto's ratio to the best fixed mode (the one of the lowest ms per token: its
    ms per token and its TPOT p90; beside it, to the lowest TPOT p90 of any fixed mode, which is
    merged's where it starves the other adapters' requests)."""
    lines = ["| share | mode | ms/token | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 | switches |",
             "|---|---|---|---|---|---|---|---|"]
    for entry in report["skews"]:
        for mode, run in entry["runs"].items():
            lines.append(f"| {entry['share']:.2f} | {mode} | {run['token_latency_ms']:.2f} | "
                         f"{run['ttft_p50_ms']:.0f} | {run['ttft_p90_ms']:.0f} | {run['tpot_p50_ms']:.1f} | {run['tpot_p90_ms']:.1f} | "
                         f"{run.get('modes', {}).get('mode_switches', 0)} |")
        fixed = {mode: run for mode, run in entry["runs"].items() if mode in ("merged", "unmerged", "mixed")}
        if "auto" in entry["runs"] and fixed:
            name = min(fixed, key=lambda mode: fixed[mode]["token_latency_ms"])
            auto, best = entry["runs"]["auto"], fixed[name]
            lines.append(f"| {entry['share']:.2f} | auto / best fixed ({name}) | "
                         f"{auto['token_latency_ms'] / best['token_latency_ms']:.3f} | | | | "
                         f"{auto['tpot_p90_ms'] / best['tpot_p90_ms']:.3f} (lowest of any: "
                         f"{auto['tpot_p90_ms'] / min(r['tpot_p90_ms'] for r in fixed.values()):.3f}) | |")
    return "\n".join(lines)


def run_mode_skew(args, model, engine_config: EngineConfig, factory: AdapterFactory, step_fn, device: str) -> None:
    """`--modes-skew`: for each skew of `args.skews`, the same trace served by each of
    `args.modes` (EngineConfig.inference_mode, `mode_config`) and by the base model alone:
    average token latency (sum of request latencies / generated tokens, V-LoRA's metric), TTFT
    and TPOT p50/p90, throughput, steps per mode and switches; the switch time; the identical case
    (skew 1.0) merged against the base model; at the end a markdown table (`skew_table`)."""
    slots = args.skew_adapters
    config = dataclasses.replace(engine_config, max_adapters_on_device=slots, adapter_window=slots)
    probe = Engine(model, eos_ids=(), config=config, step_fn=step_fn)
    shapes = greedy_shapes(probe)  # merged steps run base programs, the others LoRA or window ones
    del probe
    if args.compile_only:  # fill --compile-cache for the runs of a later call
        info = compile_all(model, config, args.compile_threads, shapes=shapes)
        print(f"compiled {info['programs']} step programs in {info['seconds']:.1f} s ({info['threads']} threads)",
              flush=True)
        return
    case = Case("punica", args.slora_mode, args.requests, args.rate, 1.0, popularity="identical")
    base_trace = make_trace(case, args.seed, args.min_len, args.max_len, slots)
    token_rng = np.random.default_rng([args.seed, 3])
    prompts = [token_rng.integers(0, model.config.vocab_size, int(n)).tolist() for n in base_trace.prompt_lens]
    report = {"device": device, "jax": jax.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "model": {"shape": "tiny" if args.tiny else "Llama-3.1-8B", "layers": args.layers, "dtype": "bfloat16"},
              "engine": dataclasses.asdict(config), "case": dataclasses.asdict(case), "adapters": slots,
              "switch": None if step_fn is not None else switch_ms(model, config, factory), "skews": []}
    if report["switch"]:
        print(f"switch: merge {report['switch']['merge_ms_mean']:.2f} ms, unmerge "
              f"{report['switch']['unmerge_ms_mean']:.2f} ms ({args.layers} layers)", flush=True)
    base = run_trace(model, config, base_trace, prompts, None, step_fn=step_fn, shapes=shapes)
    report["warmup"] = warm_modes(args, model, config, factory, step_fn, shapes, report["switch"])
    print(SKEW_HEADER, flush=True)
    started, last_skew_s = time.perf_counter(), 0.0
    for share in args.skews:
        elapsed = time.perf_counter() - started
        if args.time_budget and elapsed + last_skew_s > args.time_budget:
            print(f"{share:6.2f} skipped (time budget: {elapsed:.0f} s used, ~{last_skew_s:.0f} s needed)", flush=True)
            report["skews_skipped"] = report.get("skews_skipped", []) + [share]
            continue
        trace = skew_trace(base_trace, share, slots, args.seed)
        runs = {}
        for mode in args.modes:
            run = run_trace(model, mode_config(config, mode, report["switch"]), trace, prompts, factory,
                            step_fn=step_fn, shapes=shapes)
            run["token_latency_ms"] = 1e3 * run["latency_mean_s"] * run["finished_ok"] / max(1, run["generated_tokens"])
            runs[mode] = run
            print_skew_row(share, mode, run)
        report["skews"].append({"share": share, "runs": runs,
                                "vs_base": {m: r["tokens_per_s"] / base["tokens_per_s"] for m, r in runs.items()}})
        report["base"] = base
        report["table"] = skew_table(report)
        write_mode_report(args.out, report)
        last_skew_s = time.perf_counter() - started - elapsed
    print(report.get("table", ""), flush=True)
    print(f"device: {device}; wrote {args.out}", flush=True)


def warm_modes(args, model, config: EngineConfig, factory: AdapterFactory, step_fn, shapes, switch) -> dict:
    """Untimed runs, one per mode of `args.modes`, of the first `WARM_REQUESTS` requests at the
    first share, before the timed runs: whatever a process does once (the first load of an adapter
    onto the device, the first run of each step variant) is paid here, not by the first timed run
    (on the H200 at 19:00 and 19:40 of 2026-11-27 the first timed run, auto at share 0.5, stalled
    1.3 s: TTFT p90 1.4 s against 50 ms in its later runs). Returns each run's seconds and its
    largest adapter load and submit lateness (what the warm-up absorbed)."""
    case = Case("punica", args.slora_mode, min(WARM_REQUESTS, args.requests), args.rate, 1.0, popularity="identical")
    trace = skew_trace(make_trace(case, args.seed + 7, args.min_len, args.max_len, config.max_adapters_on_device),
                       args.skews[0], config.max_adapters_on_device, args.seed)
    prompts = [[1 + i % 7] * int(n) for i, n in enumerate(trace.prompt_lens)]
    runs = {}
    for mode in args.modes:
        run = run_trace(model, mode_config(config, mode, switch), trace, prompts, factory, step_fn=step_fn,
                        shapes=shapes)
        runs[mode] = {key: run[key] for key in ("duration_s", "adapter_load_max_s", "max_submit_lateness_s",
                                                "compiles_in_run")}
    return runs


WARM_REQUESTS = 8


def write_mode_report(path: str, report: dict) -> None:
    """The skew experiment's JSON, and a PNG (token latency, TPOT p90 and throughput against the
    share) next to it."""
    plt = json_then_pyplot(path, report)
    if plt is None:
        return
    shares = [entry["share"] for entry in report["skews"]]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for mode in report["skews"][0]["runs"]:
        for ax, key in zip(axes, ("token_latency_ms", "tpot_p90_ms", "tokens_per_s")):
            ax.plot(shares, [entry["runs"][mode][key] for entry in report["skews"]], marker="o", label=mode)
    axes[2].axhline(report["base"]["tokens_per_s"], color="gray", linestyle="--", label="base model")
    for ax, title in zip(axes, ("average token latency (ms)", "TPOT p90 (ms)", "generated tokens/s")):
        ax.set_xlabel("share of the most requested adapter")
        ax.set_title(title)
    axes[2].legend()
    switch = report.get("switch") or {}
    fig.suptitle(f"inference modes, {report['device']}, {report['model']['layers']} layers"
                 + (f"; switch {switch['merge_ms_mean']:.1f} ms" if switch else ""))
    fig.tight_layout()
    fig.savefig(os.path.splitext(path)[0] + ".png", dpi=110)
    plt.close(fig)


# ---- main -----------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model, short sequences (CPU smoke test)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; --tiny: 2)")
    parser.add_argument("--suite", choices=sorted(SUITES), default="all")
    parser.add_argument("--cases", nargs="+", default=None, help="case specs (instead of --suite)")
    parser.add_argument("--requests", type=int, default=None, help="requests per case (default 100; --tiny: 12)")
    parser.add_argument("--rate", type=float, default=None, help="requests/s in replay mode (default 4; --tiny: 20)")
    parser.add_argument("--slora-mode", choices=("replay", "throughput"), default="replay")
    parser.add_argument("--punica-mode", choices=("replay", "throughput"), default="throughput")
    parser.add_argument("--min-len", type=int, default=None, help="input/output lengths in [min, max) (default 8)")
    parser.add_argument("--max-len", type=int, default=None, help="(default 512; --tiny: 24)")
    parser.add_argument("--max-adapters", type=int, default=1000, help="Punica distinct/skewed adapter cap")
    parser.add_argument("--weight-sets", type=int, default=4, help="distinct random A/B sets the adapters share")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--adapter-slots", type=int, default=None, help="device adapter pool (default 64: one slot per running "
                        "request, as S-LoRA sizes it; --tiny: 4)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="rows per step (default 64; --tiny: 8)")
    parser.add_argument("--token-budget", type=int, default=None, help="tokens per step (default 256; --tiny: 32)")
    parser.add_argument("--prefill-chunk", type=int, default=None, help="(default 128; --tiny: 16)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=None, help="KV pages (default: max-num-seqs full contexts)")
    parser.add_argument("--lora-backend", nargs="+", default=None,
                        help="jaxlora.lora.ops backend(s) (default: pallas on a GPU, gather elsewhere; onehot if "
                             "pallas fails to compile); several: each serves every case's LoRA trace, the first "
                             "is the reported `lora` run, all are under `lora_by_backend`")
    parser.add_argument("--unified-paging", action="store_true",
                        help="S-LoRA unified paging: KV pages and adapter rows in one budget, adapters in exactly "
                             "their rank of device rows read through a row table (EngineConfig.unified_paging); "
                             "run once with and once without for the same trace (same --seed)")
    parser.add_argument("--adapter-rows", type=int, default=None,
                        help="device rows for adapters with --unified-paging (default: adapter slots x rank)")
    parser.add_argument("--compile-threads", type=int, default=min(16, os.cpu_count() or 1),
                        help="threads compiling the step programs (an H200 host: 22 programs in 46-57 s with 16)")
    parser.add_argument("--compile-cache", default="/tmp/jaxlora_serve_jit_cache",
                        help="JAX persistent compilation cache dir ('' to disable)")
    parser.add_argument("--time-budget", type=float, default=0, help="seconds; skip cases that would not fit (0: off)")
    parser.add_argument("--out", default="bench/results/serve.json")
    parser.add_argument("--host-only", action="store_true",
                        help="replace the engine's jitted step by a stub (sampled tokens 0, nothing dispatched): "
                             "the engine's host time per step phase alone (phase_ms_per_step), on any machine")
    parser.add_argument("--profile", action="store_true",
                        help="instead of the cases: per-kernel device time of one engine step (decode and mixed "
                             "batches) for the base model and each --lora-backend, from a profiler trace")
    parser.add_argument("--adapter-window", type=int, default=None,
                        help="EngineConfig.adapter_window: adapters a step may hold in the window (default: the "
                             "engine's, 8 on a GPU/TPU; 0: off)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="EngineConfig.prefix_caching off")
    parser.add_argument("--schedule-policy", default="fcfs", choices=tuple(SCHEDULE_POLICIES),
                        help="EngineConfig.schedule_policy: the waiting queue's order in every run (base and LoRA)")
    parser.add_argument("--stable-step-inputs", action="store_true",
                        help="EngineConfig.stable_step_inputs on (serve/step_inputs.py: inputs in held device buffers)")
    parser.add_argument("--split-layers", action="store_true",
                        help="EngineConfig.split_layers: each layer's weights arrays of their own, every program unrolled")
    parser.add_argument("--scan-layers-from-tokens", type=int, default=None,
                        help="EngineConfig.scan_layers_from_tokens: steps of this many tokens or more run the layers "
                             "as one scan body (default: the engine's; 1: every step scanned)")
    parser.add_argument("--window-mixed-adapters", type=int, default=None,
                        help="EngineConfig.window_mixed_adapters: most adapters of a step with a prefill row "
                             "that uses the window (default: as many as the window holds)")
    parser.add_argument("--profile-windows", nargs="*", type=int, default=[1, 8],
                        help="--profile: window variants (rows over W adapters in the adapter window)")
    parser.add_argument("--profile-variants", nargs="*", default=None,
                        help="--profile: only these variants (base, base+window, a backend, window<W>)")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile the step programs into --compile-cache and stop (a later call finds them; "
                             "with --modes-skew: the skew runs' programs)")
    parser.add_argument("--profile-steps", nargs="+", choices=sorted(PROFILE_STEPS), default=list(DEFAULT_PROFILE_STEPS),
                        help="the step batches --profile times")
    parser.add_argument("--modes-skew", action="store_true",
                        help="instead of the cases: V-LoRA's skew experiment, the inference modes (--modes) on "
                             "traces where one adapter has a share (--skews) of the requests, plus the switch time")
    parser.add_argument("--modes", nargs="+", default=list(SKEW_MODES[:4]), choices=SKEW_MODES,
                        help="--modes-skew: the inference modes (auto-credit: auto with V-LoRA's credit policy)")
    parser.add_argument("--skews", nargs="+", type=float, default=list(MODE_SKEWS),
                        help="--modes-skew: shares of the most requested adapter")
    parser.add_argument("--skew-adapters", type=int, default=8,
                        help="--modes-skew: adapters of the trace (pool slots and adapter window too)")
    args = parser.parse_args()
    tiny = args.tiny
    pick = lambda value, default, tiny_default: value if value is not None else (tiny_default if tiny else default)
    args.layers = pick(args.layers, 32, 2)
    args.requests = pick(args.requests, 100, 12)
    args.rate = pick(args.rate, 4.0, 20.0)
    args.min_len = pick(args.min_len, 8, 4)
    args.max_len = pick(args.max_len, 512, 24)
    slots = pick(args.adapter_slots, 64, 4)
    max_num_seqs = pick(args.max_num_seqs, 64, 8)
    max_model_len = 2 * (args.max_len - 1)
    use_compile_cache(args.compile_cache)
    backends = args.lora_backend or ["pallas" if jax.default_backend() == "gpu" else "gather"]
    backend = backends[0]
    engine_config = EngineConfig(
        max_adapters_on_device=slots, max_lora_rank=LORA.r, page_size=args.page_size,
        num_pages=args.num_pages or max_num_seqs * pages_for(max_model_len, args.page_size),
        max_model_len=max_model_len, max_num_seqs=max_num_seqs, token_budget=pick(args.token_budget, 256, 32),
        prefill_chunk=pick(args.prefill_chunk, 128, 16), max_waiting=1 << 30, lora_backend=backend,
        unified_paging=args.unified_paging, adapter_rows=args.adapter_rows, adapter_window=args.adapter_window,
        window_mixed_adapters=args.window_mixed_adapters, prefix_caching=not args.no_prefix_caching,
        stable_step_inputs=args.stable_step_inputs, schedule_policy=args.schedule_policy)
    if args.scan_layers_from_tokens is not None:
        engine_config = dataclasses.replace(engine_config, scan_layers_from_tokens=args.scan_layers_from_tokens)
    if args.split_layers:
        engine_config = dataclasses.replace(engine_config, split_layers=True)
    if args.unified_paging and (args.profile or args.modes_skew):
        raise SystemExit("--unified-paging serves traces only: --profile loads pool slots directly, --modes-skew "
                         "needs the merged modes (padded slots)")

    defaults = {"requests": args.requests, "rate": args.rate, "cv": 1.0, "slora_mode": args.slora_mode,
                "punica_mode": args.punica_mode}
    cases = [parse_case(spec, defaults) for spec in (args.cases or SUITES[args.suite])]
    t0 = time.perf_counter()
    device = jax.devices()[0].device_kind
    print(f"device: {device}, jax {jax.__version__}, {args.layers} layers, backend {backend}, "
          f"{len(cases)} cases", flush=True)

    config = llama8b_config(args.layers, tiny)
    model = Llama(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    jax.block_until_ready(nnx.state(model))
    factory = AdapterFactory(config, args.weight_sets)
    setup_s = time.perf_counter() - t0
    print(f"model and {args.weight_sets} adapter weight sets ready in {setup_s:.1f} s "
          f"({factory.bytes_per_set / 2**20:.1f} MiB float32 per adapter)", flush=True)

    if args.profile:
        run_profile(args, model, engine_config, factory, backends, device)
        return
    step_fn = host_only_step if args.host_only else None
    if args.modes_skew:
        run_mode_skew(args, model, engine_config, factory, step_fn, device)
        return
    try:
        if args.host_only:  # no device step: nothing to compile
            compile_info = {"programs": 0, "seconds": 0.0, "threads": 0, "host_only": True}
        else:
            compile_info = compile_all(model, engine_config, args.compile_threads)
    except Exception as err:
        if not lora_backends.get(backend).custom_kernel:
            raise
        print(f"the {backend} backend failed to compile ({type(err).__name__}: {str(err)[:300]}); using onehot",
              flush=True)
        backend = "onehot"
        engine_config = dataclasses.replace(engine_config, lora_backend=backend)
        compile_info = compile_all(model, engine_config, args.compile_threads)
    print(f"compiled {compile_info['programs']} step programs in {compile_info['seconds']:.1f} s "
          f"({compile_info['threads']} threads)", flush=True)
    if args.compile_only:
        return
    backends = [backend] + [b for b in backends[1:] if b != backend]
    other_configs = {b: dataclasses.replace(engine_config, lora_backend=b) for b in backends[1:]}
    for other, other_config in other_configs.items():  # their LoRA steps (base runs use the first backend's)
        if args.host_only:
            break
        info = compile_all(model, other_config, args.compile_threads, lora=(True,))
        compile_info.setdefault("other_backends", {})[other] = info
        print(f"compiled the {other} LoRA steps: {info['seconds']:.1f} s", flush=True)

    # Warm-up (untimed): a few requests with adapters and on the base model exercise adapter loads,
    # prefetch and the host-side step path once.
    warm_case = Case("punica", "throughput", min(8, args.requests), args.rate, 1.0, popularity="distinct")
    warm = make_trace(warm_case, args.seed + 1, args.min_len, args.max_len, args.max_adapters)
    warm_prompts = [[1] * int(n) for n in warm.prompt_lens]
    run_trace(model, engine_config, warm, warm_prompts, factory, step_fn=step_fn)
    run_trace(model, engine_config, warm, warm_prompts, None, step_fn=step_fn)

    report = {
        "device": device, "jax": jax.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "host": platform.node(), "backend": jax.default_backend(),
        "model": {"shape": "tiny" if tiny else "Llama-3.1-8B", "layers": args.layers, "dtype": "bfloat16",
                  "weights": "random"},
        "adapters": {"r": LORA.r, "lora_alpha": LORA.lora_alpha, "target_modules": list(PROJECTIONS),
                     "weight_sets": args.weight_sets, "bytes_per_adapter_float32": factory.bytes_per_set,
                     "note": "adapter i shares A/B with weight set i % weight_sets, own scales; "
                             "only requested adapters are registered"},
        "engine": dataclasses.asdict(engine_config),
        "settings": {k: v for k, v in vars(args).items()},
        "setup_s": setup_s, "compile": compile_info, "results": [],
    }
    report["settings"]["lora_backend"] = backends
    print(HEADER, flush=True)
    base_runs: dict = {}
    last_run_s = 0.0
    copy_bytes_per_s = None  # the device's copy bandwidth (`decode_floor`), measured at the first distinct case
    adapter_bytes = factory.bytes_per_set * jnp.dtype(model.dtype).itemsize // 4  # one adapter in the pool's dtype
    for case in cases:
        trace = make_trace(case, args.seed, args.min_len, args.max_len, args.max_adapters)
        need_base = trace.base_key() not in base_runs
        elapsed = time.perf_counter() - t0
        estimate = last_run_s * (len(backends) + need_base)
        if args.time_budget and elapsed + estimate > args.time_budget:
            print(f"{case.name:48} skipped (time budget: {elapsed:.0f} s used, ~{estimate:.0f} s needed)", flush=True)
            report["results"].append({"case": case.name, "spec": dataclasses.asdict(case), "skipped": "time budget"})
            write_report(args.out, report)
            continue
        token_rng = np.random.default_rng([args.seed, 3])
        prompts = [token_rng.integers(0, config.vocab_size, int(n)).tolist() for n in trace.prompt_lens]
        run_start = time.perf_counter()
        lora = run_trace(model, engine_config, trace, prompts, factory, step_fn=step_fn)
        last_run_s = time.perf_counter() - run_start
        print_row(case.name, "lora" if len(backends) == 1 else f"lora {backend}", lora)
        by_backend = {backend: lora}
        for other, other_config in other_configs.items():
            by_backend[other] = run_trace(model, other_config, trace, prompts, factory, step_fn=step_fn)
            print_row("", f"lora {other}", by_backend[other])
        if need_base:
            base_runs[trace.base_key()] = (case.name, run_trace(model, engine_config, trace, prompts, None,
                                                                step_fn=step_fn))
        base_of, base = base_runs[trace.base_key()]
        print_row("", "base", base)
        floor = None
        if case.kind == "punica" and case.popularity == "distinct":
            if copy_bytes_per_s is None:  # measured once, after the first runs (nothing else on the device)
                from bench.timing import copy_bandwidth
                try:
                    copy_bytes_per_s = copy_bandwidth(*((64 << 20, 5) if tiny else (1 << 30, 50)))
                except Exception as err:  # e.g. out of device memory: the floor is then not reported
                    print(f"copy bandwidth not measured ({type(err).__name__}: {err}); no decode floor", flush=True)
                    copy_bytes_per_s = 0.0
            floor = decode_floor(lora, base, adapter_bytes, copy_bytes_per_s)
            if floor is not None:
                print(f"{'':48} decode step +{floor['extra_ms']:.2f} ms over base; floor {floor['floor_ms']:.2f} ms "
                      f"({floor['rows']:.0f} adapters x {adapter_bytes / 2**20:.1f} MiB at "
                      f"{floor['copy_tb_per_s']:.2f} TB/s): {floor['extra_over_floor']:.2f}x", flush=True)
        report["results"].append({
            "case": case.name, "spec": dataclasses.asdict(case),
            "distinct_adapters": int(len(set(trace.adapters.tolist()))),
            "lora": lora, "lora_by_backend": by_backend, "base": base, "base_run_of": base_of,
            "throughput_vs_base": lora["tokens_per_s"] / base["tokens_per_s"], "decode_floor": floor})
        write_report(args.out, report)
    report["total_s"] = time.perf_counter() - t0
    write_report(args.out, report)
    print(f"device: {device}, jax {jax.__version__}, {args.layers} layers, backends {', '.join(backends)}; "
          f"{report['total_s']:.0f} s; wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
