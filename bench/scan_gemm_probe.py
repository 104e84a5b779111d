"""Does a stand-in's per-compile XLA option reach the compiler? (issue 35 item 2, 2026-11-28)

A scan over stacked per-layer weights (the 8B MLP's up projection, 32 layers, 32 rows) compiled three
ways: XLA's default, with `serve.step.Programs.compile_options(stand_in=True)` passed to
`Lowered.compile(compiler_options=...)` (how the server compiles its stand-ins), and the same option
set in XLA_FLAGS would be the third (a process of its own; see bench/device_runs.sh scan_cublas). For
each: device time per call (median of `--calls`), and what the optimized HLO holds (Triton GEMM
fusions, cuBLAS custom calls, copies). Writes JSON.

  python bench/scan_gemm_probe.py [--tiny] [--out bench/results/scan_gemm_probe_<gpu>.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# run as a script, this folder (bench/serve.py) would hide the serve package
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
from serve.step import STAND_IN_GPU_OPTIONS, Programs  # noqa: E402


def stacked_scan(x, weights):
    """x [R, d] through every layer of weights [L, d, f] then back [L, f, d] (a scan body per layer)."""
    def body(h, w):
        up, down = w
        return (jax.nn.silu(h @ up) @ down).astype(h.dtype), None

    return jax.lax.scan(body, x, weights)[0]


def hlo_counts(text: str) -> dict:
    return {"triton_gemm": len(re.findall(r"__triton_gemm|kind=kCustom.*triton", text)),
            "cublas": len(re.findall(r"__cublas", text)), "copies": len(re.findall(r"\bcopy\(|copy-start", text)),
            "dynamic_slice": len(re.findall(r"dynamic-slice\(", text))}


def timed(fn, args, calls: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    layers, rows, d, f = (2, 8, 64, 128) if args.tiny else (32, 32, 4096, 14336)
    dtype = jnp.bfloat16
    key = jax.random.key(0)
    x = jax.random.normal(key, (rows, d), dtype)
    up = (jax.random.normal(jax.random.fold_in(key, 1), (layers, d, f), jnp.float32) * 0.02).astype(dtype)
    down = (jax.random.normal(jax.random.fold_in(key, 2), (layers, f, d), jnp.float32) * 0.02).astype(dtype)
    lowered = jax.jit(stacked_scan).lower(x, (up, down))
    options = Programs.compile_options(True) or dict(STAND_IN_GPU_OPTIONS)  # on a CPU: the GPU's options
    results = {}
    for name, opts in (("default", None), ("stand_in_options", options)):
        compiled = lowered.compile(compiler_options=opts)
        results[name] = {"options": opts, "ms": timed(compiled, (x, (up, down)), args.calls),
                         "hlo": hlo_counts(compiled.as_text())}
        print(name, results[name], flush=True)
    weight_bytes = (up.size + down.size) * 2
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "shape": {"layers": layers, "rows": rows, "d": d, "f": f}, "weight_bytes": weight_bytes,
              "results": results}
    for r in results.values():
        r["weight_read_tb_s"] = weight_bytes / (r["ms"] * 1e-3) / 1e12
    out = args.out or f"bench/results/scan_gemm_probe_{'cpu' if args.tiny else 'gpu'}.json"
    with open(out, "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"device {report['device']}, jax {report['jax']}; wrote {out}")


if __name__ == "__main__":
    main()
