"""The GPU regression guard: reruns the README's headline serving trace and the many-adapter disk
case, and compares each figure with the reference recorded for this device kind.

    PYTHONPATH=. python bench/regress.py [--out-dir DIR] [--only serve slora_disk] [--time-budget S]
    PYTHONPATH=. python bench/regress.py --update          # measured figures become the reference
    PYTHONPATH=. python bench/regress.py --tiny [--update]  # CPU smoke test (~15 s; 30 s compiling)

Runs, as subprocesses sharing one `--compile-cache`:
  serve       bench/serve.py --lora-backend hybrid --max-num-seqs 256 --token-budget 2048
              --prefill-chunk 2048 --requests 64 --suite punica (base + Punica distinct, uniform,
              skewed, identical) -> <out-dir>/regress_serve.json
  slora_disk  bench/slora_disk.py on 2000 adapter folders (written first with --write-only when
              missing; the writer is resumable), cases slora:n=2000,alpha=1 and alpha=0.3,
              throughput mode, 400 requests, runs disk and one -> <out-dir>/regress_slora_disk.json
`--serve-args="..."` / `--slora-args="..."` append arguments to either command (later ones win;
write them with "=": argparse takes a value starting with "--" for an option). --tiny runs both
scripts' --tiny with 32 / 64 requests, on 40 adapters, its files under /tmp/jaxlora_regress_tiny.

Figures (`serve_figures`, `slora_disk_figures`): tokens/s and ratios are higher-is-better and
gate the exit code: a figure below reference * (1 - tolerance) is a DROP, one the run did not
produce is MISSING (a case skipped by --time-budget). TTFT p50 and mean step ms (decode, mixed;
`step_ms`) are lower-is-better and only reported. The reference (`--reference`, JSON) is keyed by
device kind (`jax.devices()[0].device_kind` as the scripts report it; "<kind>-tiny" with --tiny)
and holds per figure its value, direction, date and source; an entry's own "tolerance" applies
unless --tolerance is given (the cpu-tiny entry's is wide: a 2-layer model on a shared CPU is a
smoke test of this script, not of speed). Writes <out-dir>/regress_<device>.json (figures,
reference, verdicts, both scripts' JSON paths, commit) and regress_log.txt (every command's
output): with serve.py's PNG, 5 files in <out-dir> (a device call returns at most 8).

Exit codes: 0 every gating figure passes; 1 a DROP or MISSING; 2 no reference for this device
(the measured figures are still printed; --update creates it); 3 a subprocess failed.
This process never imports jax: on a GPU it would take the memory the subprocesses need.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("serve", "slora_disk")
SERVE_HEADLINE = ["--lora-backend", "hybrid", "--max-num-seqs", "256", "--token-budget", "2048",
                  "--prefill-chunk", "2048", "--requests", "64", "--suite", "punica"]
SERVE_TINY = ["--tiny", "--lora-backend", "hybrid", "--suite", "punica", "--requests", "32"]
SLORA_ALPHAS = ("1", "0.3")
SLORA_ADAPTERS, SLORA_TINY_ADAPTERS = 2000, 40  # the tiny count is bench/slora_disk.py's --tiny default
SLORA_RUN = ["--mode", "throughput", "--runs", "disk", "one"]
DEFAULT_TOLERANCE, TINY_TOLERANCE = 0.05, 0.5
EXIT_PASS, EXIT_DROP, EXIT_NO_REFERENCE, EXIT_FAILED = 0, 1, 2, 3
HIGHER, LOWER = "higher", "lower"


# ---- figures --------------------------------------------------------------------------------------

def add(figures: dict, name: str, value, better: str) -> None:
    """Records figure `name` (skipped when the value is absent or not finite, e.g. no TTFT)."""
    if value is not None and math.isfinite(float(value)):
        figures[name] = {"value": float(value), "better": better}


def step_ms(steps_by_kind: dict, suffix: str) -> float | None:
    """Mean ms of a run's steps whose kind ends in `suffix` ("decode" or "mixed"), weighted by step
    count over the kinds (`serve.engine.EngineStats.steps_by_kind`: base/window/lora decode/mixed)."""
    kinds = [k for name, k in (steps_by_kind or {}).items() if name.endswith(suffix) and k["steps"]]
    steps = sum(k["steps"] for k in kinds)
    return sum(k["steps"] * k["mean_ms"] for k in kinds) / steps if steps else None


def case_label(spec: dict) -> str:
    """A case's name without its request count: "punica distinct", "slora n=2000 a=0.3"."""
    if spec["kind"] == "punica":
        return f"punica {spec['popularity']}"
    return f"slora n={spec['n']} a={spec['alpha']:g}"


