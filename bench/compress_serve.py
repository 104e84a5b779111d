"""Compress-then-Serve throughput: 1000 synthetic r=16 adapters compressed (JD-Full) and served
from their shared bases (`jaxlora-serve --compressed`'s path, the `compressed` LoRA backend),
against the same trace served with one uncompressed adapter and with the 1000 uncompressed
adapters (host tier + LRU device pool), all in one run, on the Llama-3.1-8B shape (random bf16
weights; `bench/serve.py`'s traces, engine runs and report fields).

    PYTHONPATH=. python bench/compress_serve.py [--layers 32] [--adapters 1000] [--rank 64] [--clusters 1]
    PYTHONPATH=. python bench/compress_serve.py --tiny       # CPU smoke test (tiny model, 24 adapters)

Adapters (synthetic, stated construction: a shared component plus an individual one, as the
paper's synthetic study but with structure to share): per layer and target module, `--groups`
shared pairs (A_g [k, 16] ~ N(0, 1/k), B_g [16, n] ~ N(0, 0.02^2)); adapter i of group i % groups
has A_i = A_g + 0.5 N_A, B_i = B_g + 0.5 N_B (N_A, N_B fresh draws of the same distributions),
r = 16, alpha = 32. Target modules q_proj and v_proj, so that the 1000 uncompressed adapters fit
the host (27 GB float32 for 32 layers) and the disk (PEFT not written: the host tier is what the
engine serves from). Compression (`jaxlora.compress.compress`, JD-Full at `--rank`, `--clusters`)
is timed, with its parameter count and mean relative reconstruction error.

Every engine's pool holds A/B for the adapters' target modules only (`EngineConfig.lora_target_modules`,
as `bench/slora_disk.py`'s; `--all-modules`: all seven, the runs until 2026-11-29). Prompts are
distinct (one random stream). Both engines' step programs are compiled first, `--compile-threads` at a
time, the compressed engine's from a set of the collection's shapes (`shape_alike_set`), before the
collection is made; `--compile-only` stops there (another process, e.g. on another GPU of the machine,
then finds them in the shared `--compile-cache`).

Runs per case (default: Punica distinct and S-LoRA n=1000, throughput mode): `single` (every
request on adapter 0, uncompressed; backend --lora-backend), `compressed` (request i on its own
compressed adapter; backend compressed), `uncompressed` (request i on its own uncompressed
adapter: the engine's host tier and device pool of --adapter-slots; backend --lora-backend).
Reported: tokens/s of each and compressed / single (the paper's 75-80% is the figure to beat;
the goal here is >= 0.90). JSON (device, jax version, date) to --out after every case."""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import sys
import time

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.serve import compile_all, make_trace, parse_case, print_row, run_trace
from jaxlora.compress import store
from jaxlora.compress.collection import Source, compress, source_parameter_count
from jaxlora.lora.adapter import LoraAdapter, ModuleLora
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.compressed import SharedBasisSet
from jaxlora.nn.model_config import projection_shapes
from jaxlora.models.llama import Llama
from jaxlora.models.presets import llama8b_config
from jaxlora.scheduler.serving import pages_for
from serve.engine import EngineConfig

LORA = LoraConfig(r=16, lora_alpha=32, target_modules=("q_proj", "v_proj"))
CASES = ["punica:distinct", "slora:n=1000,alpha=1,cv=1,mode=throughput"]


def synthetic_adapters(config, count: int, groups: int, noise: float, seed: int) -> list[LoraAdapter]:
    """`count` adapters of the construction in the module doc (float32 host arrays). Adapter i's
    individual parts come from its own generator (seed, i), drawn on a thread pool (numpy's
    generators release the GIL): 1000 adapters of the 8B shape are 44 GB of draws."""
    rng = np.random.default_rng(seed)
    shapes = projection_shapes(config)
    layers, r = config.num_layers, LORA.r
    shared = {m: [(rng.standard_normal((layers, shapes[m][0], r), np.float32) / np.sqrt(shapes[m][0]),
                   0.02 * rng.standard_normal((layers, r, shapes[m][1]), np.float32)) for _ in range(groups)]
              for m in LORA.target_modules}

    def adapter(i: int) -> LoraAdapter:
        own, modules = np.random.default_rng([seed, i]), {}
        for m in LORA.target_modules:
            a_g, b_g = shared[m][i % groups]
            a = a_g + noise * own.standard_normal(a_g.shape, np.float32) / np.sqrt(a_g.shape[1])
            b = b_g + noise * 0.02 * own.standard_normal(b_g.shape, np.float32)
            modules[m] = ModuleLora(a, b, np.full(layers, r, np.int32), np.full(layers, LORA.lora_alpha / r, np.float32))
        return LoraAdapter(f"adapter{i}", LORA, modules)

    with concurrent.futures.ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        return list(pool.map(adapter, range(count)))


