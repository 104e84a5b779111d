"""Cluster benchmark in Punica's style (its Fig. 13): Punica placement against round robin.

A time-varying request rate (up, then down: rate(t) = peak * sin(pi t / T)) is replayed over N
replicas, once with each placement policy (`jaxlora.scheduler.serving.placement`: `place`, the
busiest replica with room; `RoundRobin`):

- measured: N real engines behind a `serve.replicas.ReplicaSet`, one per device when N devices
  exist (on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count=4), else all on the default
  device; a small random Llama and 8 random adapters (Punica's "skewed" popularity, Zipf 1.5).
  Every 50 ms the batch of each replica (requests placed there, not finished) is sampled: per-
  replica batch over time, busy replicas (batch > 0) over time, throughput (generated tokens /
  makespan) and request latency.
- simulated: 8 to 64 replicas in a discrete-event model (each replica steps while it has work,
  a step takes a + b * batch and gives each running request one token; prefill is one step;
  admission reserves prompt + output pages), at a peak rate of 70% of the cluster's capacity,
  with a and b from the 8B decode steps measured on an H200 (docs: 4.5 ms at 32 rows, 8.3 ms at
  256 rows; `--sim-step-ms`).

Consolidation is the point: Punica keeps few replicas busy with large batches, so idle ones can
be released; round robin spreads every request and keeps all of them busy with small batches.
On a CPU the measured throughput is the host's (the engines share its cores), not a GPU's.

Run: XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu PYTHONPATH=. \\
     python bench/cluster.py            (writes bench/results/cluster_<platform>.json and .png)
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import json
import math
import os
import sys
import threading
import time
from importlib.metadata import version
from pathlib import Path

# As in bench/serve.py: run as a script, this folder would come first on sys.path and hide the
# `serve` package behind bench/serve.py.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxlora.lora.adapter import random_adapter  # noqa: E402
from jaxlora.lora.adapter_config import LoraConfig  # noqa: E402
from jaxlora.nn.model_config import LlamaConfig  # noqa: E402
from jaxlora.models.llama import Llama  # noqa: E402
from jaxlora.sampling import SamplingParams  # noqa: E402
from jaxlora.scheduler.serving import ReplicaState, RoundRobin, pages_for, place  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.replicas import ReplicaSet, engine_device  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MODEL = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                    head_dim=32)
ENGINE = EngineConfig(max_adapters_on_device=4, max_lora_rank=8, page_size=16, max_model_len=128, max_num_seqs=8,
                      token_budget=64, prefill_chunk=32)
POLICIES = {"punica": lambda: place, "round_robin": RoundRobin}


def workload(duration_s: float, peak_rate: float, adapters: int, seed: int, prompt=(8, 24), output=(48, 96)):
    """[(arrival s, prompt length, output length, adapter index)]: arrivals of a Poisson process of
    rate peak * sin(pi t / duration) (thinning), lengths uniform, adapters Zipf(1.5)-skewed."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, adapters + 1) ** 1.5
    requests, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / peak_rate)
        if t >= duration_s:
            return requests
        if rng.random() < math.sin(math.pi * t / duration_s):
            requests.append((t, int(rng.integers(*prompt)), int(rng.integers(*output)),
                             int(rng.choice(adapters, p=weights / weights.sum()))))


def summarize(latencies, tokens: int, makespan: float, times, batches) -> dict:
    """Throughput, latency percentiles, and busy replicas (time-weighted mean, peak) of one run."""
    busy = (np.asarray(batches) > 0).sum(axis=1)
    return {"requests": len(latencies), "generated_tokens": tokens, "makespan_s": makespan,
            "throughput_tok_s": tokens / makespan, "latency_mean_s": float(np.mean(latencies)),
            "latency_p50_s": float(np.percentile(latencies, 50)), "latency_p90_s": float(np.percentile(latencies, 90)),
            "busy_replicas_mean": float(busy.mean()), "busy_replicas_max": int(busy.max()),
            "times_s": [round(t, 3) for t in times], "batch_per_replica": [list(map(int, b)) for b in batches]}


# ---- measured: real engines ---------------------------------------------------------------------
def build_engines(count: int) -> tuple[list[Engine], str]:
    """`count` engines (one per device if there are enough, else on the default device) with 8
    random adapters; and how they were placed, in words."""
    model = Llama(MODEL, rngs=nnx.Rngs(0))
    adapters = {f"ad{i}": random_adapter(f"ad{i}", MODEL, LoraConfig(r=8, lora_alpha=16), seed=i, b_std=0.2)
                for i in range(8)}
    devices = jax.devices()
    if len(devices) >= count:
        engines = ReplicaSet.on_devices(model, (), ENGINE, adapters, devices[:count]).engines
        return engines, f"one engine per device ({', '.join(engine_device(e) for e in engines)})"
    return [Engine(model, (), ENGINE, adapters) for _ in range(count)], f"{count} engines on {devices[0]}"


