"""Pipeline-parallel multi-adapter LoRA training on a Llama-3.1-8B-shaped model (random bf16
weights): measured bubble ratio and tokens/s of our schedule against 1F1B with one adapter.

    PYTHONPATH=. python bench/pipeline.py --stages 4 [--layers 32] [--capacity 4096] \
        [--workloads xsum cnndm wikisum mixed] [--variants ours 1f1b-single] [--out FILE]
    PYTHONPATH=. python bench/pipeline.py --stages 2 1 --variants ours   # PP=2 against one GPU
    PYTHONPATH=. python bench/pipeline.py --stages --simulate-stages 4   # 4 stages replayed, any GPU count
    XLA_FLAGS=--xla_force_host_platform_device_count=4 PYTHONPATH=. python bench/pipeline.py --tiny

Runs `jaxlora.parallel.mpmd.MpmdPipeline`: one stage of contiguous layers per GPU, each stage's
forward / backward (with per-layer recomputation) / per-adapter AdamW steps jitted on its own
device, issued op by op in 1F1B order; activations and gradients move with `jax.device_put`.
Four adapters (r=16, alpha=32, all seven projections), each with `--batches` global batches;
an adapter's global batch holds about `--microbatches-per-batch` microbatches' worth of tokens
(samples = that many x capacity / the dataset's mean length), as in LoRAFusion's setting.

Variants (same samples, same stage programs, one run each):
  ours         LoRAFusion's schedule (`build_schedule`: grouping, two-stage MILP, merging, the
               bubble lemma's no-ops for S stages), all adapters in one continuous 1F1B stream;
               each adapter's optimizer step follows its global batch's last backward, per stage.
  1f1b-single  one adapter at a time (Megatron-style): each global batch packed alone (first-fit
               decreasing), run as its own 1F1B pass and drained before the optimizer step.

Measured: wall time of the whole run (first op issued to last result ready), tokens/s over real
(unpadded) tokens, and the bubble ratio = sum over stages of idle time / (stages x wall), where a
stage's busy time is its op counts times its op times, each op time measured alone on that GPU in
the same process (median of back-to-back repeats; shapes are fixed, so an op's time does not
depend on the microbatch). `predicted_wall_s` replays the op orders with those times (no transfer
cost) as a check. `--simulate-stages S` (for machines with fewer GPUs than S) builds S stages
over the GPUs there are, times each stage's ops alone the same way, and reports the replayed
wall time and bubble ratio (`"simulated": true` in the JSON); it runs no pipeline. Writes JSON
(device, jax version, date) to --out after every run, and a PNG.
"""

from __future__ import annotations

import argparse
import concurrent.futures
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
import optax
from flax import nnx

from bench.timing import median_call_seconds
from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.pool import AdapterPool
from jaxlora.lora.trainable import apply_adapter_update, split_pool
from jaxlora.nn.model_config import PROJECTIONS
from jaxlora.models.llama import Llama
from jaxlora.models.presets import llama8b_config
from jaxlora.parallel import mpmd
from jaxlora.scheduler.training.samples import Sample, TrainingData
from jaxlora.scheduler.training.greedy import first_fit_decreasing
from jaxlora.scheduler.training.schedule import SchedulerConfig, build_schedule
from jaxlora.scheduler.training.workloads import DATASETS, synthetic_data
from train.data import TokenizedSample
from train.microbatch import device_batch, pack_microbatch

LORA = LoraConfig(r=16, lora_alpha=32, target_modules=PROJECTIONS)
NUM_ADAPTERS = 4


def mean_length(workload: str) -> float:
    """Expected sample length of a workload's lognormal lengths."""
    means = [m * np.exp(s * s / 2) for m, s in DATASETS.values()] if workload == "mixed" else \
        [DATASETS[workload][0] * np.exp(DATASETS[workload][1] ** 2 / 2)]
    return float(np.mean(means))


def workload_data(workload: str, capacity: int, batches: int, per_batch: int, seed: int = 1):
    """The workload's 4 adapters, lengths clipped to the capacity (a no-op at 4096)."""
    size = max(1, round(per_batch * capacity / min(mean_length(workload), capacity / 2)))
    data = synthetic_data(workload, NUM_ADAPTERS, batches * size, size, seed=seed)
    return TrainingData.from_lengths({a: [min(n, capacity) for n in data.lengths[a]] for a in data.adapters}, size)


