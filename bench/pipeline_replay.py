"""The op orders of bench/pipeline.py's workloads and their replay from stage op times: the
predicted bubble ratio and wall time of our schedule and of 1F1B with one adapter, by layer split,
number of global batches per adapter, transfer latency and driver, on any machine (no model, no
GPU). bench/pipeline.py uses the same orders and replay for its measured runs and its plan.

    PYTHONPATH=. python bench/pipeline_replay.py --from bench/results/pipeline_sim4_h200.json \\
        --batches 1 2 4 8 16 --workloads xsum mixed --out bench/results/pipeline_replay_4.json
    PYTHONPATH=. python bench/pipeline_replay.py --costs 2.44 7.76 4.03 15.72 --hold 0 7 \
        --out bench/results/pipeline_replay_4xh200_fit.json   # the costs fitted to the 4 x H200 run

--from takes the stage op times of a pipeline.py result (its "calibration" if it has one, else
the first result's "op_seconds" on an even split); --costs gives them as milliseconds per op of
one full microbatch: a layer's forward and backward, the head's forward and backward (the last
stage's extra). Each row replays: split "even" (layers as `mpmd.split_layers`) and "balanced"
(`balance.balanced_split` of those costs), per-transfer latency --transfer (ms), and --hold (ms
a stage's driver waits after each op that sends: the driver before 2026-11-27).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import numpy as np

from jaxlora.parallel import mpmd
from jaxlora.parallel.balance import StageCosts, balanced_split, costs_from_op_times
from jaxlora.scheduler.training.greedy import first_fit_decreasing
from jaxlora.scheduler.training.samples import Sample, TrainingData
from jaxlora.scheduler.training.schedule import SchedulerConfig, build_schedule
from jaxlora.scheduler.training.workloads import DATASETS, synthetic_data

NUM_ADAPTERS = 4
VARIANTS = ("ours", "1f1b-single")


def cpu_only() -> None:
    """A scheduling worker process's JAX on the CPU (it must not take GPU memory)."""
    import jax

    jax.config.update("jax_platforms", "cpu")


def mean_length(workload: str) -> float:
    """Expected sample length of a workload's lognormal lengths."""
    means = [m * np.exp(s * s / 2) for m, s in DATASETS.values()] if workload == "mixed" else \
        [DATASETS[workload][0] * np.exp(DATASETS[workload][1] ** 2 / 2)]
    return float(np.mean(means))


def workload_data(workload: str, capacity: int, batches: int, per_batch: float, seed: int = 1) -> TrainingData:
    """The workload's 4 adapters, `batches` global batches each of about `per_batch` microbatches'
    worth of tokens, lengths clipped to the capacity (a no-op at 4096)."""
    size = max(1, round(per_batch * capacity / min(mean_length(workload), capacity / 2)))
    data = synthetic_data(workload, NUM_ADAPTERS, batches * size, size, seed=seed)
    return TrainingData.from_lengths({a: [min(n, capacity) for n in data.lengths[a]] for a in data.adapters}, size)


def single_adapter_plan(data: TrainingData, capacity: int) -> tuple[list, list[list[int]]]:
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


def variant_plan(capacity: int, batches: int, per_batch: float, milp_time: float, stages: int, workload: str,
                 variant: str) -> tuple[TrainingData, list, list[list[int]]]:
    """(data, microbatches, segments) of a variant: our schedule for `stages` stages (one
    continuous segment), or one adapter's global batch at a time (one segment per batch)."""
    data = workload_data(workload, capacity, batches, per_batch)
    if variant == "ours":
        schedule = build_schedule(data, SchedulerConfig(capacity=capacity, num_stages=stages, padding_multiple=1,
                                                        time_limit_s=milp_time))
        return data, list(schedule.microbatches), [list(range(len(schedule.microbatches)))]
    return (data, *single_adapter_plan(data, capacity))


def op_orders(data: TrainingData, microbatches, segments, num_stages: int, slot_of) -> list:
    """Each stage's 1F1B op order (optimizer steps after each global batch; lemma checked)."""
    completions = mpmd.completions_of(microbatches, data.global_batch_size, slot_of)
    empty = frozenset(i for i, mb in enumerate(microbatches) if not mb)
    orders = mpmd.stage_orders(segments, num_stages, completions, empty)
    mpmd.check_update_order(orders, microbatches, data.global_batch_size, slot_of)
    return orders


def replay(orders, op_seconds, transfer: float = 0.0, hold: float = 0.0) -> dict:
    """{"wall_s", "bubble_ratio", "busy_s_per_stage"} of the orders replayed with op_seconds
    ({kind: [seconds per stage]}), transfer / hold in seconds (see `mpmd.simulate`)."""
    wall, busy = mpmd.simulate(orders, op_seconds, transfer=transfer, hold=hold)
    return {"wall_s": wall, "bubble_ratio": 1.0 - sum(busy) / (len(orders) * wall) if wall else 0.0,
            "busy_s_per_stage": busy}