def run_measured(engines: list[Engine], policy, requests, sample_s: float = 0.05) -> dict:
    """Replays `requests` in real time over a ReplicaSet with `policy`; samples batches meanwhile."""
    replicas = ReplicaSet(engines, policy)
    done = threading.Event()
    finished, latencies, counts = [0], [], []
    lock = threading.Lock()

    def make_callback(start):
        generated = [0]

        def on_event(event):
            generated[0] += event.token is not None
            if event.finish_reason is not None:
                with lock:
                    latencies.append(time.perf_counter() - start)
                    counts.append(generated[0])
                    finished[0] += 1
                    if finished[0] == len(requests):
                        done.set()
        return on_event

    times, batches = [], []

    def sample():
        t0 = time.perf_counter()
        while not done.is_set():
            times.append(time.perf_counter() - t0)
            batches.append([s.batch for s in replicas.states()])
            time.sleep(sample_s)

    rng = np.random.default_rng(1)
    replicas.start()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    for index, (arrival, prompt_len, output_len, adapter) in enumerate(requests):
        time.sleep(max(0.0, t0 + arrival - time.perf_counter()))
        prompt = rng.integers(0, MODEL.vocab_size, prompt_len).tolist()
        replicas.submit(index, prompt, f"ad{adapter}", SamplingParams(output_len, ignore_eos=True),
                        make_callback(time.perf_counter()))
    done.wait()
    makespan = time.perf_counter() - t0
    sampler.join()
    replicas.stop()
    return summarize(latencies, sum(counts), makespan, times, batches)


# ---- simulated: many replicas ---------------------------------------------------------------------
def simulate(policy, replicas: int, requests, step_ms: tuple[float, float], max_batch: int, num_pages: int,
             page_size: int, sample_s: float) -> dict:
    """The discrete-event model of the module doc over `requests` [(arrival, prompt, output, adapter)]."""
    running = [[] for _ in range(replicas)]  # per replica: [request index, tokens left]
    used = [0] * replicas  # KV pages reserved on each replica
    pages = [pages_for(p + o, page_size) for _, p, o, _ in requests]
    events = [(request[0], 0, index) for index, request in enumerate(requests)]  # (time, 0 arrival | 1 step, key)
    heapq.heapify(events)
    queue, latencies = [], []

    def step_at(now, replica):
        heapq.heappush(events, (now + (step_ms[0] + step_ms[1] * len(running[replica])) / 1e3, 1, replica))

    def pump(now):
        while queue:
            index = queue[0]
            _, prompt, output, adapter = requests[index]
            states = [ReplicaState(i, len(running[i]), max_batch, num_pages - used[i], page_size,
                                   adapters=frozenset(requests[r[0]][3] for r in running[i][:4]))
                      for i in range(replicas)]
            chosen = policy(states, prompt, prompt + output, adapter, ())
            if chosen is None:
                return
            queue.pop(0)
            running[chosen].append([index, output])
            used[chosen] += pages[index]
            if len(running[chosen]) == 1:  # it was idle: it steps again
                step_at(now, chosen)

    times, batches, tokens, now, last_sample = [], [], 0, 0.0, 0.0
    while events:
        now, kind, key = heapq.heappop(events)
        while last_sample + sample_s <= now:
            last_sample += sample_s
            times.append(last_sample)
            batches.append([len(r) for r in running])
        if kind == 0:
            queue.append(key)
        else:  # a step: one token for each running request (the first one by its prefill step)
            tokens += len(running[key])
            for entry in running[key]:
                entry[1] -= 1
            for entry in [e for e in running[key] if e[1] == 0]:
                running[key].remove(entry)
                used[key] -= pages[entry[0]]
                latencies.append(now - requests[entry[0]][0])
            if running[key]:
                step_at(now, key)
        pump(now)
    return summarize(latencies, tokens, now - requests[0][0], times, batches)


def run_simulations(sizes, step_ms, seed: int, duration_s: float = 30.0) -> dict:
    """Both policies at each cluster size: 32 rows a replica, a peak rate of 70% of capacity."""
    max_batch, page_size, prompt, output = 32, 16, (8, 512), (16, 256)
    results = {}
    for size in sizes:
        step_s = (step_ms[0] + step_ms[1] * max_batch) / 1e3
        capacity = size * max_batch / (step_s * (np.mean(output) + 1))  # requests/s when every replica is full
        requests = workload(duration_s, 0.7 * capacity, 8, seed, prompt, output)
        runs = {name: simulate(make(), size, requests, step_ms, max_batch, 32 * 48, page_size, 0.5)
                for name, make in POLICIES.items()}
        results[str(size)] = {name: {k: v for k, v in run.items() if not isinstance(v, list)}  # summaries only
                              for name, run in runs.items()}
    return results