def single_adapter_plan(data, capacity: int):
    """1F1B-single: (microbatches, segments): each adapter's global batches in turn, each packed
    alone with first-fit decreasing and run as its own drained 1F1B pass."""
    microbatches, segments = [], []
    for adapter in data.adapters:
        size = data.global_batch_size[adapter]
        lengths = data.lengths[adapter]
        for start in range(0, len(lengths), size):
            samples = [Sample(adapter, i, lengths[i]) for i in range(start, min(start + size, len(lengths)))]
            packed = sorted(first_fit_decreasing(samples, capacity, 1), key=lambda mb: min(s.sample_index for s in mb))
            segments.append(list(range(len(microbatches), len(microbatches) + len(packed))))
            microbatches.extend(packed)
    return microbatches, segments


def microbatch_arrays(data, microbatches, tokens: dict, capacity: int):
    """(batch, plan) host arrays per microbatch (None for a no-op); weights 1 / target tokens of
    the sample's global batch, so a global batch's gradient is its mean-loss gradient."""
    out = []
    for mb in microbatches:
        if not mb:
            out.append(None)
            continue
        entries = []
        for s in mb:
            size = data.global_batch_size[s.adapter_id]
            batch = s.sample_index // size
            targets = sum(n - 1 for n in data.lengths[s.adapter_id][batch * size:(batch + 1) * size])
            t = tokens[(s.adapter_id, s.sample_index)]
            entries.append((s.adapter_id, TokenizedSample(t, np.ones(len(t), bool), "synthetic"), 1.0 / targets))
        out.append(device_batch(pack_microbatch(entries, capacity, NUM_ADAPTERS), NUM_ADAPTERS))
    return out


def warm_up(pipeline: mpmd.MpmdPipeline, placed) -> None:
    """Compiles every stage's forward, backward and each slot's update, stages in parallel threads
    (each stage fed a stand-in input; the updates see the warm-up's gradients)."""
    def one(index):
        stage = pipeline.stages[index]
        tokens, batch, plan = placed[index]
        hidden_shape = (*tokens.shape, pipeline_model_dim(pipeline))
        x = tokens if index == 0 else jax.device_put(jnp.ones(hidden_shape, jnp.bfloat16), stage.placement.target)
        out, saved = stage.program.forward(stage.weights, stage.trainable, stage.frozen, x, batch, plan)
        cotangent = None if stage.program.last else jnp.ones_like(out)
        stage.grads_acc, _ = stage.program.backward(stage.weights, stage.trainable, stage.frozen, saved,
                                                    stage.grads_acc, cotangent, batch, plan)
        jax.block_until_ready(stage.grads_acc)

    with concurrent.futures.ThreadPoolExecutor(pipeline.num_stages) as pool:
        list(pool.map(one, range(pipeline.num_stages)))
    orders = [[mpmd.Op("U", slot) for slot in range(NUM_ADAPTERS)] for _ in pipeline.stages]
    pipeline.run(orders, [])
    pipeline.wait()


def pipeline_model_dim(pipeline) -> int:
    return pipeline.stages[0].program.config.hidden_size


def op_times(pipeline: mpmd.MpmdPipeline, placed, repeats: int) -> dict[str, list[float]]:
    """Seconds of one F, B and U op on each stage, each measured alone on its GPU."""
    times = {"F": [], "B": [], "U": []}
    for index, stage in enumerate(pipeline.stages):
        tokens, batch, plan = placed[index]
        x = tokens if index == 0 else jax.device_put(
            jnp.ones((*tokens.shape, pipeline_model_dim(pipeline)), jnp.bfloat16), stage.placement.target)
        program = stage.program
        out, saved = program.forward(stage.weights, stage.trainable, stage.frozen, x, batch, plan)
        cotangent = None if program.last else 1e-3 * jnp.ones_like(out)
        forward = lambda: program.forward(stage.weights, stage.trainable, stage.frozen, x, batch, plan)[0]
        times["F"].append(median_call_seconds(forward, repeats))

        def backward():
            stage.grads_acc, grad_in = program.backward(stage.weights, stage.trainable, stage.frozen, saved,
                                                        stage.grads_acc, cotangent, batch, plan)
            return stage.grads_acc

        times["B"].append(median_call_seconds(backward, repeats))

        def update():
            stage.trainable, stage.grads_acc, stage.opt_states[0] = apply_adapter_update(
                pipeline.optimizers[0], stage.trainable, stage.grads_acc, 0, pipeline.ranks[0], stage.opt_states[0])
            return stage.trainable

        times["U"].append(median_call_seconds(update, repeats))
    return times


