"""The LoRA kernels over paged adapter rows (`pallas_kernels.paged_lora`, unified paging) against the
padded-slot kernels (`pallas_kernels.bgmv_lora_stacked` / `sgmv_lora_stacked`) on the same adapters:
decode (BGMV, one row per request) and prefill (SGMV, segments) at Llama-3.1-8B projection shapes,
bfloat16, ranks mixed over `--ranks`, one adapter per row / segment, rows scattered over the pool.

    PYTHONPATH=. python bench/paged_lora.py [--out bench/results/paged_lora.json]
    PYTHONPATH=. python bench/paged_lora.py --tiny     # CPU smoke test (interpret mode, tiny shapes)

Reported per case: microseconds per call of each (median of back-to-back calls, `bench.timing`),
the bytes of A/B the adapters of the call hold at their own ranks, and their relative difference
(both computed on the same inputs: the paged result against the padded one, relative norm).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import jax
import jax.numpy as jnp
import numpy as np

from bench.timing import median_call_seconds
from pallas_kernels import bgmv_lora_stacked, sgmv_lora_stacked
from pallas_kernels.paged_lora import bgmv_lora_paged, sgmv_lora_paged


def make_pools(k: int, n: int, ranks, max_rank: int, seed: int = 0):
    """(padded A [E, k, r_max], B [E, r_max, n], paged a_rows [R, k], b_rows [R, n], table [E, r_max],
    rank [E], scale [E]): the same adapters both ways, the paged rows in shuffled order."""
    rng = np.random.default_rng(seed)
    entries, total = len(ranks), int(np.sum(ranks))
    a_rows = jnp.asarray(rng.normal(0, k ** -0.5, (total, k)), jnp.bfloat16)
    b_rows = jnp.asarray(rng.normal(0, 0.02, (total, n)), jnp.bfloat16)
    order = rng.permutation(total)
    table = np.zeros((entries, max_rank), np.int32)
    start = 0
    for e, r in enumerate(ranks):
        table[e, :r] = order[start: start + r]
        start += r
    live = np.arange(max_rank)[None, :] < np.asarray(ranks)[:, None]
    a_pad = jnp.where(live[:, None, :], jnp.swapaxes(a_rows[table], 1, 2), 0).astype(jnp.bfloat16)
    b_pad = jnp.where(live[:, :, None], b_rows[table], 0).astype(jnp.bfloat16)
    rank = jnp.asarray(ranks, jnp.int32)
    scale = jnp.asarray(rng.uniform(0.5, 2, entries), jnp.float32)
    return a_pad, b_pad, a_rows, b_rows, jnp.asarray(table), rank, scale


def run_case(name: str, k: int, n: int, rows: int, segments: int, ranks, max_rank: int, repeats: int) -> dict:
    """Times one case: `segments` adapters (0: decode, one adapter per row) over `rows` tokens."""
    a_pad, b_pad, a_rows, b_rows, table, rank, scale = make_pools(k, n, ranks, max_rank)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(rows, k)), jnp.bfloat16)
    y = jnp.asarray(rng.normal(size=(rows, n)), jnp.float32)
    zero = jnp.int32(0)
    if segments == 0:
        slot = jnp.asarray(np.arange(rows) % len(ranks), jnp.int32)
        padded = jax.jit(lambda y, x: bgmv_lora_stacked(y, x, a_pad, b_pad, slot, rank, scale, zero))
        paged = jax.jit(lambda y, x: bgmv_lora_paged(y, x, a_rows, b_rows, slot, table, rank, scale))
    else:
        starts = jnp.asarray(np.linspace(0, rows, segments + 1).astype(np.int32))
        seg_slot = jnp.arange(segments, dtype=jnp.int32) % len(ranks)
        padded = jax.jit(lambda y, x: sgmv_lora_stacked(y, x, a_pad, b_pad, starts, seg_slot, rank, scale, zero))
        paged = jax.jit(lambda y, x: sgmv_lora_paged(y, x, a_rows, b_rows, starts, seg_slot, table, rank, scale))
    want, got = padded(y, x), paged(y, x)
    diff = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want - y))
    times = {label: median_call_seconds(lambda fn=fn: fn(y, x), repeats) * 1e6
             for label, fn in (("padded_us", padded), ("paged_us", paged))}
    used = sorted(set(np.asarray(slot if segments == 0 else seg_slot).tolist()))
    own_bytes = 2 * sum(int(ranks[e]) * (k + n) for e in used)
    result = {"case": name, "k": k, "n": n, "rows": rows, "segments": segments, "max_rank": max_rank,
              "adapters": len(used), "own_rank_bytes": own_bytes, **times, "rel_diff": diff}
    print(f"{name:28} padded {times['padded_us']:9.1f} us  paged {times['paged_us']:9.1f} us  "
          f"rel diff {diff:.1e}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    max_rank = max(args.ranks)
    adapters = 8 if args.tiny else 64
    ranks = [args.ranks[i % len(args.ranks)] for i in range(adapters)]
    repeats = args.repeats or (2 if args.tiny else 50)
    shapes = [("q_proj", 64, 64)] if args.tiny else [("q_proj", 4096, 4096), ("v_proj", 4096, 1024),
                                                      ("down_proj", 14336, 4096)]
    batches = [(8, 0), (32, 4)] if args.tiny else [(64, 0), (256, 0), (2048, 16), (2048, 64)]
    results = [run_case(f"{module} T={rows} S={segments}", k, n, rows, segments, ranks, max_rank, repeats)
               for module, k, n in shapes for rows, segments in batches]
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "ranks": ranks,
              "results": results}
    out = args.out or f"bench/results/paged_lora{'_tiny' if args.tiny else ''}.json"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
