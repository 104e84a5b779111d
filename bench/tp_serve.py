"""Tensor-parallel serving: the same request trace on a one-GPU engine and on a TP=N engine
(`serve.engine.Engine(mesh=...)`, N GPUs), Llama-3.1-8B-shaped model with random bf16 weights.

    PYTHONPATH=. python bench/tp_serve.py [--tensor-parallel 2] [--layers 32] [--requests 128] [--out FILE]
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        PYTHONPATH=. python bench/tp_serve.py --tiny          # CPU smoke test, 2 simulated devices

Workload (throughput mode: every request submitted at t=0, run as fast as possible): --requests
requests, input and output lengths uniform in [--min-len, --max-len), each request on one of
--adapters r=16 adapters (alpha 32, all seven projections) drawn uniformly (`bench/serve.py`'s
S-LoRA generator with alpha=1), and the same trace with every request on the base model. Each of
the two engines (TP=1: no mesh, device 0; TP=N: `make_mesh(tensor=N)` over the first N devices)
serves both traces with the same EngineConfig and the same LoRA backend (default onehot: a
`pallas_call` cannot run under GSPMD, and onehot reads the pool once per step where gather
materialises per-token A/B). Requests ignore EOS, so each generates exactly its output length.

Compilation is kept out of the timed runs and small: the traces are first served with the device
step replaced by a stub (`Engine(step_fn=...)`) that records the step programs (`StepShape`s) the
engine runs (scheduling does not depend on token values), and only those are compiled, in
parallel threads, for each engine (`Engine.warmup` through `bench/serve.py`'s `compile_all`,
which also compiles the pool's slot update; the two engines compile at the same time).
`compiles_in_run` in the JSON says if a run compiled anyway.

Reported per engine and trace (from `bench/serve.py`'s `run_trace`): generated tokens/s and
requests/s over the makespan, TTFT and TPOT p50/p90 (TTFT includes queueing: all requests arrive
at once), steps and mean step time; and the TP=N / TP=1 throughput ratio. Writes JSON (device,
jax version, date, settings, results) to --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import platform
import sys
import time

# As in bench/serve.py: run as a script, this folder would come first on sys.path and hide the
# `serve` package; the repository root comes instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench import serve as serve_bench
from jaxlora import sharding
from jaxlora.lora import backends
from jaxlora.models.llama import Llama
from jaxlora.models.presets import llama8b_config
from jaxlora.scheduler.serving import pages_for
from serve.engine import EngineConfig


def record_shapes(model, config: EngineConfig, trace, prompts, factory) -> set:
    """The step programs (`StepShape`s) the engine runs serving `trace`, from a run whose device
    step is a stub (nothing compiled or dispatched; adapter loads still run)."""
    shapes = set()

    def stub(step, cache):
        shapes.update(step.shapes)
        return serve_bench.host_only_step(step, cache)

    serve_bench.run_trace(model, config, trace, prompts, factory, step_fn=stub)
    return shapes


def write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def median_run(runs: list) -> dict:
    """The run with the median tokens/s (all runs kept under "runs")."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**ordered[(len(ordered) - 1) // 2], "runs": runs} if len(runs) > 1 else runs[0]


HEADER = (f"{'engine':14} {'trace':5} {'tok/s':>8} {'req/s':>6} {'TTFT p50':>9} {'TPOT p50':>9} {'steps':>6} "
          f"{'ms/step':>8}")


