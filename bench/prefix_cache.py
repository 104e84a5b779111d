"""Prefix caching (issue 36): time to first token with the prefix cache and without, on a trace where
every request of an adapter starts with that adapter's shared system prompt, on a Llama-3.1-8B-shaped
model (random bf16 weights; built as `bench/serve.py` builds its engine) or the tiny shape on a CPU.

    PYTHONPATH=. python bench/prefix_cache.py            # 8B shape on the GPU
    PYTHONPATH=. python bench/prefix_cache.py --tiny     # CPU (tiny model)

Trace: `--adapters` adapters (8; r=16 on all seven projections, `bench.serve.AdapterFactory`), each
with its own random system prompt of `--system-tokens` tokens (1000); request i uses adapter
i % adapters and sends that prompt plus a random user tail of [--min-tail, --max-tail) tokens, and
generates `--output-tokens` tokens (EOS ignored). Arrivals are Poisson at each of `--rates` requests/s
(replay: each request is submitted at its arrival time; TTFT counts from it, queueing included: the
ratio grows with the load, as the engine without the cache computes ~20x the prompt tokens and
queues sooner). At each rate the same trace runs twice on fresh engines of one config, the compiled
step programs shared: with `prefix_caching=False` and with the default (on). Rate 0 is the
closed loop of one request at a time (at most 4 requests an adapter) (each submitted when the one before has finished): its TTFT is
a lone request's, no queueing, the ratio the cache gives a request by itself (and one that other work
on the host slows alike in both runs). Nothing is warmed in the cache beforehand: the first
request of each adapter computes its system prompt in both runs.

Reported per rate (JSON at --out, with the device, jax version and date): TTFT p50/p90, TPOT p50,
tokens/s of both runs, TTFT p50 without / with (the target is >= 5x), and the cached run's hit rate (prompt
tokens whose KV came from cached blocks / prompt tokens of admitted requests, `EngineStats.prefix_cache`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.serve import LORA, AdapterFactory, Record, Trace, compile_all, greedy_shapes, recording, run_trace, summarize
from jaxlora.lora import backends as lora_backends
from jaxlora.models.llama import Llama
from jaxlora.models.presets import llama8b_config
from jaxlora.scheduler.serving import pages_for
from jaxlora.sampling import SamplingParams
from serve.engine import Engine, EngineConfig

TARGET = 5.0  # TTFT p50 without the cache / with it (issue 36)


def make_workload(args, vocab: int, rate: float) -> tuple[Trace, list[list[int]]]:
    """The trace (Poisson arrivals at `rate`, tails, output lengths, adapter i % adapters) and its
    prompts (adapter's system prompt + tail), from `args.seed` (the same prompts at every rate)."""
    rng = np.random.default_rng(args.seed)
    systems = [rng.integers(1, vocab, args.system_tokens).tolist() for _ in range(args.adapters)]
    count = args.requests
    arrivals = np.cumsum(np.random.default_rng([args.seed, 1]).exponential(1.0 / (rate or 1.0), count))
    arrivals -= arrivals[0]
    tails = rng.integers(args.min_tail, args.max_tail, count)
    adapters = np.arange(count) % args.adapters
    prompts = [systems[a] + rng.integers(1, vocab, int(t)).tolist() for a, t in zip(adapters, tails)]
    trace = Trace(arrivals, np.array([len(p) for p in prompts]), np.full(count, args.output_tokens), adapters)
    return trace, prompts


def engine_config(args) -> EngineConfig:
    """The benchmark's engine: one pool slot per adapter, `--max-num-seqs` full contexts of KV pages;
    step sizes from the flags (None: the engine's platform defaults)."""
    max_model_len = pages_for(args.system_tokens + args.max_tail + args.output_tokens, args.page_size) * args.page_size
    return EngineConfig(
        max_adapters_on_device=args.adapters, max_lora_rank=LORA.r, page_size=args.page_size,
        num_pages=args.num_pages or args.max_num_seqs * pages_for(max_model_len, args.page_size),
        max_model_len=max_model_len, max_num_seqs=args.max_num_seqs, token_budget=args.token_budget,
        prefill_chunk=args.prefill_chunk, max_waiting=1 << 30, lora_backend=args.lora_backend)


def run(model, config: EngineConfig, trace: Trace, prompts, factory, closed_loop: bool = False) -> dict:
    """One replay of the trace on a fresh engine of `config` (`closed_loop`: one request at a time);
    the summary plus its prefix counts."""
    if closed_loop:
        return run_one_at_a_time(model, config, trace, prompts, factory)
    stats = []
    result = run_trace(model, config, trace, prompts, factory, install=lambda engine: stats.append(engine.stats))
    result["prefix_cache"] = stats[0].prefix_cache()
    return result


def run_one_at_a_time(model, config: EngineConfig, trace: Trace, prompts, factory) -> dict:
    """The trace's requests in order, each submitted once the one before has finished."""
    engine = Engine(model, eos_ids=(), config=config)
    engine.warmup(greedy_shapes(engine, (True,)))
    for index in sorted(set(int(a) for a in trace.adapters)):
        engine.add_adapter(f"adapter{index}", factory(index))
    records, finished = [Record() for _ in prompts], [0]
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        records[i].submitted = time.perf_counter()
        engine.submit(i, prompt, f"adapter{int(trace.adapters[i])}", SamplingParams(int(trace.output_lens[i])),
                      recording(records[i], finished))
        while finished[0] <= i:
            engine.step()
    result = summarize(records, start, max(r.end for r in records))
    result["prefix_cache"] = engine.stats.prefix_cache()
    result["engine_stats"] = {"host_ms_per_step": engine.stats.phase_ms_per_step(),
                              "steps_by_kind": engine.stats.steps_by_kind(), "step_compiles": engine.stats.step_compiles,
                              "steps": engine.stats.steps}
    result["ttft_ms"] = [round(1e3 * (r.first - r.submitted), 2) for r in records if r.first is not None]
    return result


def run_rate(args, model, config: EngineConfig, factory, rate: float) -> dict:
    """Both runs of the trace at `rate`: {"no_cache", "cache", "ttft_p50_ratio", "hit_rate", "pass"}."""
    if rate == 0:  # one at a time: four requests an adapter (the first of each a miss), p50 a hit's
        args = argparse.Namespace(**{**vars(args), "requests": min(args.requests, 4 * args.adapters)})
    trace, prompts = make_workload(args, model.config.vocab_size, rate)
    results = {}
    for name, prefix in (("no_cache", False), ("cache", True)):
        results[name] = r = run(model, dataclasses.replace(config, prefix_caching=prefix), trace, prompts, factory,
                                closed_loop=rate == 0)
        print(f"{rate:5g}/s {name:9} TTFT p50 {r['ttft_p50_ms']:8.1f} ms  p90 {r['ttft_p90_ms']:8.1f} ms  TPOT p50 "
              f"{r['tpot_p50_ms']:6.1f} ms  {r['tokens_per_s']:7.1f} tok/s  hit rate "
              f"{r['prefix_cache']['hit_rate']:.3f}  errors {r['errors']}", flush=True)
    ratio = results["no_cache"]["ttft_p50_ms"] / results["cache"]["ttft_p50_ms"]
    print(f"{rate:5g}/s TTFT p50 without / with the cache: {ratio:.2f}x (target >= {TARGET:g}x: "
          f"{'PASS' if ratio >= TARGET else 'FAIL'})", flush=True)
    return {**results, "ttft_p50_ratio": ratio, "hit_rate": results["cache"]["prefix_cache"]["hit_rate"],
            "pass": ratio >= TARGET}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model on the CPU (fewer, slower-arriving requests)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; --tiny: 2)")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1000, help="each adapter's shared system prompt")
    parser.add_argument("--min-tail", type=int, default=16, help="user tail tokens in [min, max)")
    parser.add_argument("--max-tail", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=None, help="(default 32; --tiny: 8)")
    parser.add_argument("--requests", type=int, default=None, help="(default 128; --tiny: 48)")
    parser.add_argument("--rates", type=float, nargs="+", default=None,
                        help="requests/s, one trace each; 0: one request at a time (default 0 4 8 16; --tiny: 0 2 4 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=None, help="KV pages (default: max-num-seqs full contexts)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="(default 64; --tiny: 16)")
    parser.add_argument("--token-budget", type=int, default=None, help="tokens per step (default: the engine's)")
    parser.add_argument("--prefill-chunk", type=int, default=None, help="(default: the engine's)")
    parser.add_argument("--lora-backend", default="auto",
                        help="(default: the server's auto: hybrid on one GPU, gather on a CPU)")
    parser.add_argument("--compile-threads", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--compile-cache", default="/tmp/jaxlora_serve_jit_cache", help="('' to disable)")
    parser.add_argument("--out", default=None, help="(default bench/results/prefix_cache_<cpu|gpu>.json)")
    args = parser.parse_args()
    pick = lambda value, default, tiny_default: value if value is not None else (tiny_default if args.tiny else default)
    args.layers = pick(args.layers, 32, 2)
    args.output_tokens = pick(args.output_tokens, 32, 8)
    args.requests = pick(args.requests, 128, 48)
    args.rates = pick(args.rates, [0.0, 4.0, 8.0, 16.0], [0.0, 2.0, 4.0, 8.0])
    args.max_num_seqs = pick(args.max_num_seqs, 64, 16)
    args.lora_backend = lora_backends.resolve(args.lora_backend, jax.default_backend())
    args.out = args.out or f"bench/results/prefix_cache_{jax.default_backend()}.json"
    return args


def main() -> None:
    args = parse_args()
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    device = jax.devices()[0].device_kind
    config = llama8b_config(args.layers, args.tiny)
    model = Llama(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    factory = AdapterFactory(config, min(4, args.adapters))
    off_config = engine_config(args)
    print(f"device: {device}, jax {jax.__version__}, {args.layers} layers, {args.requests} requests a rate, "
          f"{args.adapters} adapters x {args.system_tokens}-token system prompts", flush=True)
    started = time.perf_counter()
    compile_info = compile_all(model, off_config, args.compile_threads, lora=(True,))
    print(f"compiled {compile_info['programs']} step programs in {time.perf_counter() - started:.1f} s", flush=True)
    # untimed: the samplers and first-use paths compiled and run once
    warm_args = argparse.Namespace(**{**vars(args), "requests": args.adapters})
    run(model, off_config, *make_workload(warm_args, config.vocab_size, max(args.rates) or 1.0), factory)
    rates = [{"rate": rate, **run_rate(args, model, off_config, factory, rate)} for rate in args.rates]
    report = {
        "device": device, "jax": jax.__version__, "backend": jax.default_backend(), "host": platform.node(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "model": {"shape": "tiny" if args.tiny else "Llama-3.1-8B", "layers": args.layers, "dtype": "bfloat16",
                  "weights": "random"},
        "settings": vars(args), "engine": {k: v for k, v in dataclasses.asdict(off_config).items()
                                          if k != "mode_policy"},
        "compile": compile_info, "target_ratio": TARGET, "rates": rates,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