def costs_from_report(path: str) -> tuple[StageCosts, int, int]:
    """(costs, layers, stages) from a bench/pipeline.py JSON: its calibration's op times and
    layer ranges if present, else the first result's op times on an even split."""
    with open(path) as f:
        report = json.load(f)
    calibration = report.get("calibration")
    if calibration:
        ranges = calibration["layer_ranges"]
        return costs_from_op_times(calibration["op_seconds"], ranges), report["layers"], len(ranges)
    op_seconds = report["results"][0]["op_seconds"]
    ranges = report["results"][0].get("layer_ranges") or mpmd.split_layers(report["layers"], len(op_seconds["F"]))
    return costs_from_op_times(op_seconds, ranges), report["layers"], len(ranges)


def costs_from_ms(layer_f: float, layer_b: float, head_f: float, head_b: float, update: float = 0.5) -> StageCosts:
    """StageCosts from milliseconds per full microbatch (update: one adapter's optimizer step on
    a whole stage, spread over its layers as 1/8 each)."""
    return StageCosts({"F": layer_f / 1e3, "B": layer_b / 1e3, "U": update / 8e3}, {"F": 0.0, "B": 0.0, "U": 0.0},
                      {"F": head_f / 1e3, "B": head_b / 1e3, "U": 0.0})


def splits(costs: StageCosts, layers: int, stages: int) -> dict[str, list[tuple[int, int]]]:
    return {"even": mpmd.split_layers(layers, stages), "balanced": balanced_split(layers, stages, costs)}


def replay_table(costs: StageCosts, layers: int, stages: int, workloads, batches_list, capacity: int,
                 per_batch: float, milp_time: float, transfers, holds) -> list[dict]:
    """One row per (workload, batches, split, variant, transfer, hold) with its replay."""
    rows = []
    for workload in workloads:
        for batches in batches_list:
            for variant in VARIANTS:
                data, microbatches, segments = variant_plan(capacity, batches, per_batch, milp_time, stages,
                                                            workload, variant)
                orders = op_orders(data, microbatches, segments, stages, {a: a for a in data.adapters})
                real = sum(s.num_tokens for mb in microbatches for s in mb)
                for split, ranges in splits(costs, layers, stages).items():
                    for transfer in transfers:
                        for hold in holds:
                            r = replay(orders, costs.op_seconds(ranges), transfer / 1e3, hold / 1e3)
                            rows.append({"workload": workload, "batches": batches, "variant": variant, "split": split,
                                         "layer_ranges": ranges, "transfer_ms": transfer, "hold_ms": hold,
                                         "microbatches": sum(1 for mb in microbatches if mb),
                                         "noops": sum(1 for mb in microbatches if not mb), "tokens": real,
                                         "tokens_per_s": real / r["wall_s"], **r})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from", dest="report", help="a bench/pipeline.py JSON with measured op times")
    source.add_argument("--costs", type=float, nargs=4, metavar=("LAYER_F", "LAYER_B", "HEAD_F", "HEAD_B"),
                        help="ms per op of one full microbatch")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--stages", type=int, default=4, help="stages to replay (any number; the costs are "
                        "per layer)")
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--microbatches-per-batch", type=float, default=4.0)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--workloads", nargs="+", default=["xsum", "mixed"])
    parser.add_argument("--transfer", type=float, nargs="+", default=[0.0, 3.0], help="ms per transfer")
    parser.add_argument("--hold", type=float, nargs="+", default=[0.0], help="ms a driver waits after a send")
    parser.add_argument("--milp-time", type=float, default=0.5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.report:
        costs, args.layers, _ = costs_from_report(args.report)
    else:
        costs = costs_from_ms(*args.costs)
    print(f"costs per layer F/B {costs.per_layer['F'] * 1e3:.2f}/{costs.per_layer['B'] * 1e3:.2f} ms, "
          f"head {costs.in_layers()['last']:.2f} layers, embedding {costs.in_layers()['first']:.2f} layers; "
          f"splits {splits(costs, args.layers, args.stages)}", flush=True)
    rows = replay_table(costs, args.layers, args.stages, args.workloads, args.batches, args.capacity,
                        args.microbatches_per_batch, args.milp_time, args.transfer, args.hold)
    print(f"{'workload':8} {'gb':>3} {'variant':12} {'split':9} {'xfer':>5} {'hold':>5} {'mb':>4} {'noop':>4} "
          f"{'wall s':>7} {'bubble':>7}")
    for r in rows:
        print(f"{r['workload']:8} {r['batches']:3} {r['variant']:12} {r['split']:9} {r['transfer_ms']:5.1f} "
              f"{r['hold_ms']:5.1f} {r['microbatches']:4} {r['noops']:4} {r['wall_s']:7.2f} {r['bubble_ratio']:7.3f}")
    if args.out:
        with open(args.out, "w") as f:
            device = (json.load(open(args.report)).get("device", "?") if args.report else "the command line (--costs)")
            json.dump({"device": f"CPU replay (no device ran it) of costs from {device}",
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "source": args.report or {"costs_ms": args.costs}, "layers": args.layers, "stages": args.stages,
                       "capacity": args.capacity, "per_layer_s": dict(costs.per_layer), "first_s": dict(costs.first),
                       "last_s": dict(costs.last), "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