def copy_blocks(devices) -> float:
    """Seconds that `jax.device_put` to another device holds its caller while the source is still
    being computed (~0: the copy is queued asynchronously; ~the compute time: it waits)."""
    if len(devices) < 2:
        return 0.0
    size = 4096 if devices[0].platform == "gpu" else 256
    x = jax.device_put(jnp.ones((size, size), jnp.bfloat16), devices[0])
    chain = jax.jit(lambda x: jax.lax.fori_loop(0, 200, lambda _, y: (y @ x) * 1e-3, x))
    jax.block_until_ready(chain(x))
    y = chain(x)
    start = time.perf_counter()
    moved = jax.device_put(y, devices[1])
    held = time.perf_counter() - start
    jax.block_until_ready(moved)
    return held


def op_orders(data, microbatches, segments, num_stages: int, slot_of) -> list:
    """Each stage's 1F1B op order (optimizer steps after each global batch; lemma checked)."""
    completions = mpmd.completions_of(microbatches, data.global_batch_size, slot_of)
    empty = frozenset(i for i, mb in enumerate(microbatches) if not mb)
    orders = mpmd.stage_orders(segments, num_stages, completions, empty)
    mpmd.check_update_order(orders, microbatches, data.global_batch_size, slot_of)
    return orders


def run_variant(model, trainable, frozen, devices, data, microbatches, segments, tokens, capacity, slot_of,
                threaded: bool):
    """One timed run; returns its measurements and the op orders."""
    optimizer = optax.adamw(1e-4)
    pipeline = mpmd.MpmdPipeline(model, trainable, frozen, devices, optimizer, LORA.r)
    orders = op_orders(data, microbatches, segments, len(devices), slot_of)
    arrays = microbatch_arrays(data, microbatches, tokens, capacity)
    placed = [None if item is None else pipeline.place(*item) for item in arrays]
    first = next(p for p in placed if p is not None)
    warm_up(pipeline, first)
    jax.block_until_ready(placed)
    start = time.perf_counter()
    losses = pipeline.run(orders, placed, threaded=threaded)
    jax.block_until_ready(losses)
    pipeline.wait()
    wall = time.perf_counter() - start
    loss = float(sum(np.asarray(v).sum() for v in losses.values()))
    return pipeline, orders, first, wall, loss


OP_TIMES: dict[int, dict] = {}


def variant_plan(args, stages: int, workload: str, variant: str):
    """(data, microbatches, segments) of a variant: our schedule for `stages` stages, or one
    adapter's global batch at a time."""
    data = workload_data(workload, args.capacity, args.batches, args.microbatches_per_batch)
    if variant == "ours":
        schedule = build_schedule(data, SchedulerConfig(capacity=args.capacity, num_stages=stages,
                                                        padding_multiple=1, time_limit_s=args.milp_time))
        return data, list(schedule.microbatches), [list(range(len(schedule.microbatches)))]
    return (data, *single_adapter_plan(data, args.capacity))


def sample_tokens(model, data) -> dict:
    rng = np.random.default_rng(2)
    return {(a, i): rng.integers(0, model.config.vocab_size, n).astype(np.int32)
            for a in data.adapters for i, n in enumerate(data.lengths[a])}


