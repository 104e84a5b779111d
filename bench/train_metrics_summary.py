"""Summarises `jaxlora-train` runs from their own metrics (output_dir/metrics.jsonl): tokens/s over
the run after its first (compiling) microbatches, mean MFU, peak memory; one JSON for several runs.

    python3 bench/train_metrics_summary.py --runs remat_none=OUT/remat_none remat_layer=OUT/remat_layer \
        --out bench/results/train_8b_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os


def summarize(metrics_path: str, skip: int) -> dict:
    """{microbatches, tokens_per_s (sum tokens / sum step time past the first `skip`), mfu_mean,
    peak_memory_gb, first_step_s} of one run's metrics.jsonl."""
    with open(metrics_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    steady = records[skip:]
    seconds = sum(r["step_time_s"] for r in steady)
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    peaks = [r["peak_memory_gb"] for r in records if r.get("peak_memory_gb") is not None]
    return {"microbatches": len(records), "skipped": skip, "first_step_s": records[0]["step_time_s"],
            "tokens_per_s": sum(r["tokens"] for r in steady) / seconds if seconds else None,
            "mfu_mean": sum(mfus) / len(mfus) if mfus else None, "peak_memory_gb": max(peaks) if peaks else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", required=True, help="NAME=OUTPUT_DIR of each jaxlora-train run")
    parser.add_argument("--skip", type=int, default=2, help="first microbatches left out (compilation)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import jax

    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"), "runs": {}}
    for spec in args.runs:
        name, directory = spec.split("=", 1)
        report["runs"][name] = summarize(os.path.join(directory, "metrics.jsonl"), args.skip)
        print(name, json.dumps(report["runs"][name]))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
