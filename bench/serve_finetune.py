"""Serving with a fine-tuning job in the same engine (issue 28): a serving trace at fractions of the
engine's saturation throughput, alone and with a 4-adapter training job sharing the engine (the
co-scheduling policy of `jaxlora.scheduler.core`: a training microbatch only in the steps serving
leaves idle, or below `--train-below` running requests), on a Llama-3.1-8B-shaped model.

    PYTHONPATH=. python bench/serve_finetune.py [--layers 32] [--out bench/results/serve_finetune.json]
    PYTHONPATH=. python bench/serve_finetune.py --tiny        # CPU smoke test (tiny model)

Steps: (1) the saturation throughput: the S-LoRA trace (n=100 adapters, alpha=1) in throughput
mode (every request at t=0), requests/s over the makespan; (2) the trainer alone on the idle
engine: training tokens/s of the same job (`Trainer` on `Engine.model_view`, the programs the
server runs); (3) for each `--loads` fraction: the trace replayed at that fraction of saturation,
alone and with the job (a fresh trainer each run, built and compiled before the clock starts).
Reported per load: TTFT p90 and TPOT p90 with training / alone (the target is <= 1.10), the
training tokens/s obtained during the trace and its ratio to the trainer alone.

The job: `--train-adapters` adapters (r=16, alpha=32, all projections), each on synthetic samples
of the "het" workload (`bench/synthetic_jobs.py`: a word-level tokenizer, lognormal lengths),
enough epochs that training outlasts the trace; one microbatch is `--capacity` tokens (samples
longer are truncated). A request arriving during a microbatch waits for it, so the TTFT ratio is
about one microbatch's time against TTFT p90: smaller microbatches trade training throughput for
latency (try --capacity 512 / 1024 / 2048).

The driver runs `Engine.step()` and `Engine.train_step()` in this thread (`bench.serve.run_trace`),
as the engine thread does in the server. Writes JSON to --out and a PNG next to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx

from bench.serve import (AdapterFactory, Case, LORA, compile_all, json_then_pyplot, make_trace, print_row, run_trace,
                         HEADER)
from bench.synthetic_jobs import write_synthetic_jobs
from jaxlora.models.llama import Llama
from jaxlora.models.presets import llama8b_config
from jaxlora.scheduler.core import CoSchedulePolicy
from jaxlora.scheduler.serving import pages_for
from serve.engine import Engine, EngineConfig
from train.config import JobConfig, TrainConfig, lora_config


class TrainerSource:
    """A `Trainer` as the engine's `TrainingSource`: its next microbatch, run when picked."""

    def __init__(self, trainer):
        self.trainer = trainer

    def next_item(self):
        return self.trainer.next_item()

    def run_next(self) -> None:
        self.trainer.train_next()


def timeline_shares(run: dict) -> str:
    """"serve 62%, train 20%, idle 18%" from a run's timeline summary (`bench.serve.Timeline`)."""
    return ", ".join(f"{kind} {100 * share:.0f}%" for kind, share in run["timeline"]["fraction"].items())


def job_config(data_dir: str, args, dtype: str) -> TrainConfig:
    lora = lora_config({"r": LORA.r, "alpha": LORA.lora_alpha, "targets": list(LORA.target_modules)}, "bench")
    jobs = tuple(JobConfig(f"job{i}", os.path.join(data_dir, f"adapter{i}.jsonl"), lora, learning_rate=1e-4,
                           global_batch_size=args.train_batch, epochs=args.train_epochs, seed=i)
                 for i in range(args.train_adapters))
    return TrainConfig(jobs=jobs, base_model="preset", tokenizer=os.path.join(data_dir, "tokenizer"),
                       output_dir=os.path.join(data_dir, "out"), dtype=dtype, capacity=args.capacity,
                       checkpoint_every=1 << 30, scheduler="greedy", progress=False, tensorboard=False)


def ready_trainer(engine: Engine, config: TrainConfig, tokenizer):
    """A trainer on the engine's weights, its schedule made and its grad step compiled."""
    from train.trainer import Trainer

    trainer = Trainer(config, model=engine.model_view(), tokenizer=tokenizer)
    trainer.start()
    trainer.wait_for_schedule()
    trainer.warmup()
    return trainer


def train_alone(model, engine_config: EngineConfig, config: TrainConfig, tokenizer, seconds: float) -> dict:
    """Training tokens/s of the job on an idle engine (for about `seconds`)."""
    engine = Engine(model, eos_ids=(), config=engine_config)
    trainer = ready_trainer(engine, config, tokenizer)
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        item = trainer.next_item()
        if item is None:
            break
        trainer.train_next()
        tokens += item.tokens
    elapsed = time.perf_counter() - start
    trainer.abandon()
    return {"train_tokens": tokens, "seconds": elapsed, "train_tokens_per_s": tokens / elapsed}


