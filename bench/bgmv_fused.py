"""The fused decode BGMV (`pallas_kernels.bgmv_lora_fused`: a row's shrink and expand in one
launch) against today's pair (`bgmv_lora_grouped` / `bgmv_lora_stacked`: split-K shrink, then
expand; the tile table's configs), per projection group of the 8B shape over a stacked pool of
32 layers x 64 slots, rows on distinct slots (padding rows slot -1, as in a decode step), device
time per layer (a fori_loop over the layers, wall clock / layers), in one run.

    PYTHONPATH=. python bench/bgmv_fused.py [--rows 64] [--active 37] [--out FILE]
    PYTHONPATH=. python bench/bgmv_fused.py --tiny      # CPU smoke test (interpret mode, small shapes)

Prints per group: the pair's time, the fused kernel's best over a few tile configs, the bytes
floor (each active row's A and B read once at 4.0 TB/s), and writes JSON (device, jax, date)."""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import sys
import time

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from bench.bgmv_sweep import GROUPS, R
from bench.timing import median_call_seconds
from pallas_kernels.dispatch import FUSED_TILES

TINY_GROUPS = {"qkv": (64, (64, 32, 32)), "o": (64, (64,))}


def candidates(tiny: bool) -> list:
    if tiny:
        return [dataclasses.replace(FUSED_TILES, block_k=32, block_n=16, col_blocks=2, num_warps=1)]
    return [dataclasses.replace(FUSED_TILES, block_k=512, block_n=bn, col_blocks=cb, num_warps=w)
            for bn in (128, 256) for cb in (2, 4, 8) for w in (4, 8)]


def build(widths, layers, slots, slot, impl, fused, tiles, args):
    """The compiled layer loop of one kernel variant over `args` (ys, x, a, b, rank, scale)."""
    def run(ys, x, a, b, rank, scale):
        def body(layer, ys):
            offset = layer * slots
            if fused:
                return tuple(pk.bgmv_lora_fused(list(ys), x, a, b, slot, rank, scale, offset, impl=impl, tiles=tiles))
            if len(widths) == 1:
                return (pk.bgmv_lora_stacked(ys[0], x, a[0], b[0], slot, rank[0], scale[0], offset, impl=impl),)
            return tuple(pk.bgmv_lora_grouped(list(ys), x, a, b, slot, rank, scale, offset, impl=impl))
        return jax.lax.fori_loop(0, layers, body, ys)
    return jax.jit(run).lower(*args).compile()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--active", type=int, default=37, help="rows with an adapter (the rest slot -1)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default="bench/results/bgmv_fused.json")
    args = parser.parse_args()
    groups, layers, slots, rows, active = GROUPS, args.layers, args.slots, args.rows, args.active
    if args.tiny:
        groups, layers, slots, rows, active = TINY_GROUPS, 2, 4, 8, 5
    impl = "gpu"
    key = iter(jax.random.split(jax.random.key(0), 64))
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows, "active": active,
              "layers": layers, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
              "groups": {}}
    total_pair = total_fused = 0.0
    for name, (k, widths) in groups.items():
        a = [jax.random.normal(next(key), (layers * slots, k, R), jnp.bfloat16) * k ** -0.5 for _ in widths]
        b = [jax.random.normal(next(key), (layers * slots, R, n), jnp.bfloat16) for n in widths]
        rank = [jnp.full((layers * slots,), R, jnp.int32) for _ in widths]
        scale = [jnp.ones((layers * slots,), jnp.float32) for _ in widths]
        x = jax.random.normal(next(key), (rows, k), jnp.bfloat16)
        ys = tuple(jax.random.normal(next(key), (rows, n), jnp.float32) for n in widths)
        slot = jnp.where(jnp.arange(rows) < active, jnp.arange(rows) % slots, -1).astype(jnp.int32)
        call_args = (ys, x, a, b, rank, scale)
        variants = [("pair", False, None)] + [(f"fused bn{t.block_n} cb{t.col_blocks} w{t.num_warps}", True, t)
                                              for t in candidates(args.tiny)]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            compiled = list(pool.map(lambda v: _try(build, widths, layers, slots, slot, impl, v[1], v[2], call_args),
                                     variants))
        reference = jax.block_until_ready(compiled[0](*call_args))
        times = {}
        for (label, _, _), program in zip(variants, compiled):
            if program is None:
                continue
            error = max(float(jnp.linalg.norm(o - r) / jnp.linalg.norm(r - y))
                        for o, r, y in zip(program(*call_args), reference, ys))
            times[label] = {"us_per_layer": 1e6 * median_call_seconds(lambda: program(*call_args), 10, rounds=5) / layers,
                            "rel_err_vs_pair": error}
        floor = 1e6 * active * sum(k * R * 2 + R * n * 2 for n in widths) / 4.0e12
        best = min((v for k_, v in times.items() if k_ != "pair"), key=lambda v: v["us_per_layer"], default=None)
        best_label = next((k_ for k_, v in times.items() if v is best), None)
        report["groups"][name] = {"k": k, "widths": widths, "floor_us": floor, "variants": times, "best_fused": best_label}
        total_pair += times["pair"]["us_per_layer"]
        total_fused += best["us_per_layer"] if best else float("nan")
        print(f"{name:8} pair {times['pair']['us_per_layer']:7.2f} us  fused best {best['us_per_layer'] if best else float('nan'):7.2f} us "
              f"({best_label}, err {best['rel_err_vs_pair'] if best else float('nan'):.1e})  floor {floor:6.2f} us", flush=True)
    report["per_layer_us"] = {"pair": total_pair, "fused_best": total_fused}
    print(f"per layer: pair {total_pair:.2f} us, fused {total_fused:.2f} us; x{layers} layers: "
          f"{total_pair * layers / 1e3:.2f} vs {total_fused * layers / 1e3:.2f} ms a decode step "
          f"({report['device']}, jax {report['jax']})")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as err:  # an illegal config
        print("  skip", type(err).__name__, str(err)[:160], flush=True)
        return None


if __name__ == "__main__":
    main()
