"""S-LoRA's thousands of adapters through the disk tier: 2000 PEFT adapter folders on disk served by
`serve.engine.Engine` with `adapter_dir` and a host cache bound far below their total, against the
same trace on one adapter, with and without unified paging, in one run.

    PYTHONPATH=. python bench/slora_disk.py --write-only            # write the adapters (resumable)
    PYTHONPATH=. python bench/slora_disk.py --cases slora:n=2000,alpha=1 [--runs disk separate one]
    PYTHONPATH=. python bench/slora_disk.py --cases punica:distinct --mode throughput --runs disk one
    PYTHONPATH=. python bench/slora_disk.py --tiny                   # CPU smoke test (tiny model)
    PYTHONPATH=. python bench/slora_disk.py --runs disk one --profile-steps 600 100   # GPU: which side paces it

Adapters (Done-when 3 of issue 20): `--adapters` folders `task-0000`.. under `--dir`, PEFT format
(adapter_config.json + adapter_model.safetensors, bfloat16), ranks cycling over `--ranks` on
`--targets` (default q_proj, v_proj at ranks 4/8/16: ~8 MB each on the Llama-3.1-8B shape, ~16 GB
for 2000; the script prints the total and refuses more than `--max-disk-gb`). Adapter i's A/B are
slices of one random buffer at an offset of its own, so every adapter holds different weights
without generating 16 GB of random numbers. Folders already written are kept (resumable).

Runs per case (`--runs`; each on a fresh engine, warmed up, nothing compiled while timed; an
untimed warm-up run of 8 requests on the last adapters comes first):
  disk      every request names its adapter by folder name: the engine reads it from disk on
            first use (`EngineConfig.adapter_dir`; no adapter is registered beforehand) into a host
            cache bounded by `--host-bound-gb`, then into the device pool; unified paging on: KV pages
            and adapter rows in one budget, each adapter in exactly its rank of device rows
            (`--adapter-rows` of them; `jaxlora.lora.rows`), the LoRA kernels reading rows through
            a row table;
  separate  the same with unified paging off (separate KV and adapter pools, max-rank slots);
  one       the same trace with every request on one adapter (task-0000, read once).
Cases are bench/serve.py's (`--cases`): the S-LoRA generator `slora:n=2000,alpha=1` /
`alpha=0.3`, Punica `punica:distinct` (adapter i for request i). Reported per run (JSON at --out
after every run): tokens/s, TTFT/TPOT percentiles (bench/serve.py's summary), throughput relative
to `one`, peak host RSS during the run (VmHWM, reset before it), adapter loads per tier (disk ->
host reads, host -> device copies), host cache bytes, device pages by holder (KV vs adapters:
their peaks over the run's steps), the disk and host bounds in bytes.

Both runs hold A/B for `--targets` only (`EngineConfig.lora_target_modules`). The unified run's page
budget is the separate run's KV pages plus the row pool's bytes (`unified_config`: the same usable
bytes), and it may hold `--unified-slots` adapters at once in its rows. Reported besides: the peak
of device rows held by adapters (unified paging) out of the rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import sys
import time

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from bench.serve import Record, greedy_shapes, make_trace, parse_case, recording, summarize
from bench.timing import trace_kernel_times
from jaxlora.lora import backends as lora_backends
from jaxlora.lora.adapter import LoraAdapter, ModuleLora
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.peft_io import save_peft_adapter
from jaxlora.nn.model_config import LlamaConfig, projection_shapes
from jaxlora.models.llama import Llama
from jaxlora.models.presets import llama8b_config
from jaxlora.sampling import SamplingParams
from jaxlora.scheduler.serving import SCHEDULE_POLICIES, pages_for
from serve.engine import Engine, EngineConfig

DEFAULT_CASES = ["slora:n=2000,alpha=1", "slora:n=2000,alpha=0.3", "punica:distinct"]


# ---- adapters on disk ---------------------------------------------------------------------------

def adapter_name(index: int) -> str:
    return f"task-{index:04d}"


def adapter_bytes(config: LlamaConfig, rank: int, targets) -> int:
    """Bytes of one bf16 adapter of `rank` on `targets` (A and B of every layer)."""
    shapes = projection_shapes(config)
    return sum(2 * config.num_layers * rank * (shapes[m][0] + shapes[m][1]) for m in targets)


def write_adapters(root: str, config: LlamaConfig, count: int, ranks, targets, seed: int = 0) -> dict:
    """Writes adapters 0..count-1 under `root` (folders already there are kept), in worker processes
    (one per core); returns {"written", "kept", "bytes_on_disk", "seconds"}."""
    import concurrent.futures

    started = time.perf_counter()
    os.makedirs(root, exist_ok=True)
    todo = [i for i in range(count) if not os.path.isfile(os.path.join(root, adapter_name(i),
                                                                       "adapter_model.safetensors"))]
    workers = max(1, min(os.cpu_count() or 1, 16, len(todo)))
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        list(pool.map(_write_some, [(root, config, todo[w::workers], ranks, targets, seed) for w in range(workers)]))
    total = sum(os.path.getsize(os.path.join(root, adapter_name(i), f)) for i in range(count)
                for f in os.listdir(os.path.join(root, adapter_name(i))))
    return {"written": len(todo), "kept": count - len(todo), "bytes_on_disk": total,
            "seconds": time.perf_counter() - started}


def _write_some(job) -> None:
    """Writes the adapters `indices` (a worker process; see `write_adapters`)."""
    root, config, indices, ranks, targets, seed = job
    largest = adapter_bytes(config, max(ranks), targets) // 2
    buffer = (np.random.default_rng(seed).standard_normal(largest + 4 * (max(indices, default=0) + 1),
                                                          np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    for index in indices:
        path = os.path.join(root, adapter_name(index))
        save_peft_adapter(_adapter(config, index, ranks[index % len(ranks)], targets, buffer), path + ".tmp")
        os.replace(path + ".tmp", path)  # a folder appears complete or not at all


def _adapter(config: LlamaConfig, index: int, rank: int, targets, buffer: np.ndarray) -> LoraAdapter:
    """Adapter `index`: its A/B are consecutive slices of `buffer` from offset 4 * index."""
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=tuple(targets))
    shapes, layers = projection_shapes(config), config.num_layers
    offset, modules = 4 * index, {}
    for module in targets:
        fan_in, fan_out = shapes[module]
        a = buffer[offset: offset + layers * fan_in * rank].reshape(layers, fan_in, rank)
        offset += a.size
        b = buffer[offset: offset + layers * rank * fan_out].reshape(layers, rank, fan_out)
        offset += b.size
        modules[module] = ModuleLora(a, b, np.full(layers, rank, np.int32), np.full(layers, 2.0, np.float32))
    return LoraAdapter(adapter_name(index), lora, modules)


# ---- one run --------------------------------------------------------------------------------------

def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1])


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_trace(model, config: EngineConfig, trace, prompts: list, names: list, profile=None) -> dict:
    """Serves `trace` (request i on adapter `names[i]`) on a fresh engine of `config`, warmed up;
    returns bench/serve.py's summary plus the tiers' counts, peak RSS and page split. `profile`
    (first step, steps, log dir): those steps run under a profiler trace ("profile": `StepWindow`)."""
    engine = Engine(model, eos_ids=(), config=config)
    window = None if profile is None else StepWindow(*profile)
    engine.warmup(greedy_shapes(engine, (True,)))
    gc.collect()
    _reset_peak_rss()
    rss_before = _status_kb("VmRSS")
    records = [Record() for _ in names]
    finished = [0]

    peak_pages = {"kv": 0, "adapters": 0}
    peak_rows = 0
    start, submitted, count = time.perf_counter(), 0, len(names)
    while finished[0] < count:
        now = time.perf_counter() - start
        while submitted < count and trace.arrivals[submitted] <= now:
            records[submitted].submitted = start + trace.arrivals[submitted]
            engine.submit(submitted, prompts[submitted], names[submitted],
                          SamplingParams(int(trace.output_lens[submitted])), recording(records[submitted], finished))
            submitted += 1
        if window is not None:
            window.at(engine.stats.steps)
        busy = engine.step()
        split = engine.scheduler.page_split()
        for holder in peak_pages:
            peak_pages[holder] = max(peak_pages[holder], split[holder])
        peak_rows = max(peak_rows, getattr(engine.scheduler.pages, "adapter_rows_used", 0))
        if (not busy or engine.stalled) and finished[0] < count:  # stalled: the queue waits for adapter reads
            pause = 0.01 if engine.stalled else 0.001  # a stalled engine is woken when a read ends
            if submitted < count:
                pause = max(0.0, min(pause if engine.stalled else 0.05,
                                     start + trace.arrivals[submitted] - time.perf_counter()))
            engine.wait_for_work(pause)
    result = summarize(records, start, max(r.end for r in records))
    store, stats = engine.adapters, engine.stats
    result.update({
        "peak_rss_bytes": _status_kb("VmHWM") << 10, "rss_before_bytes": rss_before << 10,
        "disk_reads": store.stats.disk_reads, "disk_read_seconds": store.stats.disk_read_seconds,
        "disk_read_max_s": store.stats.disk_read_max_s, "disk_read_errors": store.stats.disk_read_errors,
        "host_evictions": store.stats.host_evictions, "host_cache_bytes_end": store.cached_bytes(),
        "device_loads": stats.adapter_loads, "device_load_seconds": stats.adapter_load_seconds,
        "peak_pages": peak_pages, "total_pages": config.num_pages, "steps": stats.steps,
        "compiles_in_run": stats.step_compiles, "phase_ms_per_step": stats.phase_ms_per_step(),
        "steps_by_kind": stats.steps_by_kind(),
        "phase_ms_by_kind": stats.phase_ms_by_kind(), "slowest_steps": stats.slowest_steps(),
        "adapter_loads": stats.adapter_loads, "peak_adapter_rows": peak_rows,
        "adapter_rows": getattr(engine.pool, "num_rows", None),
    })
    if window is not None:
        result["profile"] = window.report()
    engine.adapters.close()
    del engine
    gc.collect()
    return result


class StepWindow:
    """Engine steps `first` .. `first + count - 1` of a run under a JAX profiler trace (to `log_dir`):
    whether the device or the host paces them. `report`: the window's wall ms a step (host loop,
    step start to step start), the device's busy ms a step (kernels' union) and their ratio, kernel
    ms a step by category, kernel launches a step, the 12 costliest kernels, and the host's costliest
    trace events by self time (`bench.timing.host_self_times`: where the host's step goes)."""

    def __init__(self, first: int, count: int, log_dir: str):
        self.first, self.count, self.log_dir = first, count, log_dir
        self.started = self.stopped = None

    def at(self, steps: int) -> None:
        """Called before each engine step with the steps run so far."""
        if self.started is None and steps >= self.first:
            jax.profiler.start_trace(self.log_dir)
            self.started, self.start_steps = time.perf_counter(), steps
        elif self.started is not None and self.stopped is None and steps >= self.start_steps + self.count:
            self.stopped, self.steps = time.perf_counter(), steps - self.start_steps
            jax.profiler.stop_trace()

    def report(self) -> dict | None:
        if self.started is None:
            return None
        if self.stopped is None:  # the run ended inside the window
            self.stopped, self.steps = time.perf_counter(), self.count
            jax.profiler.stop_trace()
        times = trace_kernel_times(self.log_dir, self.steps)
        wall_ms = (self.stopped - self.started) * 1e3 / self.steps
        return {"steps": self.steps, "wall_ms_per_step": wall_ms, "busy_ms_per_step": times["busy_ms"],
                "device_busy_fraction": times["busy_ms"] / wall_ms if wall_ms else None,
                "kernel_ms_per_step": times["device_ms"], "categories": times["categories"],
                "launches_per_step": sum(kernel["calls"] for kernel in times["kernels"]),
                "kernels": times["kernels"][:12], "host": times["host"], "host_threads": times["host_threads"]}


def print_run(case: str, label: str, r: dict) -> None:
    print(f"{case:40} {label:9} {r['tokens_per_s']:8.0f} tok/s  TTFT p50 {r['ttft_p50_ms']:6.0f} ms  "
          f"disk reads {r['disk_reads']:5d}  device loads {r['device_loads']:5d}  peak RSS "
          f"{r['peak_rss_bytes'] / 2**30:6.2f} GiB  pages kv/adapters {r['peak_pages']['kv']}/"
          f"{r['peak_pages']['adapters']}  rows {r['peak_adapter_rows']}/{r['adapter_rows']}"
          + (f"  errors {r['errors']}" if r["errors"] else ""), flush=True)


def print_profile(profile: dict, threads: int = 6, events: int = 8) -> None:
    """The profiled steps (`StepWindow.report`): wall and device ms a step, then the busiest host threads'
    costliest events by self time, ms a step."""
    print(f"  profiled {profile['steps']} steps: wall {profile['wall_ms_per_step']:.2f} ms a step, device busy "
          f"{profile['busy_ms_per_step']:.2f}, launches {profile['launches_per_step']:.0f}", flush=True)
    for thread in profile.get("host_threads", [])[:threads]:
        top = ", ".join(f"{e['name'][:48]} {e['self_ms']:.2f}" for e in thread["events"][:events])
        print(f"  thread {thread['thread'][:24]} busy {thread['busy_ms']:.2f}: {top}", flush=True)


# ---- main -------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model, 40 adapters, 24 requests (CPU smoke test)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; --tiny: 2)")
    parser.add_argument("--dir", default=None, help="adapter directory (default /tmp/slora_adapters[_tiny])")
    parser.add_argument("--adapters", type=int, default=None, help="adapter folders (default 2000; --tiny: 40)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--targets", nargs="+", default=["q_proj", "v_proj"])
    parser.add_argument("--max-disk-gb", type=float, default=24.0, help="refuse to write more than this")
    parser.add_argument("--write-only", action="store_true", help="write the adapters and stop")
    parser.add_argument("--host-bound-gb", type=float, default=None,
                        help="host cache bound (default 2 GiB; --tiny: 8 adapters' worth)")
    parser.add_argument("--cases", nargs="+", default=None, help=f"bench/serve.py case specs (default {DEFAULT_CASES})")
    parser.add_argument("--runs", nargs="+", choices=("disk", "separate", "one"), default=["disk", "separate", "one"])
    parser.add_argument("--adapter-rows", type=int, default=None,
                        help="device rows for adapters with unified paging (default: adapter-slots x max rank: the "
                             "slot pool's bytes)")
    parser.add_argument("--unified-slots", type=int, default=None,
                        help="adapters resident at once with unified paging (row-table entries; default: "
                             "--adapter-slots); more than --adapter-slots lets the rows hold more low-rank adapters")
    parser.add_argument("--requests", type=int, default=None, help="requests per case (default 1000; --tiny: 24)")
    parser.add_argument("--rate", type=float, default=None, help="requests/s in replay mode (default 8; --tiny: 50)")
    parser.add_argument("--mode", choices=("replay", "throughput"), default="replay")
    parser.add_argument("--min-len", type=int, default=None, help="lengths in [min, max) (default 8; --tiny: 4)")
    parser.add_argument("--max-len", type=int, default=None, help="(default 512; --tiny: 16)")
    parser.add_argument("--adapter-slots", type=int, default=None, help="device pool slots (default 64; --tiny: 4)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="(default 64; --tiny: 8)")
    parser.add_argument("--token-budget", type=int, default=None, help="(default 256; --tiny: 32)")
    parser.add_argument("--num-pages", type=int, default=None, help="KV pages (default: max-num-seqs contexts)")
    parser.add_argument("--lora-backend", default=None, help="default: pallas on a GPU, gather elsewhere")
    parser.add_argument("--compile-cache", default="/tmp/jaxlora_serve_jit_cache")
    parser.add_argument("--scan-layers-from-tokens", type=int, default=None,
                        help="EngineConfig.scan_layers_from_tokens (default: the engine's)")
    parser.add_argument("--prefetch-steps", type=int, default=None,
                        help="EngineConfig.prefetch_steps (default: the engine's, 0: prefetch for the whole queue)")
    parser.add_argument("--schedule-policy", default="fcfs", choices=tuple(SCHEDULE_POLICIES),
                        help="EngineConfig.schedule_policy: the waiting queue's order in every run")
    parser.add_argument("--profile-steps", type=int, nargs=2, metavar=("FIRST", "COUNT"), default=None,
                        help="trace engine steps FIRST..FIRST+COUNT-1 of each run with the JAX profiler: device "
                             "busy ms against wall ms a step, kernels by category (GPU; traces beside --out)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON (default bench/results/slora_disk[_tiny].json)")
    args = parser.parse_args(argv)
    tiny = args.tiny
    pick = lambda value, default, tiny_default: value if value is not None else (tiny_default if tiny else default)
    args.layers = pick(args.layers, 32, 2)
    args.adapters = pick(args.adapters, 2000, 40)
    args.requests = pick(args.requests, 1000, 24)
    args.rate = pick(args.rate, 8.0, 50.0)
    args.min_len, args.max_len = pick(args.min_len, 8, 4), pick(args.max_len, 512, 16)
    args.adapter_slots = pick(args.adapter_slots, 64, 4)
    args.max_num_seqs = pick(args.max_num_seqs, 64, 8)
    args.token_budget = pick(args.token_budget, 256, 32)
    args.dir = args.dir or ("/tmp/slora_adapters_tiny" if tiny else "/tmp/slora_adapters")
    args.out = args.out or f"bench/results/slora_disk{'_tiny' if tiny else ''}.json"
    args.cases = args.cases or [c.replace("n=2000", f"n={args.adapters}") for c in DEFAULT_CASES]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    config = llama8b_config(args.layers, args.tiny)
    sizes = [adapter_bytes(config, args.ranks[i % len(args.ranks)], args.targets) for i in range(args.adapters)]
    print(f"{args.adapters} adapters (ranks {args.ranks} on {args.targets}, bf16): {sum(sizes) / 2**30:.2f} GiB "
          f"on disk, {min(sizes) / 2**20:.1f}-{max(sizes) / 2**20:.1f} MiB each", flush=True)
    if sum(sizes) > args.max_disk_gb * 2**30:
        raise SystemExit(f"{sum(sizes) / 2**30:.1f} GiB > --max-disk-gb {args.max_disk_gb}: fewer ranks or targets")
    disk = write_adapters(args.dir, config, args.adapters, args.ranks, args.targets)
    print(f"adapters in {args.dir}: {disk['written']} written, {disk['kept']} kept, "
          f"{disk['bytes_on_disk'] / 2**30:.2f} GiB ({disk['seconds']:.0f} s)", flush=True)
    if args.write_only:
        return
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    host_bound = int(args.host_bound_gb * 2**30) if args.host_bound_gb else (
        8 * max(sizes) if args.tiny else 2 << 30)
    max_model_len = 2 * (args.max_len - 1)
    engine_config = EngineConfig(
        max_adapters_on_device=args.adapter_slots, max_lora_rank=max(args.ranks), page_size=16,
        num_pages=args.num_pages or args.max_num_seqs * pages_for(max_model_len, 16), max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs, token_budget=args.token_budget, prefill_chunk=min(128, args.token_budget),
        max_waiting=1 << 30, lora_backend=args.lora_backend or ("pallas" if jax.default_backend() == "gpu"
                                                                else "gather"),
        adapter_dir=args.dir, max_host_adapter_bytes=host_bound, lora_target_modules=tuple(args.targets),
        scan_layers_from_tokens=args.scan_layers_from_tokens, schedule_policy=args.schedule_policy,
        **({} if args.prefetch_steps is None else {"prefetch_steps": args.prefetch_steps}))
    model = Llama(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    device = jax.devices()[0].device_kind
    report = {"device": device, "jax": jax.__version__, "host": platform.node(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "model": {"shape": "tiny" if args.tiny else "Llama-3.1-8B", "layers": args.layers, "dtype": "bfloat16"},
              "adapters": {"count": args.adapters, "ranks": args.ranks, "targets": args.targets, "dtype": "bfloat16",
                           "bytes_on_disk": disk["bytes_on_disk"], "host_bound_bytes": host_bound},
              "engine": dataclasses.asdict(engine_config),
              "engine_unified": dataclasses.asdict(unified_config(engine_config, config, args)),
              "settings": vars(args), "results": []}
    defaults = {"requests": args.requests, "rate": args.rate, "cv": 1.0, "slora_mode": args.mode,
                "punica_mode": args.mode}
    # Warm-up (untimed), on each pool layout the runs use: programs compiled on first use (the
    # adapter window's fill, a row pool's write per adapter rank), adapter reads.
    warm = make_trace(parse_case("punica:distinct,requests=8,mode=throughput", defaults), args.seed + 1,
                      args.min_len, args.max_len, args.adapters)
    warm_configs = ([unified_config(engine_config, config, args)] if {"disk", "one"} & set(args.runs) else []) + (
        [dataclasses.replace(engine_config, unified_paging=False, adapter_rows=None)] if "separate" in args.runs else [])
    for warm_config in warm_configs:
        run_trace(model, warm_config, warm, [[1] * int(n) for n in warm.prompt_lens],
                  [adapter_name(args.adapters - 1 - int(a)) for a in warm.adapters])
    for spec in args.cases:
        case = parse_case(spec, defaults)
        trace = make_trace(case, args.seed, args.min_len, args.max_len, args.adapters)
        prompts = [np.random.default_rng([args.seed, i]).integers(0, config.vocab_size, int(n)).tolist()
                   for i, n in enumerate(trace.prompt_lens)]
        entry = {"case": case.name, "spec": dataclasses.asdict(case),
                 "distinct_adapters": int(len(set(trace.adapters.tolist())))}
        for run in args.runs:
            names = [adapter_name(0 if run == "one" else int(a)) for a in trace.adapters]
            unified = run != "separate"
            run_config = unified_config(engine_config, config, args) if unified else dataclasses.replace(
                engine_config, unified_paging=False, adapter_rows=None)
            profile = None if args.profile_steps is None else (
                *args.profile_steps, os.path.join(os.path.dirname(os.path.abspath(args.out)), f"slora_trace_{run}"))
            entry[run] = run_with_fallback(model, run_config, trace, prompts, names, profile)
            print_run(case.name, run, entry[run])
            if entry[run].get("profile"):
                print_profile(entry[run]["profile"])
        if "one" in entry:
            for run in ("disk", "separate"):
                if run in entry:
                    entry[f"{run}_vs_one"] = entry[run]["tokens_per_s"] / entry["one"]["tokens_per_s"]
        report["results"].append(entry)
        _write(args.out, report)
    print(f"device {device}, jax {jax.__version__}; wrote {args.out}", flush=True)


def run_with_fallback(model, config: EngineConfig, trace, prompts: list, names: list, profile=None) -> dict:
    """`run_trace`; if a unified-paging run's custom-kernel backend fails (the paged kernels'
    kernels have run in interpret mode, and been lowered to Triton on a CPU, only so far), the run
    again with onehot (the XLA
    GEMMs over each layer's rows gathered into slots), the failure recorded in the result."""
    try:
        return run_trace(model, config, trace, prompts, names, profile)
    except Exception as err:
        if not (config.unified_paging and lora_backends.get(config.lora_backend).custom_kernel):
            raise
        message = f"{type(err).__name__}: {str(err)[:300]}"
        print(f"the {config.lora_backend} backend failed with unified paging ({message}); using onehot", flush=True)
        result = run_trace(model, dataclasses.replace(config, lora_backend="onehot"), trace, prompts, names)
        return {**result, "lora_backend": "onehot", "failed_backend": {config.lora_backend: message}}


def unified_config(engine_config: EngineConfig, config: LlamaConfig, args) -> EngineConfig:
    """The unified run's config: `--unified-slots` table entries over `--adapter-rows` rows, and a
    page budget of the separate run's KV pages plus the row pool's bytes in pages, so that both runs
    have the same usable bytes for KV and adapters (separate: KV pages + the slot pool; unified: one
    budget both draw from). The KV array is then larger by the row pool's pages: the row pool is a
    buffer of its own (docs/architecture.md), so the run allocates more than it may use at once."""
    slots = args.unified_slots or engine_config.max_adapters_on_device
    rows = args.adapter_rows or engine_config.max_adapters_on_device * engine_config.max_lora_rank
    shapes = projection_shapes(config)
    row_bytes = 2 * config.num_layers * sum(sum(shapes[m]) for m in args.targets)  # bfloat16 A and B rows
    page_bytes = 2 * 2 * config.num_layers * engine_config.page_size * config.num_kv_heads * config.head_dim
    return dataclasses.replace(engine_config, unified_paging=True, adapter_rows=rows, max_adapters_on_device=slots,
                               num_pages=engine_config.num_pages + pages_for(rows * row_bytes, page_bytes))


def _write(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