def made_and_compressed(args, config, count: int):
    """(the compressed collection, {make_seconds, compress_seconds, parameters_before,
    bytes_float32}): made and compressed now (and saved to --collection if given), or read from
    --collection with the figures of the run that made it."""
    timing_file = None if args.collection is None else os.path.join(args.collection, "bench_timing.json")
    if timing_file and os.path.exists(timing_file) and not args.make_only:
        with open(timing_file) as f:
            info = json.load(f)
        if info["settings"] != _make_settings(args, count):
            raise SystemExit(f"{args.collection} was made with other settings: {info['settings']}")
        print(f"compressed collection reused from {args.collection}", flush=True)
        return store.load(args.collection), {**info, "reused_from": args.collection}
    started = time.perf_counter()
    adapters = synthetic_adapters(config, count, args.groups, args.noise, args.seed)
    made = time.perf_counter()
    sources = [Source(a) for a in adapters]
    collection = compress(sources, config, "jd-full", args.rank, args.clusters, iters=args.iters, seed=args.seed)
    info = {"make_seconds": made - started, "compress_seconds": time.perf_counter() - made,
            "parameters_before": source_parameter_count(sources), "settings": _make_settings(args, count),
            "bytes_float32": sum(m.a.nbytes + m.b.nbytes for a in adapters for m in a.modules.values())}
    errors = [np.mean(list(e.values())) for e in collection.errors.values()]
    print(f"{count} adapters made in {info['make_seconds']:.0f} s, compressed (jd-full r={args.rank} "
          f"k={args.clusters}) in {info['compress_seconds']:.0f} s: parameters {info['parameters_before']:,} -> "
          f"{collection.parameter_count():,}, mean relative error {np.mean(errors):.3f}", flush=True)
    if args.collection:
        store.save(collection, args.collection)
        with open(timing_file, "w") as f:
            json.dump(info, f)
    return collection, info


def _make_settings(args, count: int) -> dict:
    return {"layers": args.layers, "tiny": args.tiny, "count": count, "groups": args.groups, "noise": args.noise,
            "rank": args.rank, "clusters": args.clusters, "iters": args.iters, "seed": args.seed}


def trace_prompts(lengths, vocab_size: int, seed: int) -> list[list[int]]:
    """Random prompts of `lengths` from one stream, as bench/serve.py's: distinct, so the prefix cache
    serves no run from another request's prompt (until 2026-11-29 a generator made per prompt gave every
    prompt the same leading tokens, which the cache served to the one-adapter run)."""
    token_rng = np.random.default_rng([seed, 3])
    return [token_rng.integers(0, vocab_size, int(n)).tolist() for n in lengths]


def shape_alike_set(config, count: int, rank: int, clusters: int) -> SharedBasisSet:
    """A JD-Full `SharedBasisSet` of the shapes `compress` makes for `count` adapters (zeros, float32):
    what the compressed engine's programs need to compile before the collection exists."""
    shapes, layers = projection_shapes(config), config.num_layers
    modules = {m: {"basis_in": np.zeros((layers, clusters, shapes[m][0], rank), np.float32),
                   "basis_out": np.zeros((layers, clusters, rank, shapes[m][1]), np.float32),
                   "sigma": np.zeros((layers, count, rank, rank), np.float32)} for m in LORA.target_modules}
    return SharedBasisSet(tuple(f"adapter{i}" for i in range(count)), np.zeros(count, np.int32), modules)