# ---- output --------------------------------------------------------------------------------------
def plot(result: dict, path: Path) -> None:
    """Busy replicas over time (measured), each policy's batch per replica over time, and the
    simulated busy fraction against the cluster size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    measured = result["measured"]
    for name, style in (("punica", "-"), ("round_robin", "--")):
        run = measured[name]
        busy = (np.asarray(run["batch_per_replica"]) > 0).sum(axis=1)
        axes[0, 0].plot(run["times_s"], busy, style, label=f"{name} (mean {run['busy_replicas_mean']:.2f})")
    axes[0, 0].set(title=f"measured: busy replicas ({result['device']}, {result['replicas']} replicas)",
                   xlabel="time (s)", ylabel="replicas with work")
    for axis, name in ((axes[0, 1], "punica"), (axes[1, 0], "round_robin")):
        run = measured[name]
        for replica, series in enumerate(np.asarray(run["batch_per_replica"]).T):
            axis.plot(run["times_s"], series, lw=0.8, label=f"replica {replica}")
        axis.set(title=f"measured: batch per replica, {name} ({run['throughput_tok_s']:.0f} tok/s)",
                 xlabel="time (s)", ylabel="requests placed")
    sizes = sorted(result["simulated"], key=int)
    for name, marker in (("punica", "o"), ("round_robin", "s")):
        means = [result["simulated"][s][name]["busy_replicas_mean"] / int(s) for s in sizes]
        axes[1, 1].plot([int(s) for s in sizes], means, marker=marker, label=name)
    axes[1, 1].set(title=f"simulated, H200 step times ({result['sim_step_ms'][0]:g} + {result['sim_step_ms'][1]:g} "
                         f"ms/row), peak 70% load", xlabel="replicas", ylabel="busy fraction of replicas (time mean)",
                   xticks=[int(s) for s in sizes], ylim=(0, 1.05))
    for axis in axes.flat:
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of the measured replay")
    parser.add_argument("--peak-rate", type=float, default=80.0, help="requests/s at the peak of the measured replay")
    parser.add_argument("--sim-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--sim-step-ms", type=float, nargs=2, default=[4.3, 0.0156], metavar=("A", "B"),
                        help="simulated step time a + b * batch in ms (default: an 8B decode step on an H200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    engines, placement = build_engines(args.replicas)
    started = time.perf_counter()
    for engine in engines:
        engine.warmup(background=False)  # every program before the timed run
    warmup_s = time.perf_counter() - started
    requests = workload(args.duration, args.peak_rate, 8, args.seed)
    measured = {name: run_measured(engines, make(), requests) for name, make in POLICIES.items()}
    device = jax.devices()[0]
    result = {
        "benchmark": "cluster", "device": f"{device.platform}: {device.device_kind}", "devices": jax.device_count(),
        "jax": version("jax"), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "replicas": args.replicas, "placement": placement, "warmup_s": warmup_s,
        "model": {k: getattr(MODEL, k) for k in ("vocab_size", "hidden_size", "num_layers", "num_heads")},
        "engine": {k: getattr(ENGINE, k) for k in ("max_num_seqs", "token_budget", "page_size", "max_model_len")},
        "workload": {"duration_s": args.duration, "peak_rate": args.peak_rate, "requests": len(requests),
                     "adapters": 8, "popularity": "zipf 1.5", "prompt": [8, 24], "output": [48, 96]},
        "measured": measured, "sim_step_ms": args.sim_step_ms,
        "simulated": run_simulations(args.sim_sizes, args.sim_step_ms, args.seed),
    }
    out = args.out or RESULTS / f"cluster_{device.platform}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"device: {result['device']} ({placement}); jax {result['jax']}")
    for name, run in measured.items():
        print(f"measured {name:12s} throughput {run['throughput_tok_s']:8.1f} tok/s  latency p50 "
              f"{run['latency_p50_s']:.2f} s  busy replicas mean {run['busy_replicas_mean']:.2f} max "
              f"{run['busy_replicas_max']}")
    for size, runs in result["simulated"].items():
        print(f"simulated {size:>3s} replicas: " + "  ".join(
            f"{name} busy {run['busy_replicas_mean']:.1f} tok/s {run['throughput_tok_s']:.0f} p50 "
            f"{run['latency_p50_s']:.2f}s" for name, run in runs.items()))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