def write_report(path: str, report: dict) -> None:
    plt = json_then_pyplot(path, report)
    if plt is None or not report["loads"]:
        return
    loads = [r["load"] for r in report["loads"]]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, title in zip(axes, ("ttft_p90_ms", "tpot_p90_ms"), ("TTFT p90 (ms)", "TPOT p90 (ms)")):
        ax.plot(loads, [r["alone"][key] for r in report["loads"]], "o-", label="serving alone")
        ax.plot(loads, [r["with_training"][key] for r in report["loads"]], "s-", label="with training")
        ax.set_title(title)
        ax.set_xlabel("load (fraction of saturation)")
        ax.legend()
    axes[2].bar([str(x) for x in loads], [r["train_vs_alone"] for r in report["loads"]])
    axes[2].set_title("training tok/s vs trainer alone")
    axes[2].set_xlabel("load (fraction of saturation)")
    fig.suptitle(f"serving + fine-tuning in one engine, {report['device']}, {report['model']['layers']} layers")
    fig.tight_layout()
    fig.savefig(os.path.splitext(path)[0] + ".png", dpi=110)
    plt.close(fig)
    plot_timelines(plt, report, os.path.splitext(path)[0] + "_timeline.png")


COLORS = {"idle": "tab:gray", "train": "tab:orange", "serve": "tab:blue"}  # drawn in this order