def compile_engines(model, engine: EngineConfig, compressed_engine: EngineConfig | None, shared, threads: int) -> dict:
    """Compiles both engines' LoRA step programs `threads` at a time (the runs' engines then find them in
    JAX's caches instead of compiling one at a time in their warm-up); returns seconds per engine."""
    seconds = {"uncompressed": compile_all(model, engine, threads, lora=(True,))["seconds"]}
    if compressed_engine is not None:
        seconds["compressed"] = compile_all(model, compressed_engine, threads, lora=(True,),
                                            compressed=shared)["seconds"]
    print("compiled the step programs (" + ", ".join(f"{k} engine {v:.0f} s" for k, v in seconds.items())
          + f", {threads} threads)", flush=True)
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model, 24 adapters, short sequences (CPU smoke)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; --tiny 2)")
    parser.add_argument("--adapters", type=int, default=None, help="default 1000; --tiny 24")
    parser.add_argument("--groups", type=int, default=4, help="shared components of the construction")
    parser.add_argument("--noise", type=float, default=0.5, help="individual component's scale")
    parser.add_argument("--rank", type=int, default=None, help="JD-Full shared rank (default 64; --tiny 16)")
    parser.add_argument("--clusters", type=int, default=1)
    parser.add_argument("--iters", type=int, default=10, help="JD-Full alternating iterations")
    parser.add_argument("--cases", nargs="+", default=CASES)
    parser.add_argument("--requests", type=int, default=None, help="requests per case (default 1000; --tiny 24)")
    parser.add_argument("--max-len", type=int, default=None, help="lengths in [8, max) (default 512; --tiny 24)")
    parser.add_argument("--adapter-slots", type=int, default=None, help="uncompressed device pool (default 64)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="rows per step (default 64; --tiny 8)")
    parser.add_argument("--token-budget", type=int, default=None, help="tokens per step (default 256; --tiny 32)")
    parser.add_argument("--lora-backend", default=None, help="uncompressed runs (default hybrid on a GPU, else gather)")
    parser.add_argument("--skip-uncompressed", action="store_true", help="only the single and compressed runs")
    parser.add_argument("--skip-compressed", action="store_true",
                        help="only the single and uncompressed runs (nothing compressed: fits one call from an empty "
                             "compile cache)")
    parser.add_argument("--collection", default=None,
                        help="directory: reuse the compressed collection saved there by an earlier run with the same "
                             "settings (then only adapter 0 is made), else save it there (with --make-only: and stop)")
    parser.add_argument("--make-only", action="store_true", help="make, compress and save --collection, then stop")
    parser.add_argument("--all-modules", action="store_true",
                        help="the engines' pools hold all seven projections (the runs until 2026-11-29: the "
                             "untargeted five as zeros that every decode step's LoRA reads), not only the adapters' "
                             "q_proj and v_proj")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile both engines' programs into --compile-cache (the compressed one from a set of "
                             "the collection's shapes, zeros) and stop: a run on another GPU of the machine, sharing "
                             "the cache, then compiles nothing")
    parser.add_argument("--compile-threads", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--compile-cache", default="/tmp/jaxlora_serve_jit_cache")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/compress_serve.json")
    args = parser.parse_args(argv)
    if args.compile_only and args.make_only:
        parser.error("--compile-only and --make-only: one or the other")
    if args.skip_compressed and (args.skip_uncompressed or args.make_only):
        parser.error("--skip-compressed runs single and uncompressed: not with --skip-uncompressed or --make-only")
    pick = lambda value, default, tiny: value if value is not None else (tiny if args.tiny else default)
    args.rank = pick(args.rank, 64, 16)
    layers, count = pick(args.layers, 32, 2), pick(args.adapters, 1000, 24)
    requests, max_len = pick(args.requests, 1000, 24), pick(args.max_len, 512, 24)
    max_num_seqs, slots = pick(args.max_num_seqs, 64, 8), pick(args.adapter_slots, 64, 4)
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    backend = args.lora_backend or ("hybrid" if jax.default_backend() == "gpu" else "gather")
    started = time.perf_counter()
    config = llama8b_config(layers, args.tiny)
    model = Llama(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    max_model_len = 2 * (max_len - 1)
    engine = EngineConfig(max_adapters_on_device=slots, max_lora_rank=LORA.r, page_size=16,
                          num_pages=max_num_seqs * pages_for(max_model_len, 16), max_model_len=max_model_len,
                          max_num_seqs=max_num_seqs, token_budget=pick(args.token_budget, 256, 32),
                          prefill_chunk=pick(None, 128, 16), max_waiting=1 << 30, lora_backend=backend,
                          lora_target_modules=None if args.all_modules else LORA.target_modules)
    compressed_engine = dataclasses.replace(engine, lora_backend="compressed", max_adapters_on_device=1)
    compile_s = None
    if not args.make_only:
        compile_s = compile_engines(model, engine, None if args.skip_compressed else compressed_engine,
                                    shape_alike_set(config, count, args.rank, args.clusters), args.compile_threads)
        if args.compile_only:
            print(f"--compile-only: done in {time.perf_counter() - started:.0f} s", flush=True)
            return
    if args.skip_compressed:
        made = time.perf_counter()
        adapters = synthetic_adapters(config, count, args.groups, args.noise, args.seed)
        collection, shared, errors = None, None, [float("nan")]
        made_info = {"make_seconds": time.perf_counter() - made, "compress_seconds": None, "parameters_before": None,
                     "bytes_float32": sum(m.a.nbytes + m.b.nbytes for a in adapters for m in a.modules.values())}
        print(f"{count} adapters made in {made_info['make_seconds']:.0f} s (not compressed: --skip-compressed)",
              flush=True)
    else:
        collection, made_info = made_and_compressed(args, config, count)
        if args.make_only:
            return
        adapters = synthetic_adapters(config, 1, args.groups, args.noise, args.seed)  # adapter 0: the single run's
        errors = [np.mean(list(e.values())) for e in collection.errors.values()]
        shared = collection.serving_set()
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "model": {"shape": "tiny" if args.tiny else "Llama-3.1-8B", "layers": layers, "dtype": "bfloat16"},
              "adapters": {"count": count, "r": LORA.r, "target_modules": list(LORA.target_modules),
                           "construction": f"{args.groups} shared components + {args.noise} x individual (module doc)",
                           "bytes_float32": made_info["bytes_float32"], "make_seconds": made_info["make_seconds"]},
              "compression": None if collection is None else {
                  "method": "jd-full", "rank": args.rank, "clusters": args.clusters, "iters": args.iters,
                  "seconds": made_info["compress_seconds"], "parameters_before": made_info["parameters_before"],
                  "parameters_after": collection.parameter_count(), "mean_relative_error": float(np.mean(errors)),
                  "reused_from": made_info.get("reused_from")},
              "engine": dataclasses.asdict(engine), "compile_seconds": compile_s, "settings": vars(args), "results": []}
    defaults = {"requests": requests, "rate": 4.0, "cv": 1.0, "slora_mode": "throughput", "punica_mode": "throughput"}
    for spec in args.cases:
        case = parse_case(spec, defaults)
        if case.kind == "slora" and case.n > count:  # --tiny: the adapters there are
            case = dataclasses.replace(case, n=count)
        trace = make_trace(case, args.seed, 8, max_len, count)
        prompts = trace_prompts(trace.prompt_lens, config.vocab_size, args.seed)
        single_trace = dataclasses.replace(trace, adapters=np.zeros_like(trace.adapters))
        runs = {"single": run_trace(model, engine, single_trace, prompts, lambda i: adapters[i])}
        if not args.skip_uncompressed:  # every adapter (made here if the collection was reused)
            adapters = adapters if len(adapters) == count else synthetic_adapters(
                config, count, args.groups, args.noise, args.seed)
        print_row(case.name, "single", runs["single"])
        if shared is not None:
            runs["compressed"] = run_trace(model, compressed_engine, trace, prompts, None, compressed=shared)
            print_row("", "compressed", runs["compressed"])
        if not args.skip_uncompressed:
            runs["uncompressed"] = run_trace(model, engine, trace, prompts, lambda i: adapters[i])
            print_row("", "uncompressed", runs["uncompressed"])
        ratios = {f"{name}_vs_single": runs[name]["tokens_per_s"] / runs["single"]["tokens_per_s"]
                  for name in ("compressed", "uncompressed") if name in runs}
        for name, ratio in ratios.items():
            print(f"{'':48} {name.replace('_vs_', ' / ')} = {ratio:.3f}", flush=True)
        report["results"].append({"case": case.name, "distinct_adapters": int(len(set(trace.adapters.tolist()))),
                                  "runs": runs, **ratios})
        report["total_s"] = time.perf_counter() - started
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(f"done in {time.perf_counter() - started:.0f} s: {args.out}")


if __name__ == "__main__":
    main()
