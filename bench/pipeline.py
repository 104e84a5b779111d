"""Pipeline-parallel multi-adapter LoRA training on a Llama-3.1-8B-shaped model (random bf16
weights): measured bubble ratio and tokens/s of our schedule against 1F1B with one adapter.

    PYTHONPATH=. python bench/pipeline.py --stages 4 --workloads xsum mixed --batches 4 \
        --sweep-batches 2 8 --compare-copies --time-budget 480 --out FILE   # 4 GPUs: ~6-7 min on H200
    PYTHONPATH=. python bench/pipeline.py --stages 2 1 --variants ours   # PP=2 against one GPU
    PYTHONPATH=. python bench/pipeline.py --stages --simulate-stages 4   # 4 stages replayed, any GPU count
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu PYTHONPATH=. \
        python bench/pipeline.py --tiny --stages 4 --workloads xsum --batches 2 --sweep-batches 1

Runs `jaxlora.parallel.mpmd.MpmdPipeline`: one stage of contiguous layers per GPU, each stage's
forward / backward (with per-layer recomputation) / per-adapter AdamW steps jitted on its own
device, issued op by op in 1F1B order; activations and gradients move with `jax.device_put`.
Four adapters (r=16, alpha=32, all seven projections), each with `--batches` global batches;
an adapter's global batch holds about `--microbatches-per-batch` microbatches' worth of tokens
(samples = that many x capacity / the dataset's mean length), as in LoRAFusion's setting.

Layer split (`--split`): "auto" first builds the even split, times each stage's ops
(calibration), derives a layer's cost and what the embedding / head add
(`jaxlora.parallel.balance`), and runs every variant on the split that minimizes the slowest stage
(e.g. 9,8,8,7 for 32 layers on 4 H200s: the head costs ~1.7-1.9 layers); "even", or layers per
stage ("9,8,8,7"). Both variants run on the same split.

Variants (same samples, same stage programs, one run each):
  ours         LoRAFusion's schedule (`build_schedule`: grouping, two-stage MILP, merging, the
               bubble lemma's no-ops for S stages), all adapters in one continuous 1F1B stream
               (no drain between global batches); each adapter's optimizer step follows its global
               batch's last backward, per stage.
  1f1b-single  one adapter at a time (Megatron-style): each global batch packed alone (first-fit
               decreasing), run as its own 1F1B pass and drained before the optimizer step.
`--sweep-batches` adds runs of ours with other numbers of global batches (the bubble's fill and
drain are paid once per run, so it falls as the run gets longer). `--compare-copies` adds one run of
ours where the producing stage's thread copies each output to its consumer and waits for it (the
driver before 2026-11-27; by default the consumer's thread copies, `mpmd.MpmdPipeline.run`).

Measured: wall time of the whole run (first op issued to last result ready), tokens/s over real
(unpadded) tokens, and the bubble ratio = sum over stages of idle time / (stages x wall), where a
stage's busy time is the time its device takes for the run's ops back to back with stand-in
inputs and no neighbours ("solo", all stages at once, after the run); `busy_model_s_per_stage` is
op counts x each op's time measured alone on one microbatch. `predicted_wall_s` replays the op
orders with those op times (no transfer cost; `bench/pipeline_replay.py`). Before running, the
plan (every run with its replayed wall time) is printed, and runs that would not finish within
`--time-budget` are skipped. `--simulate-stages S` (for machines with fewer GPUs than S) builds
S stages over the GPUs there are, times each stage's ops alone the same way, and reports the
replayed wall time and bubble ratio (`"simulated": true` in the JSON); it runs no pipeline. Writes
JSON (device, jax version, date) to --out after every run, and a PNG. On the CPU the simulated
devices share the cores (the solo runs contend), so its bubble figures mean nothing: `--tiny`
checks that everything runs.
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

from bench.pipeline_replay import NUM_ADAPTERS, cpu_only, op_orders, replay, variant_plan
from bench.timing import median_call_seconds
from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.pool import AdapterPool
from jaxlora.lora.trainable import apply_adapter_update, split_pool
from jaxlora.nn.model_config import PROJECTIONS
from jaxlora.models.llama import Llama
from jaxlora.models.presets import llama8b_config
from jaxlora.parallel import balance, mpmd
from train.data import TokenizedSample
from train.microbatch import device_batch, pack_microbatch

LORA = LoraConfig(r=16, lora_alpha=32, target_modules=PROJECTIONS)


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


def hidden_like(pipeline: mpmd.MpmdPipeline, index: int, tokens, value: float = 1.0) -> jax.Array:
    """`value` in the shape of a hidden state [B, T, d] (bf16) of `tokens` [B, T], on stage
    `index`'s device."""
    hidden = jnp.full((*tokens.shape, pipeline.stages[0].program.config.hidden_size), value, jnp.bfloat16)
    return pipeline.stages[index].placement.rows(hidden)


