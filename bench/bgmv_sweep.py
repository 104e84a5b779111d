"""BGMV shrink -> expand pairs of a decode step, tuned as pairs (the shrink's split-K count sets the
partials every expand program sums): per projection group of the 8B shape (q/k/v grouped, o,
gate/up grouped, down) over a stacked pool of 32 layers x 64 slots, rows using distinct slots,
device time per layer (a fori_loop over the layers, back-to-back calls, wall clock / layers).

Stage 1 sweeps the shrink (block_k, k_splits, num_warps) with the table's expand; stage 2 the
expand (block_n, col_blocks, num_warps) with stage 1's best shrink. Prints a table and the
adapter-bytes floor per group; writes --out (JSON)."""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import time

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from bench.timing import median_call_seconds
from pallas_kernels.dispatch import choose_tiles
from pallas_kernels.tiles import TileConfig

GROUPS = {  # name: (k, output widths)
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
R = 16


def shrink_candidates(k: int):
    out = []
    for splits in (4, 8, 16, 32, 64):
        for block_k in (128, 256, 512):
            if k // block_k < splits or k % block_k:
                continue
            for warps in (2, 4):
                out.append(TileConfig(1, block_k, 16, 16, splits, warps, 2))
    return out


def expand_candidates():
    return [TileConfig(1, 16, bn, 16, 1, warps, 2, cb) for bn in (64, 128, 256) for cb in (1, 2, 4, 8)
            for warps in (1, 2, 4) if bn * cb <= 1024 and not (bn >= 256 and warps == 1)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[32])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--groups", nargs="+", default=list(GROUPS))
    parser.add_argument("--out", default="/tmp/bgmv_sweep.json")
    parser.add_argument("--write-table", action="store_true",
                        help="write each group's best pair into pallas_kernels/tile_table.json where it beats the table")
    parser.add_argument("--max-candidates", type=int, default=None, help="per stage (a CPU smoke test)")
    args = parser.parse_args()
    L, S = args.layers, args.slots
    key = iter(jax.random.split(jax.random.key(0), 64))
    results = {}
    t_start = time.perf_counter()
    for name in args.groups:
        k, widths = GROUPS[name]
        a = [jax.random.normal(next(key), (L * S, k, R), jnp.bfloat16) * k ** -0.5 for _ in widths]
        b = [jax.random.normal(next(key), (L * S, R, n), jnp.bfloat16) for n in widths]
        rank = [jnp.full((L * S,), R, jnp.int32) for _ in widths]
        scale = [jnp.ones((L * S,), jnp.float32) for _ in widths]
        for rows in args.rows:
            x = jax.random.normal(next(key), (rows, k), jnp.bfloat16)
            ys = tuple(jnp.zeros((rows, n), jnp.float32) for n in widths)
            slot = jnp.arange(rows, dtype=jnp.int32) % S

            def build(tiles):
                def run(ys, x, a, b, rank, scale):
                    def body(layer, ys):
                        offset = layer * S
                        if len(widths) == 1:
                            return (pk.bgmv_lora_stacked(ys[0], x, a[0], b[0], slot, rank[0], scale[0], offset,
                                                         impl="gpu", tiles=tiles),)
                        return tuple(pk.bgmv_lora_grouped(list(ys), x, a, b, slot, rank, scale, offset, impl="gpu",
                                                          tiles=tiles))
                    return jax.lax.fori_loop(0, L, body, ys)
                fn = jax.jit(run)
                return fn.lower(ys, x, a, b, rank, scale).compile()

            def measure(compiled):
                call = lambda: compiled(ys, x, a, b, rank, scale)
                return 1e6 * median_call_seconds(call, 10, rounds=5) / L

            def sweep(cands):
                with concurrent.futures.ThreadPoolExecutor(16) as pool:
                    compiled = list(pool.map(lambda t: _try(build, t), cands))
                out = []
                for tiles, c in zip(cands, compiled):
                    if c is not None:
                        out.append((measure(c), tiles))
                return sorted(out, key=lambda e: e[0])

            g = len(widths)  # the dispatcher's lookup keys (ops.bgmv_lora_grouped / bgmv_lora_stacked)
            table_shrink = choose_tiles("bgmv_shrink", "gpu", rows, k, g * R, R)
            table_expand = choose_tiles("bgmv_expand", "gpu", rows, g * R, min(widths), R)
            base = sweep([(table_shrink, table_expand)])
            cap = slice(0, args.max_candidates)
            stage1 = sweep([(s, table_expand) for s in shrink_candidates(k)[cap]])
            best_shrink = stage1[0][1][0]
            stage2 = sweep([(best_shrink, e) for e in expand_candidates()[cap]])
            floor_us = 1e6 * rows * sum(k * R * 2 + R * n * 2 for n in widths) / 4.0e12
            entry = {"table_us": base[0][0], "table": [dataclasses.asdict(t) for t in base[0][1]],
                     "best_us": stage2[0][0], "best": [dataclasses.asdict(t) for t in stage2[0][1]],
                     "floor_us_4TBps": floor_us,
                     "stage1_top": [(us, dataclasses.asdict(t[0])) for us, t in stage1[:5]],
                     "stage2_top": [(us, dataclasses.asdict(t[1])) for us, t in stage2[:5]]}
            results[f"{name}/{rows}"] = entry
            if args.write_table and stage2[0][0] < base[0][0]:
                write_entries(rows, k, widths, stage2[0][1], stage2[0][0])
            print(f"{name:8} rows {rows:3}: table {base[0][0]:6.2f} us  best {stage2[0][0]:6.2f} us  floor "
                  f"{floor_us:5.2f} us  shrink {_short(stage2[0][1][0], 's')}  expand {_short(stage2[0][1][1], 'e')}"
                  f"  [{time.perf_counter() - t_start:.0f} s]", flush=True)
            for us, t in stage1[:3]:
                print(f"     s {us:6.2f} {_short(t[0], 's')}")
            for us, t in stage2[:3]:
                print(f"     e {us:6.2f} {_short(t[1], 'e')}")
            results.update(device=jax.devices()[0].device_kind, jax=jax.__version__,
                           date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"))
            with open(args.out, "w") as f:  # after every measurement: a run cut short keeps what it has
                json.dump(results, f, indent=1)
        del a, b


def write_entries(rows: int, k: int, widths, tiles, us: float):
    """The pair's table entries under the dispatcher's keys (shape_bucket of the lookup)."""
    from pallas_kernels.tiles import TABLE_PATH, shape_bucket

    table = json.loads(TABLE_PATH.read_text())
    device = table.setdefault(jax.devices()[0].device_kind, {})
    g = len(widths)
    for op, dims, cfg in (("bgmv_shrink", (rows, k, g * R), tiles[0]), ("bgmv_expand", (rows, g * R, min(widths)), tiles[1])):
        fields = dataclasses.asdict(cfg)
        fields.update(block_rows=1, pair_us=round(us, 2))
        device.setdefault(op, {})[shape_bucket(*dims)] = fields
    TABLE_PATH.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def _short(t: TileConfig, kind: str) -> str:
    if kind == "s":
        return f"bk{t.block_k}/ks{t.k_splits}/w{t.num_warps}"
    return f"bn{t.block_n}/cb{t.col_blocks}/w{t.num_warps}"


def _try(build, tiles):
    try:
        return build(tiles)
    except Exception as err:  # an illegal config
        print("  skip", tiles, type(err).__name__, str(err)[:100], flush=True)
        return None


if __name__ == "__main__":
    main()