def run_figures(figures: dict, prefix: str, run: dict) -> None:
    """TTFT p50 and mean decode / mixed step ms of one run summary (bench/serve.py `summarize`
    plus `run_trace`'s fields) under `prefix`."""
    add(figures, f"{prefix} TTFT p50 ms", run.get("ttft_p50_ms"), LOWER)
    for kind in ("decode", "mixed"):
        add(figures, f"{prefix} {kind} step ms", step_ms(run.get("steps_by_kind"), kind), LOWER)


def serve_figures(report: dict) -> dict:
    """bench/serve.py's report -> figures: the base run's tok/s (the Punica cases share one base
    run: the first case's), then per case LoRA tok/s and LoRA/base; TTFT and step ms of each."""
    figures: dict = {}
    results = [r for r in report.get("results", []) if "lora" in r]
    if results:
        base = results[0]["base"]
        add(figures, "serve base tok/s", base["tokens_per_s"], HIGHER)
        run_figures(figures, "serve base", base)
    for result in results:
        prefix = f"serve {case_label(result['spec'])}"
        add(figures, f"{prefix} lora tok/s", result["lora"]["tokens_per_s"], HIGHER)
        add(figures, f"{prefix} lora/base", result["throughput_vs_base"], HIGHER)
        run_figures(figures, f"{prefix} lora", result["lora"])
        floor = result.get("decode_floor")  # the distinct case: issue 34 item 3's ratio (printed, not gated)
        if floor:
            add(figures, f"{prefix} decode extra/floor", floor["extra_over_floor"], LOWER)
    return figures


def slora_disk_figures(report: dict) -> dict:
    """bench/slora_disk.py's report -> figures: per case each run's tok/s ("disk", "separate",
    "one", as present), "<run>/one" (`<run>_vs_one`), TTFT p50 of each run."""
    figures: dict = {}
    for result in report.get("results", []):
        prefix = f"slora_disk {case_label(result['spec'])}"
        for run in ("disk", "separate", "one"):
            if run in result:
                add(figures, f"{prefix} {run} tok/s", result[run]["tokens_per_s"], HIGHER)
                add(figures, f"{prefix} {run} TTFT p50 ms", result[run].get("ttft_p50_ms"), LOWER)
            if f"{run}_vs_one" in result:
                add(figures, f"{prefix} {run}/one", result[f"{run}_vs_one"], HIGHER)
    return figures


EXTRACT = {"serve": serve_figures, "slora_disk": slora_disk_figures}


# ---- comparison -----------------------------------------------------------------------------------

def verdict(reference: dict | None, measured: dict | None, tolerance: float) -> dict:
    """One figure's row: change (measured / reference - 1), whether it gates (higher-is-better),
    and PASS / DROP (beyond `tolerance` the wrong way) / MISSING (not measured) / NEW (no reference)."""
    known = reference or measured
    row = {"reference": reference and reference["value"], "measured": measured and measured["value"],
           "better": known["better"], "gates": known["better"] == HIGHER, "change": None}
    if reference is None:
        return {**row, "verdict": "NEW"}
    if measured is None:
        return {**row, "verdict": "MISSING"}
    ref, value = reference["value"], measured["value"]
    row["change"] = value / ref - 1 if ref else None
    worse = value < ref * (1 - tolerance) if row["better"] == HIGHER else value > ref * (1 + tolerance)
    return {**row, "verdict": "DROP" if worse else "PASS"}


def compare(figures: dict, reference: dict, tolerance: float) -> dict:
    """{figure: verdict row} over the reference's figures and the measured ones (reference order)."""
    names = list(reference) + [name for name in figures if name not in reference]
    return {name: verdict(reference.get(name), figures.get(name), tolerance) for name in names}


def failing(rows: dict) -> list[str]:
    """The gating figures that fail: a DROP or MISSING of a higher-is-better figure."""
    return [name for name, row in rows.items() if row["gates"] and row["verdict"] in ("DROP", "MISSING")]


def exit_code(rows: dict, failed_parts: list, has_reference: bool) -> int:
    """3 a subprocess failed, 2 no reference for this device, 1 a gating figure failed, else 0."""
    if failed_parts:
        return EXIT_FAILED
    if not has_reference:
        return EXIT_NO_REFERENCE
    return EXIT_DROP if failing(rows) else EXIT_PASS


def number(value) -> str:
    """A figure for the table: ratios with 3 decimals, ms and tok/s with thousands separators."""
    if value is None:
        return "-"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:,.1f}" if abs(value) < 1000 else f"{value:,.0f}"


