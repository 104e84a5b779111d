"""The merged-mode switch (V-LoRA's swift switch, issue 38): one r=16 adapter merged into (and
unmerged from) all seven projections of every layer of the Llama-3.1-8B shape, packed as the
serving model packs them (q/k/v and gate/up share a kernel), bf16.

Times, in one run on one device, each switch waited for (median and max of `--repeats`):
  reference  `merge_columns_reference` (XLA: ΔW per layer as a float32 GEMM output, then the add)
  kernel     `merge_columns` (`pallas_kernels.merge_gpu`: one pass, ΔW per tile in registers)
merge (base + ΔW into the kernels) and unmerge (the base copy back) for both, and the bytes each
must move at least (read the base copy, write the kernel columns), as GB/s and as a fraction of
`--bandwidth-tbs` (4.0: JAX's copy on an H200).

    PYTHONPATH=. python3 bench/merge_switch.py [--out bench/results/merge_switch_<gpu>.json]
    JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/merge_switch.py --tiny   # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.merge_gpu import merge_columns

# (kernel key, its width, ((projection, column offset, width), ...), k) for the 8B shape
LLAMA_8B = (("qkv", 6144, (("q_proj", 0, 4096), ("k_proj", 4096, 1024), ("v_proj", 5120, 1024)), 4096),
            ("o", 4096, (("o_proj", 0, 4096),), 4096),
            ("gate_up", 28672, (("gate_proj", 0, 14336), ("up_proj", 14336, 14336)), 4096),
            ("down", 4096, (("down_proj", 0, 4096),), 14336))
TINY = (("qkv", 192, (("q_proj", 0, 128), ("k_proj", 128, 32), ("v_proj", 160, 32)), 128),
        ("o", 128, (("o_proj", 0, 128),), 128),
        ("gate_up", 512, (("gate_proj", 0, 256), ("up_proj", 256, 256)), 128),
        ("down", 128, (("down_proj", 0, 128),), 256))


def make_arrays(shape, layers: int, rank: int, seed: int = 0):
    """(kernels {key: [L, k, width]}, base {projection: [L, k, n]}, adapter {projection: (a, b,
    scale)}), bf16 random on the device, built there (no host copy of 15 GB)."""
    key = jax.random.key(seed)
    kernels, base, adapter = {}, {}, {}
    for index, (name, width, targets, k) in enumerate(shape):
        kernels[name] = jax.random.normal(jax.random.fold_in(key, index), (layers, k, width), jnp.bfloat16)
        for j, (projection, offset, n) in enumerate(targets):
            base[projection] = jnp.array(kernels[name][:, :, offset: offset + n], copy=True)
            sub = jax.random.fold_in(key, 100 + 10 * index + j)
            a = (jax.random.normal(sub, (layers, k, rank)) * k**-0.5).astype(jnp.bfloat16)
            b = (jax.random.normal(jax.random.fold_in(sub, 1), (layers, rank, n)) * 0.01).astype(jnp.bfloat16)
            adapter[projection] = (a, b, jnp.full((layers,), 2.0, jnp.float32))
    return kernels, base, adapter


@functools.partial(jax.jit, static_argnames=("shape", "impl", "blocks"), donate_argnums=(0,))
def switch(kernels, base, adapter, merged, shape, impl, blocks=None):
    """Every projection's columns of `kernels` (donated) set to base + ΔW (merged) or base."""
    kernels = dict(kernels)
    for name, _, targets, _ in shape:
        for projection, offset, _ in targets:
            a, b, scale = adapter[projection]
            kernels[name] = merge_columns(kernels[name], base[projection], a, b, scale, merged, offset, impl=impl,
                                          blocks=blocks)
    return kernels