def simulate_stages(args, model, trainable, frozen, stages: int, workload: str, variant: str) -> dict:
    """The bubble ratio and tokens/s of `stages` stages from measured op times, where the machine
    has fewer GPUs than stages: stage i is built on device i mod (devices), each stage's F/B/U op
    is timed alone on its device (as in `measure`), and the op orders are replayed with those
    times (`mpmd.simulate`, transfers free). Nothing here runs the pipeline itself."""
    devices = [jax.devices()[i % len(jax.devices())] for i in range(stages)]
    data, microbatches, segments = variant_plan(args, stages, workload, variant)
    orders = op_orders(data, microbatches, segments, stages, {a: a for a in data.adapters})
    key = ("simulated", stages)
    if key not in OP_TIMES:
        pipeline = mpmd.MpmdPipeline(model, trainable, frozen, devices, optax.adamw(1e-4), LORA.r)
        first_mb = next(mb for mb in microbatches if mb)
        arrays = microbatch_arrays(data, [first_mb], sample_tokens(model, data), args.capacity)[0]
        first = pipeline.place(*arrays)
        warm_up(pipeline, first)
        OP_TIMES[key] = op_times(pipeline, first, args.repeats)
        del pipeline
    times = OP_TIMES[key]
    wall, busy = mpmd.simulate(orders, times)
    real = sum(s.num_tokens for mb in microbatches for s in mb)
    return {"stages": stages, "simulated": True, "devices_used": len(set(devices)), "workload": workload,
            "variant": variant, "wall_s": wall, "tokens": real, "tokens_per_s": real / wall,
            "bubble_ratio": 1.0 - sum(busy) / (stages * wall), "idle_s_per_stage": [wall - b for b in busy],
            "busy_s_per_stage": busy, "op_seconds": times, "microbatches": sum(1 for mb in microbatches if mb),
            "noops": sum(1 for mb in microbatches if not mb), "passes": len(segments),
            "global_batch_size": data.global_batch_size[0],
            "padding_waste": 1 - real / (sum(1 for mb in microbatches if mb) * args.capacity)}