def print_row(engine: str, trace: str, r: dict) -> None:
    print(f"{engine:14} {trace:5} {r['tokens_per_s']:8.0f} {r['requests_per_s']:6.2f} {r['ttft_p50_ms']:7.0f}ms "
          f"{r['tpot_p50_ms']:7.1f}ms {r['steps']:6d} {r['mean_step_ms']:8.2f}"
          + (f"  errors {r['errors']}" if r["errors"] else "")
          + (f"  compiled {r['compiles_in_run']}x" if r["compiles_in_run"] else ""), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model, short sequences (CPU smoke test)")
    parser.add_argument("--tensor-parallel", type=int, default=2, help="devices of the TP engine (default 2)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; --tiny: 2)")
    parser.add_argument("--requests", type=int, default=None, help="requests in the trace (default 128; --tiny: 16)")
    parser.add_argument("--adapters", type=int, default=None, help="distinct adapters (default 32; --tiny: 4)")
    parser.add_argument("--min-len", type=int, default=None, help="input/output lengths in [min, max) (default 8)")
    parser.add_argument("--max-len", type=int, default=None, help="(default 512; --tiny: 24)")
    parser.add_argument("--adapter-slots", type=int, default=None, help="device pool slots (default: --adapters)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="rows per step (default 64; --tiny: 8)")
    parser.add_argument("--token-budget", type=int, default=None, help="tokens per step (default 256; --tiny: 32)")
    parser.add_argument("--prefill-chunk", type=int, default=None, help="(default 128; --tiny: 16)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--lora-backend", default="onehot", choices=backends.names(serves=True, partitionable=True),
                        help="LoRA backend of both engines (default onehot)")
    parser.add_argument("--weight-sets", type=int, default=2, help="distinct random A/B sets the adapters share")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per engine and trace (median reported)")
    parser.add_argument("--no-base", action="store_true", help="skip the base-model runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-threads", type=int, default=min(16, os.cpu_count() or 1),
                        help="compile threads per engine (the two engines compile concurrently)")
    parser.add_argument("--compile-cache", default="/tmp/jaxlora_serve_jit_cache",
                        help="JAX persistent compilation cache dir ('' to disable)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/tp_serve.json; "
                                                    "--tiny: bench/results/tp_serve_cpu_smoke.json)")
    args = parser.parse_args()
    tiny = args.tiny
    pick = lambda value, default, tiny_default: value if value is not None else (tiny_default if tiny else default)
    args.layers = pick(args.layers, 32, 2)
    args.requests = pick(args.requests, 128, 16)
    args.adapters = pick(args.adapters, 32, 4)
    args.min_len = pick(args.min_len, 8, 4)
    args.max_len = pick(args.max_len, 512, 24)
    args.out = args.out or f"bench/results/tp_serve{'_cpu_smoke' if tiny else ''}.json"
    tp = args.tensor_parallel
    if tp < 2:
        raise SystemExit("--tensor-parallel must be >= 2 (the TP=1 engine always runs)")
    if jax.device_count() < tp:
        raise SystemExit(f"--tensor-parallel {tp} needs {tp} devices, {jax.default_backend()} has "
                         f"{jax.device_count()} (CPU: XLA_FLAGS=--xla_force_host_platform_device_count={tp})")
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    max_num_seqs = pick(args.max_num_seqs, 64, 8)
    max_model_len = 2 * (args.max_len - 1)
    engine_config = EngineConfig(
        max_adapters_on_device=args.adapter_slots or args.adapters, max_lora_rank=serve_bench.LORA.r,
        page_size=args.page_size, num_pages=max_num_seqs * pages_for(max_model_len, args.page_size),
        max_model_len=max_model_len, max_num_seqs=max_num_seqs, token_budget=pick(args.token_budget, 256, 32),
        prefill_chunk=pick(args.prefill_chunk, 128, 16), max_waiting=1 << 30, lora_backend=args.lora_backend)

    t0 = time.perf_counter()
    device = jax.devices()[0].device_kind
    print(f"device: {device} x{jax.device_count()}, jax {jax.__version__}, {args.layers} layers, TP=1 vs TP={tp}, "
          f"backend {args.lora_backend}, {args.requests} requests, {args.adapters} adapters", flush=True)
    config = llama8b_config(args.layers, tiny)
    model = Llama(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)  # on device 0
    jax.block_until_ready(nnx.state(model))
    factory = serve_bench.AdapterFactory(config, args.weight_sets)
    case = serve_bench.Case("slora", "throughput", args.requests, rate=1.0, cv=1.0, n=args.adapters, alpha=1.0)
    trace = serve_bench.make_trace(case, args.seed, args.min_len, args.max_len, args.adapters)
    token_rng = np.random.default_rng([args.seed, 3])
    prompts = [token_rng.integers(0, config.vocab_size, int(n)).tolist() for n in trace.prompt_lens]
    setup_s = time.perf_counter() - t0
    print(f"model, adapters and trace ready in {setup_s:.1f} s", flush=True)

    t = time.perf_counter()
    shapes = record_shapes(model, engine_config, trace, prompts, factory)
    if not args.no_base:
        shapes |= record_shapes(model, engine_config, trace, prompts, None)
    shapes = sorted(shapes)
    print(f"{len(shapes)} step programs to compile per engine (recorded in {time.perf_counter() - t:.1f} s)",
          flush=True)

    report = {
        "device": device, "device_count": jax.device_count(), "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "host": platform.node(),
        "backend": jax.default_backend(),
        "model": {"shape": "tiny" if tiny else "Llama-3.1-8B", "layers": args.layers, "dtype": "bfloat16",
                  "weights": "random"},
        "adapters": {"count": args.adapters, "distinct_in_trace": int(len(set(trace.adapters.tolist()))),
                     "r": serve_bench.LORA.r, "lora_alpha": serve_bench.LORA.lora_alpha,
                     "weight_sets": args.weight_sets},
        "trace": {"requests": args.requests, "mode": "throughput", "lengths": [args.min_len, args.max_len],
                  "prompt_tokens": int(trace.prompt_lens.sum()), "output_tokens": int(trace.output_lens.sum())},
        "engine": dataclasses.asdict(engine_config), "settings": dict(vars(args)), "setup_s": setup_s,
        "step_programs": [list(s) for s in shapes], "engines": {},
    }
    meshes = {1: None, tp: sharding.make_mesh(tensor=tp, devices=jax.devices()[:tp])}

    def prepare(size):
        start = time.perf_counter()
        info = serve_bench.compile_all(model, engine_config, args.compile_threads, mesh=meshes[size], shapes=shapes)
        return info, time.perf_counter() - start

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        compiled = dict(zip(meshes, pool.map(prepare, meshes)))
    report["compile_s"] = time.perf_counter() - t
    print(f"compiled both engines in {report['compile_s']:.0f} s", flush=True)
    print(HEADER, flush=True)
    for size, mesh in meshes.items():
        name = f"TP={size}"
        compile_info, compile_s = compiled[size]
        entry = {"devices": size, "compile_s": compile_s, "compile": compile_info}
        for label, adapters in (("lora", factory), ("base", None)):
            if label == "base" and args.no_base:
                continue
            runs = [serve_bench.run_trace(model, engine_config, trace, prompts, adapters, mesh=mesh, shapes=shapes)
                    for _ in range(args.repeats)]
            entry[label] = median_run(runs)
            print_row(f"{name} ({size} dev)", label, entry[label])
        report["engines"][name] = entry
        write_json(args.out, report)
    one, many = report["engines"]["TP=1"], report["engines"][f"TP={tp}"]
    report["speedup"] = {label: many[label]["tokens_per_s"] / one[label]["tokens_per_s"]
                         for label in ("lora", "base") if label in one}
    report["total_s"] = time.perf_counter() - t0
    write_json(args.out, report)
    print("TP=%d / TP=1 generated tokens/s: %s" % (tp, ", ".join(f"{k} x{v:.2f}" for k, v in report["speedup"].items())))
    print(f"device: {device}, jax {jax.__version__}; compile {report['compile_s']:.0f} s; "
          f"{report['total_s']:.0f} s in all; wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