def print_table(rows: dict) -> None:
    """figure, reference, measured, change %, verdict (lower-is-better ones marked as not gating)."""
    print(f"{'figure':50} {'reference':>10} {'measured':>10} {'change':>8}  verdict")
    for name, row in rows.items():
        change = "-" if row["change"] is None else f"{100 * row['change']:+.1f}%"
        mark = "" if row["gates"] else " (not gated)"
        print(f"{name:50} {number(row['reference']):>10} {number(row['measured']):>10} {change:>8}  "
              f"{row['verdict']}{mark}")


# ---- reference file -------------------------------------------------------------------------------

def load_reference(path: str) -> dict:
    """The reference JSON ({"devices": {key: entry}}); an empty one if the file does not exist."""
    if not os.path.exists(path):
        return {"devices": {}}
    with open(path) as f:
        return json.load(f)


def reference_figures(entry: dict | None, parts) -> dict:
    """The entry's figures of the parts that ran (name prefix "serve " or "slora_disk ")."""
    return {name: f for name, f in (entry or {}).get("figures", {}).items() if name.split(" ")[0] in parts}


def updated_entry(entry: dict | None, figures: dict, parts, meta: dict, tiny: bool) -> dict:
    """The device's entry with the figures of `parts` replaced by the measured ones (others kept),
    each stamped with the run's date and source."""
    entry = dict(entry or {})
    kept = {n: f for n, f in entry.get("figures", {}).items() if n.split(" ")[0] not in parts}
    source = f"bench/regress.py --update, commit {meta['commit'] or '?'}{' (dirty)' if meta['dirty'] else ''}"
    stamped = {n: {**f, "date": meta["date"], "source": source} for n, f in figures.items()}
    entry.update({"updated": meta["date"], "jax": meta["jax"], "commit": meta["commit"],
                  "figures": {**kept, **stamped}})
    entry["note"] = f"measured by bench/regress.py --update on {meta['date']}"
    if tiny:
        entry["tolerance"] = TINY_TOLERANCE
        entry["note"] += (" (--tiny: a 2-layer model on a CPU; timings vary by tens of percent between runs, "
                          "so this entry checks that the guard runs end to end, not speed)")
    return entry


# ---- running the scripts --------------------------------------------------------------------------

def stream(command: list, log_path: str) -> int:
    """Runs `command` from the repository root (PYTHONPATH = root, unbuffered), printing its output
    and appending it to `log_path`; returns its exit status."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    print("$ " + shlex.join(command), flush=True)
    with open(log_path, "a") as log, subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        log.flush()
    return proc.returncode


def serve_command(args, out: str) -> list:
    """bench/serve.py's command: the headline trace (or its --tiny form)."""
    command = [sys.executable, "bench/serve.py", *(SERVE_TINY if args.tiny else SERVE_HEADLINE),
               "--compile-cache", args.compile_cache, "--out", out]
    if args.time_budget:
        command += ["--time-budget", str(args.time_budget)]
    return command + shlex.split(args.serve_args)


def slora_commands(args, out: str) -> list[list]:
    """bench/slora_disk.py's commands: --write-only first when folders are missing, then the run."""
    count = SLORA_TINY_ADAPTERS if args.tiny else SLORA_ADAPTERS
    folder = args.adapter_dir or ("/tmp/slora_adapters_tiny" if args.tiny else "/tmp/slora_adapters")
    common = [sys.executable, "bench/slora_disk.py", *(["--tiny"] if args.tiny else []),
              "--adapters", str(count), "--dir", folder]
    cases = [f"slora:n={count},alpha={alpha}" for alpha in SLORA_ALPHAS]
    run = [*common, "--cases", *cases, *SLORA_RUN, "--requests", "64" if args.tiny else "400",
           "--compile-cache", args.compile_cache, "--out", out, *shlex.split(args.slora_args)]
    written = os.path.isfile(os.path.join(folder, f"task-{count - 1:04d}", "adapter_model.safetensors"))
    return ([] if written else [[*common, "--write-only"]]) + [run]


def run_part(part: str, args) -> tuple[str, bool]:
    """Runs one part's command(s); returns (its JSON path, whether every command succeeded). The
    JSON of an earlier run is removed first, so a failed run leaves none behind."""
    out = os.path.join(args.out_dir, f"regress_{part}{'_tiny' if args.tiny else ''}.json")
    if os.path.exists(out):
        os.remove(out)
    commands = [serve_command(args, out)] if part == "serve" else slora_commands(args, out)
    for command in commands:
        if stream(command, args.log) != 0:
            print(f"[{part}] exited non-zero: {shlex.join(command)}", flush=True)
            return out, False
    return out, os.path.exists(out)


