"""Benchmark of the training scheduler (CPU only): microbatch counts and padding waste.

For each synthetic workload (docs/architecture.md, "Benchmark workloads") with 4 adapters and
each token capacity it compares plain greedy packing (one adapter at a time, samples in data
order, first-fit; microbatches never mix adapters) with our scheduler (head-tail groups, first-fit decreasing
or the two-stage HiGHS MILP, cross-block merging), at S=1 and S=4 pipeline stages (no-ops
included at S=4). Padding waste = 1 - real tokens / (microbatches * capacity).

Run: python bench/scheduler.py  (writes bench/results/scheduler.json)
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
from importlib.metadata import version
from pathlib import Path

from jaxlora.scheduler.training.samples import TrainingData, real_tokens
from jaxlora.scheduler.training.greedy import per_adapter_first_fit
from jaxlora.scheduler.training.schedule import (
    Finalizer, SchedulerConfig, adapter_groups, concat, pack_window, window_samples,
)

WORKLOADS = ("xsum", "cnndm", "wikisum", "mixed", "het")
RESULTS = Path(__file__).parent / "results" / "scheduler.json"


def waste(num_microbatches: int, tokens: int, capacity: int) -> float:
    return 1.0 - tokens / (num_microbatches * capacity)


def baseline(data: TrainingData, capacity: int, multiple: int) -> int:
    """Microbatches of per-adapter sequential first-fit, batch by batch."""
    return sum(
        len(per_adapter_first_fit(data.global_batch(a, j), capacity, multiple))
        for j in range(data.num_global_batches)
        for a in data.adapters
    )


def finalize(data: TrainingData, config: SchedulerConfig, packed, stages: int):
    finalizer = Finalizer(data.global_batch_size, dataclasses.replace(config, num_stages=stages))
    return concat([finalizer.push(packed), finalizer.flush()])


def run_case(data: TrainingData, capacity: int, args) -> dict:
    groups = adapter_groups(data, 2)
    batches = window_samples(data, range(data.num_global_batches))
    tokens = sum(real_tokens(b) for b in batches)
    row = {"capacity": capacity, "real_tokens": tokens}
    row["baseline_mbs"] = baseline(data, capacity, args.padding)
    row["baseline_waste"] = waste(row["baseline_mbs"], tokens, capacity)
    for name, use_milp in (("ffd", False), ("ours", True)):
        config = SchedulerConfig(capacity, 1, args.padding, args.time_limit, use_milp=use_milp)
        began = time.perf_counter()
        packed = pack_window(batches, groups, config)
        row[f"{name}_pack_s"] = time.perf_counter() - began
        row[f"{name}_milp_blocks"] = sum(p.source == "milp" for p in packed)
        for stages in (1, 4):
            schedule = finalize(data, config, packed, stages)
            row[f"{name}_s{stages}_mbs"] = len(schedule.microbatches)
            row[f"{name}_s{stages}_noops"] = schedule.num_noops
            row[f"{name}_s{stages}_waste"] = schedule.padding_waste(capacity)
    row["blocks"] = len(packed)
    return row


HEADER = (
    f"{'workload':9} {'cap':>5} | {'greedy':>6} {'waste':>6} | {'ffd S1':>6} {'waste':>6} | "
    f"{'ours S1':>7} {'waste':>6} | {'ours S4':>7} {'noops':>5} {'waste':>6} | "
    f"{'milp':>5} {'pack s':>6}"
)


def format_row(r: dict) -> str:
    return (
        f"{r['workload']:9} {r['capacity']:>5} | "
        f"{r['baseline_mbs']:>6} {r['baseline_waste']:>6.1%} | "
        f"{r['ffd_s1_mbs']:>6} {r['ffd_s1_waste']:>6.1%} | {r['ours_s1_mbs']:>7} "
        f"{r['ours_s1_waste']:>6.1%} | {r['ours_s4_mbs']:>7} {r['ours_s4_noops']:>5} "
        f"{r['ours_s4_waste']:>6.1%} | "
        f"{r['ours_milp_blocks']:>2}/{r['blocks']:<2} {r['ours_pack_s']:>6.1f}"
    )


def machine() -> dict:
    return {
        "processor": platform.processor() or platform.machine(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "highspy": version("highspy"),
        "cpu_count": os.cpu_count(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=128, help="samples per adapter")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--padding", type=int, default=64)
    parser.add_argument("--time-limit", type=float, default=0.5, help="seconds per MILP stage")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from jaxlora.scheduler.training.workloads import synthetic_data

    rows = []
    print(HEADER)
    for workload in WORKLOADS:
        data = synthetic_data(workload, 4, args.samples, args.global_batch, args.seed)
        for capacity in (4096, 8192):
            row = {"workload": workload, **run_case(data, capacity, args)}
            rows.append(row)
            print(format_row(row), flush=True)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "num_adapters": 4,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