def measure(args, model, trainable, frozen, stages: int, workload: str, variant: str) -> dict:
    devices = jax.devices()[:stages]
    if len(devices) < stages:
        raise SystemExit(f"--stages {stages} needs {stages} devices; this machine has {len(jax.devices())} "
                         "(--simulate-stages replays S stages from measured op times)")
    data, microbatches, segments = variant_plan(args, stages, workload, variant)
    tokens = sample_tokens(model, data)
    slot_of = {a: a for a in data.adapters}
    pipeline, orders, first, wall, loss = run_variant(model, trainable, frozen, devices, data, microbatches,
                                                      segments, tokens, args.capacity, slot_of, args.threaded)
    if stages not in OP_TIMES:  # fixed shapes: one measurement per pipeline size
        OP_TIMES[stages] = op_times(pipeline, first, args.repeats)
    times = OP_TIMES[stages]
    counts = [{kind: sum(op.kind == kind for op in ops) for kind in "FBU"} for ops in orders]
    busy = [sum(counts[s][k] * times[k][s] for k in "FBU") for s in range(stages)]
    predicted, _ = mpmd.simulate(orders, times)
    real = sum(s.num_tokens for mb in microbatches for s in mb)
    del pipeline
    return {"stages": stages, "workload": workload, "variant": variant, "wall_s": wall,
            "tokens": real, "tokens_per_s": real / wall,
            "bubble_ratio": 1.0 - sum(busy) / (stages * wall),
            "idle_s_per_stage": [wall - b for b in busy], "busy_s_per_stage": busy,
            "predicted_wall_s": predicted, "predicted_bubble_ratio": 1.0 - sum(busy) / (stages * predicted),
            "op_seconds": times, "microbatches": sum(1 for mb in microbatches if mb),
            "noops": sum(1 for mb in microbatches if not mb), "passes": len(segments),
            "global_batch_size": data.global_batch_size[0], "padding_waste": 1 - real / (
                sum(1 for mb in microbatches if mb) * args.capacity), "loss_sum": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="*", default=[4], help="pipeline sizes to run (1 = one GPU)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; --tiny: 4)")
    parser.add_argument("--capacity", type=int, default=None, help="tokens per microbatch (default 4096; --tiny: "
                        "256; longer samples are clipped to it)")
    parser.add_argument("--batches", type=int, default=2, help="global batches per adapter")
    parser.add_argument("--microbatches-per-batch", type=float, default=4.0)
    parser.add_argument("--workloads", nargs="+", default=["xsum", "cnndm", "wikisum", "mixed"])
    parser.add_argument("--variants", nargs="+", default=["ours", "1f1b-single"], choices=["ours", "1f1b-single"])
    parser.add_argument("--milp-time", type=float, default=1.0, help="MILP time limit per stage (s)")
    parser.add_argument("--repeats", type=int, default=5, help="back-to-back calls per op timing round")
    parser.add_argument("--driver", choices=["auto", "single", "threaded"], default="auto",
                        help="who issues the ops (auto: threaded if a cross-device copy blocks its caller)")
    parser.add_argument("--simulate-stages", type=int, nargs="*", default=[],
                        help="pipeline sizes to replay from measured op times (more stages than GPUs allowed), "
                             "after the measured --stages runs")
    parser.add_argument("--tiny", action="store_true", help="tiny model, capacity 256 (CPU smoke test)")
    parser.add_argument("--out", default="bench/results/pipeline.json")
    args = parser.parse_args()
    args.layers = args.layers or (4 if args.tiny else 32)
    args.capacity = args.capacity or (256 if args.tiny else 4096)
    config = llama8b_config(args.layers, args.tiny)
    model = Llama(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    pool = AdapterPool(config, num_slots=NUM_ADAPTERS, max_rank=LORA.r, dtype=jnp.bfloat16)
    for index in range(NUM_ADAPTERS):
        pool.load(random_adapter(f"adapter{index}", config, LORA, seed=index))
    trainable, frozen = split_pool(pool.arrays)
    device = jax.devices()[0].device_kind
    held = copy_blocks(jax.devices()[:2])
    args.threaded = args.driver == "threaded" or (args.driver == "auto" and held > 0.01)
    print(f"device_put held its caller {held * 1e3:.1f} ms -> {'threaded' if args.threaded else 'single-thread'} "
          "driver", flush=True)
    results = []
    print(f"{'S':>2} {'workload':8} {'variant':12} {'tokens/s':>9} {'wall s':>7} {'bubble':>7} {'pred.':>6} "
          f"{'mb':>4} {'noop':>4}", flush=True)
    runs = [(stages, measure) for stages in args.stages] + \
        [(stages, simulate_stages) for stages in args.simulate_stages]
    for stages, run in runs:
        for workload in args.workloads:
            for variant in args.variants:
                r = run(args, model, trainable, frozen, stages, workload, variant)
                results.append(r)
                predicted = f"{r['predicted_bubble_ratio']:6.3f}" if "predicted_bubble_ratio" in r else f"{'sim.':>6}"
                print(f"{stages:2} {workload:8} {variant:12} {r['tokens_per_s']:9.0f} {r['wall_s']:7.2f} "
                      f"{r['bubble_ratio']:7.3f} {predicted} {r['microbatches']:4} {r['noops']:4}", flush=True)
                write_report(args, device, results)
    print(f"device: {device} x {len(jax.devices())}, jax {jax.__version__}, {args.layers} layers, "
          f"capacity {args.capacity}; wrote {args.out}")


def write_report(args, device: str, results: list) -> None:
    report = {"device": device, "devices": len(jax.devices()), "jax": jax.__version__,
              "date": datetime.date.today().isoformat(), "host": platform.node(), "layers": args.layers,
              "driver": "threaded" if args.threaded else "single-thread",
              "capacity": args.capacity, "batches": args.batches, "adapters": NUM_ADAPTERS, "rank": LORA.r,
              "microbatches_per_batch": args.microbatches_per_batch, "results": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    plot(args.out, results)


def plot(path: str, results: list) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"S={r['stages']}{' (sim.)' if r.get('simulated') else ''} {r['workload']}\n{r['variant']}"
              for r in results]
    colors = ["tab:blue" if r["variant"] == "ours" else "tab:gray" for r in results]
    axes[0].bar(range(len(results)), [r["bubble_ratio"] for r in results], color=colors)
    axes[0].set_ylabel("measured bubble ratio")
    axes[1].bar(range(len(results)), [r["tokens_per_s"] for r in results], color=colors)
    axes[1].set_ylabel("tokens/s")
    for ax in axes:
        ax.set_xticks(range(len(results)), labels, rotation=90, fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.splitext(path)[0] + ".png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