def git_commit() -> tuple[str | None, bool]:
    """HEAD's hash and whether the tree has changes (None, False without git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
        return head.stdout.strip(), bool(status.stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return None, False


def device_key(reports: dict, tiny: bool) -> tuple[str, str]:
    """(device kind as the scripts report it, reference key: the kind, "-tiny" appended with --tiny)."""
    device = next((r["device"] for r in reports.values() if r.get("device")), "unknown")
    return device, f"{device}-tiny" if tiny else device


# ---- main -----------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", action="extend", choices=PARTS, help="parts to run (default: both)")
    parser.add_argument("--tiny", action="store_true", help="both scripts' --tiny (CPU smoke test)")
    parser.add_argument("--out-dir", default=None, help="default bench/results (--tiny: /tmp/jaxlora_regress_tiny)")
    parser.add_argument("--reference", default=os.path.join(ROOT, "bench", "regress_reference.json"))
    parser.add_argument("--tolerance", type=float, default=None,
                        help=f"allowed drop (default: the reference entry's, else {DEFAULT_TOLERANCE})")
    parser.add_argument("--time-budget", type=float, default=0, help="seconds, passed to bench/serve.py")
    parser.add_argument("--update", action="store_true", help="write the measured figures as this device's reference")
    parser.add_argument("--compile-cache", default="/tmp/jaxlora_serve_jit_cache")
    parser.add_argument("--adapter-dir", default=None, help="slora_disk's adapter folders (default: its own)")
    parser.add_argument("--serve-args", default="", help='extra bench/serve.py arguments: --serve-args="--layers 8"')
    parser.add_argument("--slora-args", default="", help='extra bench/slora_disk.py arguments: --slora-args="..."')
    args = parser.parse_args(argv)
    args.parts = [p for p in PARTS if p in (args.only or PARTS)]
    default_out = "/tmp/jaxlora_regress_tiny" if args.tiny else os.path.join(ROOT, "bench", "results")
    args.out_dir = args.out_dir or default_out
    args.log = os.path.join(args.out_dir, f"regress_log{'_tiny' if args.tiny else ''}.txt")  # every command's output
    return args


def measure(args) -> tuple[dict, dict, list]:
    """Runs the parts; returns ({part: report}, {part: JSON path}, failed parts)."""
    reports, paths, failed = {}, {}, []
    for part in args.parts:
        path, ok = run_part(part, args)
        paths[part] = path
        if not ok:
            failed.append(part)
        if os.path.exists(path):
            with open(path) as f:
                reports[part] = json.load(f)
    return reports, paths, failed


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    open(args.log, "w").close()
    started = time.perf_counter()
    reports, paths, failed = measure(args)
    figures = {name: f for part, report in reports.items() for name, f in EXTRACT[part](report).items()}
    device, key = device_key(reports, args.tiny)
    commit, dirty = git_commit()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
            "dirty": dirty, "jax": next((r.get("jax") for r in reports.values()), None)}
    reference = load_reference(args.reference)
    entry = reference["devices"].get(key)
    if args.update and not failed:
        entry = reference["devices"][key] = updated_entry(entry, figures, args.parts, meta, args.tiny)
        with open(args.reference, "w") as f:
            json.dump(reference, f, indent=1)
            f.write("\n")
        print(f"updated the reference for {key!r} in {args.reference}", flush=True)
    tolerance = args.tolerance if args.tolerance is not None else (entry or {}).get("tolerance", DEFAULT_TOLERANCE)
    rows = compare(figures, reference_figures(entry, args.parts), tolerance)
    code = exit_code(rows, failed, entry is not None)
    print(f"\ndevice {device} (reference key {key!r}), jax {meta['jax']}, {meta['date']}, commit {commit}"
          f"{' (dirty)' if dirty else ''}, tolerance {tolerance:.0%}")
    print_table(rows)
    if failed:
        print(f"FAILED: {', '.join(failed)} exited non-zero or wrote no JSON (log: {args.log})")
    elif entry is None:
        print(f"no reference for {key!r} in {args.reference}: figures above are measured only; --update creates it")
    else:
        bad = failing(rows)
        print(f"{'DROP: ' + ', '.join(bad) if bad else 'PASS'} ({len(rows)} figures)")
    summary = {**meta, "device": device, "device_key": key, "tiny": args.tiny, "parts": args.parts,
               "tolerance": tolerance, "figures": figures, "reference": reference_figures(entry, args.parts),
               "verdicts": rows, "failed_parts": failed, "exit_code": code, "reports": paths, "log": args.log,
               "seconds": time.perf_counter() - started}
    out = os.path.join(args.out_dir, f"regress_{re.sub(r'[^a-z0-9]+', '_', key.lower()).strip('_')}.json")
    with open(out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"exit {code}; {summary['seconds']:.0f} s; wrote {out}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