def stand_in(pipeline: mpmd.MpmdPipeline, index: int, tokens) -> jax.Array:
    """Stage `index`'s forward input for timing: the tokens [B, T] on stage 0, else ones
    [B, T, d] (bf16) on the stage's device."""
    return tokens if index == 0 else hidden_like(pipeline, index, tokens)


def _update(pipeline: mpmd.MpmdPipeline, stage: mpmd.Stage, slot: int) -> None:
    stage.trainable, stage.grads_acc, stage.opt_states[slot] = apply_adapter_update(
        pipeline.optimizers[slot], stage.trainable, stage.grads_acc, slot, pipeline.ranks[slot], stage.opt_states[slot])


def warm_up(pipeline: mpmd.MpmdPipeline, placed) -> None:
    """Compiles every stage's forward, backward and each slot's update, stages in parallel threads
    (each stage fed a stand-in input; the updates see the warm-up's gradients)."""
    def one(index):
        stage = pipeline.stages[index]
        tokens, batch, plan = placed[index]
        out, saved = stage.program.forward(stage.weights, stage.trainable, stage.frozen,
                                           stand_in(pipeline, index, tokens), batch, plan)
        cotangent = None if stage.program.last else jnp.ones_like(out)
        stage.grads_acc, _ = stage.program.backward(stage.weights, stage.trainable, stage.frozen, saved,
                                                    stage.grads_acc, cotangent, batch, plan)
        jax.block_until_ready(stage.grads_acc)

    with concurrent.futures.ThreadPoolExecutor(pipeline.num_stages) as pool:
        list(pool.map(one, range(pipeline.num_stages)))
    orders = [[mpmd.Op("U", slot) for slot in range(NUM_ADAPTERS)] for _ in pipeline.stages]
    pipeline.run(orders, [])
    pipeline.wait()


def op_times(pipeline: mpmd.MpmdPipeline, placed, repeats: int) -> dict[str, list[float]]:
    """Seconds of one F, B and U op on each stage, each measured alone on its GPU."""
    times = {"F": [], "B": [], "U": []}
    for index, stage in enumerate(pipeline.stages):
        tokens, batch, plan = placed[index]
        x = stand_in(pipeline, index, tokens)
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
            _update(pipeline, stage, 0)
            return stage.trainable

        times["U"].append(median_call_seconds(update, repeats))
    return times