def plot_timelines(plt, report: dict, path: str, seconds: float = 10.0) -> None:
    """The driver's first `seconds` of each load's run with the job, as bars of serving steps,
    training microbatches and idle time (`bench.serve.Timeline`), one row per load."""
    rows = [r for r in report["loads"] if "timeline" in r["with_training"]]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(14, 1 + 0.6 * len(rows)))
    for y, row in enumerate(rows):
        timeline = row["with_training"]["timeline"]
        for kind in COLORS:
            bars = [(t0, t1 - t0) for t0, t1, k in timeline["spans_s"] if k == kind and t0 < seconds]
            ax.broken_barh(bars, (y - 0.35, 0.7), color=COLORS[kind], label=kind if y == 0 else None)
    ax.set_yticks(range(len(rows)), [f"load {r['load']:g}" for r in rows])
    ax.set_xlim(0, min(seconds, max(r["with_training"]["timeline"]["spans_s"][-1][1] for r in rows)))
    ax.set_xlabel("seconds from the trace's start (the driver's thread)")
    ax.legend(loc="upper right", ncol=3)
    ax.set_title(f"where the time goes with the job, {report['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model, short sequences (CPU smoke test)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; --tiny: 2)")
    parser.add_argument("--requests", type=int, default=None, help="requests per trace (default 200; --tiny: 12)")
    parser.add_argument("--loads", nargs="+", type=float, default=[0.3, 0.7], help="fractions of saturation")
    parser.add_argument("--train-adapters", type=int, default=4)
    parser.add_argument("--train-samples", type=int, default=None, help="per adapter (default 256; --tiny: 16)")
    parser.add_argument("--train-batch", type=int, default=8, help="global batch size of each adapter")
    parser.add_argument("--train-epochs", type=int, default=50, help="epochs (the job should outlast each trace)")
    parser.add_argument("--capacity", type=int, default=None, help="tokens per microbatch (default 1024; --tiny 128): "
                        "a request waits for at most one microbatch, so its time against TTFT p90 decides the ratio")
    parser.add_argument("--train-below", type=int, default=0, help="the co-scheduling policy's train_below")
    parser.add_argument("--tpot-ms", type=float, default=None, help="the co-scheduling policy's TPOT target (ms)")
    parser.add_argument("--alone-seconds", type=float, default=None, help="trainer-alone run (default 60; --tiny 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-cache", default="/tmp/jaxlora_serve_jit_cache",
                        help="JAX persistent compilation cache dir ('' to disable): each run's fresh trainer and "
                             "engine find their programs there")
    parser.add_argument("--out", default="bench/results/serve_finetune.json")
    args = parser.parse_args()
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    pick = lambda value, default, tiny_default: value if value is not None else (tiny_default if args.tiny else default)
    args.layers = pick(args.layers, 32, 2)
    args.requests = pick(args.requests, 200, 12)
    args.train_samples = pick(args.train_samples, 256, 16)
    args.capacity = pick(args.capacity, 1024, 128)
    args.alone_seconds = pick(args.alone_seconds, 60.0, 5.0)
    min_len, max_len = (4, 24) if args.tiny else (8, 512)
    max_num_seqs, slots = (8, 4) if args.tiny else (64, 64)
    max_model_len = 2 * (max_len - 1)
    dtype = "float32" if args.tiny else "bfloat16"
    engine_config = EngineConfig(
        max_adapters_on_device=slots, max_lora_rank=LORA.r, page_size=16,
        num_pages=max_num_seqs * pages_for(max_model_len, 16), max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        token_budget=32 if args.tiny else 256, prefill_chunk=16 if args.tiny else 128, max_waiting=1 << 30,
        lora_backend="pallas" if jax.default_backend() == "gpu" else "gather")
    device = jax.devices()[0].device_kind
    config = llama8b_config(args.layers, args.tiny)
    model = Llama(config, rngs=nnx.Rngs(0), dtype=jnp.dtype(dtype))
    factory = AdapterFactory(config, 4)
    compile_info = compile_all(model, engine_config, min(8, os.cpu_count() or 1))
    print(f"device: {device}, {args.layers} layers; compiled {compile_info['programs']} programs in "
          f"{compile_info['seconds']:.0f} s", flush=True)

    data_dir = tempfile.mkdtemp(prefix="serve_finetune_")
    write_synthetic_jobs(data_dir, args.train_adapters, args.train_samples, "het", args.seed)
    from jaxlora.weights import load_tokenizer

    tokenizer = load_tokenizer(os.path.join(data_dir, "tokenizer"))
    train_config = job_config(data_dir, args, dtype)
    if args.tiny:  # the word-level tokenizer's vocabulary must fit the tiny model's
        assert tokenizer.vocab_size <= config.vocab_size

    saturation_case = Case("slora", "throughput", args.requests, 1.0, 1.0, n=100)
    trace = make_trace(saturation_case, args.seed, min_len, max_len, 1000)
    prompts = [[1 + (i % 100)] * int(n) for i, n in enumerate(trace.prompt_lens)]
    saturated = run_trace(model, engine_config, trace, prompts, factory)
    rate = saturated["requests_per_s"]
    print(f"saturation: {rate:.2f} requests/s, {saturated['tokens_per_s']:.0f} tok/s", flush=True)
    alone_training = train_alone(model, engine_config, train_config, tokenizer, args.alone_seconds)
    print(f"trainer alone: {alone_training['train_tokens_per_s']:.0f} training tok/s", flush=True)

    report = {"device": device, "jax": jax.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "model": {"shape": "tiny" if args.tiny else "Llama-3.1-8B", "layers": args.layers, "dtype": dtype,
                        "weights": "random"},
              "engine": dataclasses.asdict(engine_config), "settings": vars(args),
              "co_policy": {"train_below": args.train_below, "tpot_ms": args.tpot_ms}, "saturation": saturated,
              "trainer_alone": alone_training, "loads": []}
    print(HEADER, flush=True)
    policy = CoSchedulePolicy(args.train_below, None if args.tpot_ms is None else args.tpot_ms / 1e3)

    def install(engine: Engine) -> None:
        engine.co_policy = policy
        engine.training = TrainerSource(ready_trainer(engine, train_config, tokenizer))

    for load in args.loads:
        case = Case("slora", "replay", args.requests, load * rate, 1.0, n=100)
        trace = make_trace(case, args.seed, min_len, max_len, 1000)
        alone = run_trace(model, engine_config, trace, prompts, factory, timeline=True)
        shared = run_trace(model, engine_config, trace, prompts, factory, install=install, timeline=True)
        print_row(f"load {load:g} ({load * rate:.2f} req/s)", "alone", alone)
        print_row("", "+ training", shared)
        train_rate = shared["train_tokens"] / shared["duration_s"]
        row = {"load": load, "rate": load * rate, "alone": alone, "with_training": shared,
               "ttft_p90_ratio": shared["ttft_p90_ms"] / alone["ttft_p90_ms"],
               "tpot_p90_ratio": shared["tpot_p90_ms"] / alone["tpot_p90_ms"],
               "train_tokens_per_s": train_rate, "train_vs_alone": train_rate / alone_training["train_tokens_per_s"]}
        print(f"  TTFT p90 x{row['ttft_p90_ratio']:.3f}, TPOT p90 x{row['tpot_p90_ratio']:.3f}, training "
              f"{train_rate:.0f} tok/s ({row['train_vs_alone']:.2f} of the trainer alone)", flush=True)
        print("  driver time: alone " + timeline_shares(alone) + "; with the job " + timeline_shares(shared),
              flush=True)
        report["loads"].append(row)
        write_report(args.out, report)
    write_report(args.out, report)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