def time_switches(kernels, base, adapter, shape, impl, repeats: int, blocks=None):
    """(kernels, {"merge": [ms...], "unmerge": [ms...]}) after a warm-up pair (compiles)."""
    times = {"merge": [], "unmerge": []}
    for i in range(repeats + 1):
        for kind, merged in (("merge", True), ("unmerge", False)):
            started = time.perf_counter()
            kernels = jax.block_until_ready(switch(kernels, base, adapter, jnp.bool_(merged), shape, impl, blocks))
            if i:
                times[kind].append(1e3 * (time.perf_counter() - started))
    return kernels, times


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="small shapes, 2 layers (CPU smoke run)")
    parser.add_argument("--layers", type=int, default=None, help="default 32 (--tiny: 2)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--bandwidth-tbs", type=float, default=4.0, help="the device's copy bandwidth (H200: 4.0)")
    parser.add_argument("--blocks", nargs="*", default=[],
                        help="also time the kernel under these block_k,block_n,num_warps triples (e.g. 128,256,8)")
    parser.add_argument("--out", default=None, help="JSON (default bench/results/merge_switch_<device>.json)")
    args = parser.parse_args(argv)
    shape = TINY if args.tiny else LLAMA_8B
    layers = args.layers or (2 if args.tiny else 32)
    device = jax.devices()[0].device_kind
    kernels, base, adapter = make_arrays(shape, layers, args.rank)
    floor_bytes = 2 * sum(x.nbytes for x in base.values())  # read the base copy, write the columns
    report = {"device": device, "jax": jax.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "shape": "tiny" if args.tiny else "Llama-3.1-8B, 7 projections, packed", "layers": layers,
              "rank": args.rank, "dtype": "bfloat16", "bytes_moved_floor": floor_bytes, "repeats": args.repeats,
              "results": {}}
    expected = None
    kernel_impl = None if jax.default_backend() == "gpu" else "gpu"  # off a GPU: interpret mode (smoke)
    for impl in ("reference", kernel_impl):
        name = "reference" if impl == "reference" else "kernel"
        kernels, times = time_switches(kernels, base, adapter, shape, impl, args.repeats)
        merged = switch(kernels, base, adapter, jnp.bool_(True), shape, impl)
        sample = np.asarray(merged["o"][0, :256, :256], np.float32)
        expected = sample if expected is None else expected
        kernels = switch(merged, base, adapter, jnp.bool_(False), shape, impl)
        row = {}
        for kind, values in times.items():
            median = statistics.median(values)
            row[kind] = {"ms_median": median, "ms_max": max(values), "gb_per_s": floor_bytes / median / 1e6,
                         "fraction_of_floor": floor_bytes / (args.bandwidth_tbs * 1e12) / (median / 1e3)}
        row["max_abs_diff_vs_reference"] = float(np.abs(sample - expected).max())
        report["results"][name] = row
        print(f"{name:9s} merge {row['merge']['ms_median']:7.2f} ms (max {row['merge']['ms_max']:.2f}), "
              f"unmerge {row['unmerge']['ms_median']:7.2f} ms; {row['merge']['gb_per_s']:.0f} GB/s, "
              f"{row['merge']['fraction_of_floor']:.2f} of the {args.bandwidth_tbs} TB/s floor", flush=True)
    report["blocks_sweep"] = []
    for spec in args.blocks:
        blocks = tuple(int(v) for v in spec.split(","))
        kernels, times = time_switches(kernels, base, adapter, shape, kernel_impl, max(3, args.repeats // 2), blocks)
        median = statistics.median(times["merge"])
        report["blocks_sweep"].append({"blocks": blocks, "merge_ms_median": median,
                                       "unmerge_ms_median": statistics.median(times["unmerge"])})
        print(f"kernel blocks {blocks}: merge {median:.2f} ms, unmerge {statistics.median(times['unmerge']):.2f} ms",
              flush=True)
    restored = all(np.asarray(kernels[name][:, :, offset: offset + n]).tobytes() == np.asarray(base[p]).tobytes()
                   for name, _, targets, _ in shape[:2] for p, offset, n in targets)
    report["unmerge_restores_base_bits"] = bool(restored)
    print(f"device {device}, jax {jax.__version__}; floor {floor_bytes / 1e9:.1f} GB moved a switch; "
          f"unmerge restores the base bit for bit: {restored}")
    out = args.out or os.path.join("bench", "results", f"merge_switch_{'cpu' if args.tiny else device.split()[-1].lower()}.json")
    with open(out, "w") as file:
        json.dump(report, file, indent=1)
    return report


if __name__ == "__main__":
    main()