def solo_busy(pipeline: mpmd.MpmdPipeline, orders, placed) -> list[float]:
    """Seconds each stage's device takes for its ops of `orders` back to back with stand-in inputs
    (forward: `stand_in`; backward: its own forward's residuals and a 1e-3 cotangent), no
    neighbours waited for; all stages at once, each from its own thread. The busy time of the
    run's real microbatches (attention cost varies with their samples). Changes the adapters:
    call it after the measured run."""
    def one(index):
        stage, program = pipeline.stages[index], pipeline.stages[index].program
        tokens = next(p for p in placed if p is not None)[index][0]
        x = stand_in(pipeline, index, tokens)
        cotangent = None if program.last else hidden_like(pipeline, index, tokens, 1e-3)
        saved = {}
        jax.block_until_ready((stage.trainable, stage.grads_acc, x, cotangent))
        start = time.perf_counter()
        for op in orders[index]:
            if op.kind == "U":
                _update(pipeline, stage, op.index)
                continue
            tokens, batch, plan = placed[op.index][index]
            if op.kind == "F":
                _, saved[op.index] = program.forward(stage.weights, stage.trainable, stage.frozen,
                                                     tokens if index == 0 else x, batch, plan)
            else:
                stage.grads_acc, _ = program.backward(stage.weights, stage.trainable, stage.frozen,
                                                      saved.pop(op.index), stage.grads_acc, cotangent, batch, plan)
        jax.block_until_ready((stage.trainable, stage.grads_acc))
        return time.perf_counter() - start

    with concurrent.futures.ThreadPoolExecutor(pipeline.num_stages) as pool:
        return list(pool.map(one, range(pipeline.num_stages)))


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


def sample_tokens(model, data) -> dict:
    rng = np.random.default_rng(2)
    return {(a, i): rng.integers(0, model.config.vocab_size, n).astype(np.int32)
            for a in data.adapters for i, n in enumerate(data.lengths[a])}


PLANS: dict[tuple, tuple] = {}
SCHEDULING: dict[tuple, concurrent.futures.Future] = {}
OP_TIMES: dict[tuple, dict] = {}  # (stages, layer ranges) -> measured op times (fixed shapes: one per split)


def schedule_ahead(args, runs: list[dict]) -> concurrent.futures.ProcessPoolExecutor:
    """Starts every run's schedule (the MILP: seconds per global batch) in worker processes, so it
    overlaps the model's set-up and the compiles (LoRAFusion schedules ahead the same way)."""
    import multiprocessing

    pool = concurrent.futures.ProcessPoolExecutor(max(1, min(8, (os.cpu_count() or 2) // 2)),
                                                  mp_context=multiprocessing.get_context("spawn"),
                                                  initializer=cpu_only)
    # Workers start during the submits and take the environment then: JAX on the CPU only (no GPU
    # memory taken). This process read its JAX settings at import, so the change does not reach it.
    before = os.environ.get("JAX_PLATFORMS")
    os.environ["JAX_PLATFORMS"] = "cpu"
    try:
        for run in runs:
            key = (run["stages"], run["workload"], run["variant"], run["batches"])
            if key not in SCHEDULING:
                SCHEDULING[key] = pool.submit(variant_plan, args.capacity, run["batches"],
                                              args.microbatches_per_batch, args.milp_time, *key[:3])
    finally:
        if before is None:
            os.environ.pop("JAX_PLATFORMS")
        else:
            os.environ["JAX_PLATFORMS"] = before
    return pool


def plan_of(args, stages: int, workload: str, variant: str, batches: int) -> tuple:
    """(data, microbatches, segments, orders) of one run (cached: the MILP runs once, in a worker
    process if `schedule_ahead` started it)."""
    key = (stages, workload, variant, batches)
    if key not in PLANS:
        if key in SCHEDULING:
            data, microbatches, segments = SCHEDULING.pop(key).result()
        else:
            data, microbatches, segments = variant_plan(args.capacity, batches, args.microbatches_per_batch,
                                                        args.milp_time, stages, workload, variant)
        orders = op_orders(data, microbatches, segments, stages, {a: a for a in data.adapters})
        PLANS[key] = (data, microbatches, segments, orders)
    return PLANS[key]


def stage_devices(stages: int, simulated: bool) -> list:
    if simulated:
        return [jax.devices()[i % len(jax.devices())] for i in range(stages)]
    if len(jax.devices()) < stages:
        raise SystemExit(f"--stages {stages} needs {stages} devices; this machine has {len(jax.devices())} "
                         "(--simulate-stages replays S stages from measured op times)")
    return jax.devices()[:stages]


def build(args, model, trainable, frozen, devices, ranges, data, microbatches):
    """A pipeline on `ranges`, warmed up, and every microbatch placed on every stage."""
    pipeline = mpmd.MpmdPipeline(model, trainable, frozen, devices, optax.adamw(1e-4), LORA.r, layer_ranges=ranges)
    arrays = microbatch_arrays(data, microbatches, sample_tokens(model, data), args.capacity)
    placed = [None if item is None else pipeline.place(*item) for item in arrays]
    warm_up(pipeline, next(p for p in placed if p is not None))
    jax.block_until_ready(placed)
    return pipeline, placed


def calibrate(args, model, trainable, frozen, stages: int, simulated: bool) -> dict:
    """Op times of each stage on the even split (one microbatch of the first workload), the
    costs derived from them and the split the run uses (`--split`)."""
    even = mpmd.split_layers(args.layers, stages)
    data, microbatches, _, _ = plan_of(args, stages, args.workloads[0], "ours", args.batches)
    first = next(mb for mb in microbatches if mb)
    pipeline, placed = build(args, model, trainable, frozen, stage_devices(stages, simulated), even, data, [first])
    times = op_times(pipeline, placed[0], args.repeats)
    del pipeline
    costs = balance.costs_from_op_times(times, even)
    if args.split == "auto":
        ranges = balance.balanced_split(args.layers, stages, costs)
    else:
        ranges = even if args.split == "even" else balance.parse_split(args.split, args.layers)
    OP_TIMES[(stages, tuple(even))] = times
    return {"stages": stages, "layer_ranges": even, "op_seconds": times, "costs_in_layers": costs.in_layers(),
            "split": ranges, "costs": costs}


def run_variant(args, model, trainable, frozen, devices, ranges, orders, data, microbatches, copies: str):
    """One timed run of `orders` (copies: which stage's thread copies between GPUs); returns
    (pipeline, placed inputs, wall seconds, loss sum, host summary of the driver's timeline)."""
    pipeline, placed = build(args, model, trainable, frozen, devices, ranges, data, microbatches)
    timeline: list = []
    start = time.perf_counter()
    losses = pipeline.run(orders, placed, threaded=args.threaded, timeline=timeline,
                          producer_copies=copies == "producer")
    jax.block_until_ready(losses)
    pipeline.wait()
    wall = time.perf_counter() - start
    return (pipeline, placed, wall, float(sum(np.asarray(v).sum() for v in losses.values())),
            host_summary(timeline, start, len(devices)))


def host_summary(timeline: list, start: float, stages: int) -> dict:
    """Per stage, from `MpmdPipeline.run`'s timeline: seconds its driver spent waiting for inputs
    (taken and copied), mean ms to dispatch an F/B op once its input was there, and when (s after
    the start) its last op had been issued. A driver that keeps up issues its last op well before
    the wall time ends and dispatches in well under an op's time."""
    out = {"input_wait_s": [0.0] * stages, "dispatch_ms": [0.0] * stages, "last_issued_s": [0.0] * stages}
    counts = [0] * stages
    for stage, kind, _, reached, ready, issued in timeline:
        out["input_wait_s"][stage] += ready - reached
        out["last_issued_s"][stage] = max(out["last_issued_s"][stage], issued - start)
        if kind != "U":
            out["dispatch_ms"][stage] += 1e3 * (issued - ready)
            counts[stage] += 1
    out["dispatch_ms"] = [total / max(1, n) for total, n in zip(out["dispatch_ms"], counts)]
    return out


def run_summary(run: dict, microbatches, segments, data, capacity: int, ranges) -> dict:
    real = sum(s.num_tokens for mb in microbatches for s in mb)
    used = sum(1 for mb in microbatches if mb)
    return {"stages": run["stages"], "workload": run["workload"], "variant": run["variant"], "batches": run["batches"],
            "copies": run["copies"],
            "layer_ranges": [list(r) for r in ranges], "tokens": real, "microbatches": used,
            "noops": len(microbatches) - used, "passes": len(segments),
            "global_batch_size": data.global_batch_size[0], "padding_waste": 1 - real / (used * capacity)}


def measure(args, model, trainable, frozen, run: dict, calibration: dict) -> dict:
    """One measured run on real devices: wall, tokens/s, bubble from solo busy times, replay."""
    stages, ranges = run["stages"], calibration["split"]
    data, microbatches, segments, orders = plan_of(args, stages, run["workload"], run["variant"], run["batches"])
    pipeline, placed, wall, loss, host = run_variant(args, model, trainable, frozen, stage_devices(stages, False),
                                                     ranges, orders, data, microbatches, run["copies"])
    key = (stages, tuple(ranges))
    if key not in OP_TIMES:  # fixed shapes: one measurement per pipeline split
        OP_TIMES[key] = op_times(pipeline, next(p for p in placed if p is not None), args.repeats)
    times = OP_TIMES[key]
    counts = [{kind: sum(op.kind == kind for op in ops) for kind in "FBU"} for ops in orders]
    busy_model = [sum(counts[s][k] * times[k][s] for k in "FBU") for s in range(stages)]
    busy = solo_busy(pipeline, orders, placed)
    del pipeline
    predicted = replay(orders, times)
    out = run_summary(run, microbatches, segments, data, args.capacity, ranges)
    return {**out, "wall_s": wall, "tokens_per_s": out["tokens"] / wall,
            "bubble_ratio": 1.0 - sum(busy) / (stages * wall),
            "idle_s_per_stage": [wall - b for b in busy], "busy_s_per_stage": busy,
            "busy_model_s_per_stage": busy_model, "bubble_ratio_model": 1.0 - sum(busy_model) / (stages * wall),
            "predicted_wall_s": predicted["wall_s"],
            "predicted_bubble_ratio": 1.0 - sum(busy_model) / (stages * predicted["wall_s"]),
            "op_seconds": times, "loss_sum": loss, "host": host}


def simulate_stages(args, model, trainable, frozen, run: dict, calibration: dict) -> dict:
    """The bubble ratio and tokens/s of `stages` stages from measured op times, where the machine
    has fewer GPUs than stages: the even split's op times measured on devices i mod (devices)
    (`calibrate`), the run's split's op times from the costs derived from them, and the op orders
    replayed with those times (`mpmd.simulate`, transfers free). No pipeline runs here."""
    stages, ranges = run["stages"], calibration["split"]
    data, microbatches, segments, orders = plan_of(args, stages, run["workload"], run["variant"], run["batches"])
    times = calibration["costs"].op_seconds(ranges)
    result = replay(orders, times)
    out = run_summary(run, microbatches, segments, data, args.capacity, ranges)
    return {**out, "simulated": True, "devices_used": len(set(stage_devices(stages, True))),
            "wall_s": result["wall_s"], "tokens_per_s": out["tokens"] / result["wall_s"],
            "bubble_ratio": result["bubble_ratio"], "busy_s_per_stage": result["busy_s_per_stage"],
            "idle_s_per_stage": [result["wall_s"] - b for b in result["busy_s_per_stage"]], "op_seconds": times}


def planned_runs(args, stages: int, simulated: bool) -> list[dict]:
    """The runs of one pipeline size: each workload's variants at --batches, then our schedule at
    each of --sweep-batches, then (--compare-copies) ours on the first workload with the other
    hand-over between GPUs (what comes last is skipped first when time runs short)."""
    def run(workload, variant, batches, copies=args.copies):
        return {"stages": stages, "workload": workload, "variant": variant, "batches": batches,
                "simulated": simulated, "copies": copies}

    runs = [run(w, v, args.batches) for w in args.workloads for v in args.variants]
    runs += [run(w, "ours", b) for b in args.sweep_batches for w in args.workloads if b != args.batches]
    if args.compare_copies and not simulated and stages > 1:
        runs.append(run(args.workloads[0], "ours", args.batches, {"consumer": "producer"}.get(args.copies, "consumer")))
    return runs


def print_plan(args, runs: list[dict], calibration: dict) -> None:
    """Each planned run with its replayed wall time and bubble on the chosen split."""
    times = calibration["costs"].op_seconds(calibration["split"])
    print(f"S={calibration['stages']}: split {[b - a for a, b in calibration['split']]} (even "
          f"{[b - a for a, b in calibration['layer_ranges']]}); head = {calibration['costs_in_layers']['last']:.2f} "
          "layers; planned runs (replayed, transfers free):", flush=True)
    for run in runs:
        _, microbatches, _, orders = plan_of(args, run["stages"], run["workload"], run["variant"], run["batches"])
        run["predicted"] = replay(orders, times)
        print(f"  {run['workload']:8} {run['variant']:12} {run['batches']:2} global batches: "
              f"{sum(1 for mb in microbatches if mb):4} microbatches, wall {run['predicted']['wall_s']:6.2f} s, "
              f"bubble {run['predicted']['bubble_ratio']:.3f}{note(run)}", flush=True)


def note(run: dict) -> str:
    return "" if run["copies"] == "consumer" else f"  ({run['copies']} copies)"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="*", default=[4], help="pipeline sizes to run (1 = one GPU)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; --tiny: 8)")
    parser.add_argument("--capacity", type=int, default=None, help="tokens per microbatch (default 4096; --tiny: "
                        "256; longer samples are clipped to it)")
    parser.add_argument("--batches", type=int, default=4, help="global batches per adapter (both variants)")
    parser.add_argument("--sweep-batches", type=int, nargs="*", default=[],
                        help="more runs of our schedule with these numbers of global batches per adapter")
    parser.add_argument("--microbatches-per-batch", type=float, default=4.0)
    parser.add_argument("--workloads", nargs="+", default=["xsum", "mixed"])
    parser.add_argument("--variants", nargs="+", default=["ours", "1f1b-single"], choices=["ours", "1f1b-single"])
    parser.add_argument("--split", default="auto", help="layers per stage: auto (balanced by the calibration's "
                        "op times), even, or e.g. 9,8,8,7")
    parser.add_argument("--milp-time", type=float, default=1.0, help="MILP time limit per stage (s)")
    parser.add_argument("--repeats", type=int, default=5, help="back-to-back calls per op timing round")
    parser.add_argument("--driver", choices=["auto", "single", "threaded"], default="auto",
                        help="who issues the ops (auto: threaded if a cross-device copy blocks its caller)")
    parser.add_argument("--copies", choices=["consumer", "producer"], default="consumer",
                        help="which stage's thread copies an activation / gradient between GPUs (producer: the "
                             "driver before 2026-11-27, to measure the difference)")
    parser.add_argument("--compare-copies", action="store_true",
                        help="one more run of ours with the other --copies, last")
    parser.add_argument("--simulate-stages", type=int, nargs="*", default=[],
                        help="pipeline sizes to replay from measured op times (more stages than GPUs allowed), "
                             "after the measured --stages runs")
    parser.add_argument("--time-budget", type=float, default=0.0,
                        help="seconds from the start; a run whose estimate would pass it is skipped (0: no limit)")
    parser.add_argument("--tiny", action="store_true", help="tiny model, capacity 256 (CPU smoke test)")
    parser.add_argument("--out", default="bench/results/pipeline.json")
    args = parser.parse_args()
    args.layers = args.layers or (8 if args.tiny else 32)
    args.capacity = args.capacity or (256 if args.tiny else 4096)
    return args


def adapters(config) -> tuple[dict, dict]:
    """(trainable, frozen) of 4 random adapters (r=16) in a bf16 pool."""
    pool = AdapterPool(config, num_slots=NUM_ADAPTERS, max_rank=LORA.r, dtype=jnp.bfloat16)
    for index in range(NUM_ADAPTERS):
        pool.load(random_adapter(f"adapter{index}", config, LORA, seed=index))
    return split_pool(pool.arrays)


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    sizes = [(s, False) for s in args.stages] + [(s, True) for s in args.simulate_stages]
    calibration_runs = [{"stages": s, "workload": args.workloads[0], "variant": "ours", "batches": args.batches}
                        for s, _ in sizes]
    scheduler = schedule_ahead(args, calibration_runs + [r for s, sim in sizes for r in planned_runs(args, s, sim)])
    config = llama8b_config(args.layers, args.tiny)
    model = Llama(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    trainable, frozen = adapters(config)
    device = jax.devices()[0].device_kind
    held = copy_blocks(jax.devices()[:2])
    args.threaded = args.driver == "threaded" or (args.driver == "auto" and held > 0.01)
    print(f"device_put held its caller {held * 1e3:.1f} ms -> {'threaded' if args.threaded else 'single-thread'} "
          "driver", flush=True)
    results, skipped, calibrations = [], [], []
    for stages, simulated in sizes:
        begin = time.perf_counter()
        calibration = calibrate(args, model, trainable, frozen, stages, simulated)
        # What a run costs besides its two passes (build, compile, placing): first the calibration's
        # time (a build and a compile), then what the last run took.
        overhead = time.perf_counter() - begin
        calibrations.append(calibration)
        runs = planned_runs(args, stages, simulated)
        print_plan(args, runs, calibration)
        print(f"{'S':>2} {'workload':8} {'variant':12} {'gb':>2} {'tokens/s':>9} {'wall s':>7} {'bubble':>7} "
              f"{'pred.':>6} {'mb':>4} {'noop':>4}", flush=True)
        for run in runs:
            predicted = run.pop("predicted")
            estimate = 0.0 if simulated else overhead + 2.2 * predicted["wall_s"]
            if args.time_budget and time.perf_counter() - started + estimate > args.time_budget:
                skipped.append({**run, "estimate_s": estimate})
                print(f"{stages:2} {run['workload']:8} {run['variant']:12} {run['batches']:2} skipped: needs "
                      f"~{estimate:.0f} s, past --time-budget {args.time_budget:.0f} s{note(run)}", flush=True)
                continue
            begin = time.perf_counter()
            r = (simulate_stages if simulated else measure)(args, model, trainable, frozen, run, calibration)
            if not simulated:
                overhead = max(1.0, time.perf_counter() - begin - 2 * r["wall_s"])
            results.append(r)
            predicted = f"{r['predicted_bubble_ratio']:6.3f}" if "predicted_bubble_ratio" in r else f"{'sim.':>6}"
            print(f"{stages:2} {r['workload']:8} {r['variant']:12} {r['batches']:2} {r['tokens_per_s']:9.0f} "
                  f"{r['wall_s']:7.2f} {r['bubble_ratio']:7.3f} {predicted} {r['microbatches']:4} {r['noops']:4}"
                  f"{note(r)}", flush=True)
            write_report(args, device, results, calibrations, skipped, time.perf_counter() - started)
    write_report(args, device, results, calibrations, skipped, time.perf_counter() - started)
    scheduler.shutdown(cancel_futures=True)
    print(f"device: {device} x {len(jax.devices())}, jax {jax.__version__}, {args.layers} layers, "
          f"capacity {args.capacity}, {time.perf_counter() - started:.0f} s; wrote {args.out}")


def write_report(args, device: str, results: list, calibrations: list, skipped: list, elapsed: float) -> None:
    public = [{k: v for k, v in c.items() if k != "costs"} for c in calibrations]
    report = {"device": device, "devices": len(jax.devices()), "jax": jax.__version__,
              "date": datetime.date.today().isoformat(), "host": platform.node(), "layers": args.layers,
              "driver": "threaded" if args.threaded else "single-thread", "copies": args.copies, "split": args.split,
              "capacity": args.capacity, "batches": args.batches, "adapters": NUM_ADAPTERS, "rank": LORA.r,
              "microbatches_per_batch": args.microbatches_per_batch, "time_budget_s": args.time_budget,
              "elapsed_s": elapsed, "calibration": public[-1] if public else None, "calibrations": public,
              "skipped": skipped, "results": results}
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
    labels = [f"S={r['stages']}{' (sim.)' if r.get('simulated') else ''} {r['workload']}\n{r['variant']} "
              f"{r.get('batches', '')} gb" for r in results]
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
