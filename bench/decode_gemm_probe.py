"""Probe (issue 34 item 3): can a Pallas (Triton) GEMM read the decode step's weights as fast as
XLA's own GEMMs? A decode GEMM of our own is where each row's LoRA B could be read inside the
weight stream (the expand in its epilogue) instead of in separate kernels; it is worth building
only if the plain GEMM keeps XLA's speed (bench/NOTES_serve.md, fourteenth session).

    PYTHONPATH=. python bench/decode_gemm_probe.py [--rows 32 64] [--out FILE]
    PYTHONPATH=. python bench/decode_gemm_probe.py --tiny      # CPU smoke test (interpret, small)

    PYTHONPATH=. python bench/decode_gemm_probe.py --kernel mosaic   # JAX's Mosaic GPU Hopper GEMM (Hopper only)

`--kernel mosaic` times JAX's own warp-specialised Mosaic GPU GEMM
(`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`: TMA loads, wgmma, a persistent grid) over a
few tile configs instead (rows padded to its 64-row tile): the base of a decode GEMM whose LoRA
would run in warps of its own, if it streams the weights at XLA's speed.

For each projection of the 8B shape (q/k/v packed 4096 -> 6144, o 4096 -> 4096, gate/up packed
4096 -> 28672, down 14336 -> 4096) and row count: x [rows, k] @ W [k, n] over 8 different
weights (so the weights stream from HBM, not L2), XLA's `jnp.dot` (autotuned by XLA) against the
Pallas kernel over a few tile configs (split-K partials in float32 summed by an XLA fusion when
split_k > 1), us per GEMM and the fraction of the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from bench.timing import copy_bandwidth, median_call_seconds

_F32, _BF16 = jnp.float32, jnp.bfloat16
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
TINY_SHAPES = {"qkv": (64, 96), "down": (128, 32)}
# (block_n, block_k, split_k, num_warps, num_stages)
CONFIGS = [(64, 128, 1, 4, 4), (32, 256, 1, 4, 4), (128, 128, 4, 4, 4), (64, 256, 4, 4, 4), (128, 256, 8, 4, 3),
           (256, 128, 8, 8, 4), (128, 64, 2, 4, 6), (64, 128, 8, 4, 4)]
TINY_CONFIGS = [(32, 32, 1, 4, 2), (16, 32, 2, 4, 2)]
WIDE_CONFIGS = [(bn, bk, split, warps, stages) for bn in (64, 128, 256) for bk in (64, 128) for split in (2, 4)
                for warps, stages in ((4, 6), (8, 4))]  # --sweep wide: around the first sweep's best


def _kernel(x_ref, w_ref, o_ref, *, block_k: int, steps: int):
    """One (column block, K split) program: o = x[:, its K range] @ W[its K range, its columns]."""
    def body(i, acc):
        k0 = pl.multiple_of(i * block_k, block_k)
        return acc + jnp.dot(x_ref[:, pl.ds(k0, block_k)], w_ref[pl.ds(k0, block_k), :], preferred_element_type=_F32)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape[-2:], _F32))
    o_ref[...] = acc.reshape(o_ref.shape).astype(o_ref.dtype)


def pallas_gemm(x, w, config, interpret: bool):
    """x [m, k] @ w [k, n] -> [m, n] bf16 by the Pallas kernel with `config`."""
    block_n, block_k, split_k, warps, stages = config
    (m, k), n = x.shape, w.shape[1]
    k_split = k // split_k
    out_dtype = _F32 if split_k > 1 else x.dtype
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, steps=k_split // block_k),
        out_shape=jax.ShapeDtypeStruct((split_k, m, n), out_dtype),
        grid=(n // block_n, split_k),
        in_specs=[pl.BlockSpec((m, k_split), lambda j, s: (0, s)),
                  pl.BlockSpec((k_split, block_n), lambda j, s: (s, j))],
        out_specs=pl.BlockSpec((1, m, block_n), lambda j, s: (s, 0, j)),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
    )(x, w)
    return out[0] if split_k == 1 else out.sum(0).astype(x.dtype)


# JAX's Hopper GEMM (`hopper_matmul_mgpu.TuningConfig`): (tile_n, tile_k, max_concurrent_steps); tile_m 64,
# the two compute warpgroups side by side in N (a CTA's tile 64 x 2*tile_n)
MOSAIC_CONFIGS = [(64, 64, 4), (64, 64, 8), (64, 128, 4), (128, 64, 4), (64, 256, 2)]  # fit 227 KB (jax.export check)
MOSAIC_ROWS = 64


def mosaic_gemm(x, w, config):
    """x [m, k] @ w [k, n] -> [m, n] bf16 by JAX's Mosaic GPU Hopper GEMM (rows padded to 64)."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hopper

    tile_n, tile_k, steps = config
    m = x.shape[0]
    padded = jnp.pad(x, ((0, -m % MOSAIC_ROWS), (0, 0)))
    tuning = hopper.TuningConfig(tile_m=MOSAIC_ROWS, tile_n=tile_n, tile_k=tile_k, max_concurrent_steps=steps,
                                 epi_tile_m=MOSAIC_ROWS, epi_tile_n=min(64, tile_n),
                                 wg_dimension=hopper.MatmulDimension.N)
    return hopper.matmul(padded, w, None, tuning)[:m]


def chain(gemm):
    """The sum of x @ w_i over the weights (each product rounded to bf16, as a projection's)."""
    def run(x, ws):
        total = jnp.zeros((x.shape[0], ws[0].shape[1]), _F32)
        for w in ws:
            total = total + gemm(x, w).astype(_F32)
        return total
    return jax.jit(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--weights", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", choices=("first", "wide"), default="first")
    parser.add_argument("--shapes", nargs="+", default=None, choices=list(SHAPES))
    parser.add_argument("--kernel", choices=("pallas", "mosaic"), default="pallas",
                        help="pallas: the Pallas (Triton) kernel above; mosaic: JAX's Mosaic GPU Hopper GEMM")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    shapes, configs = (TINY_SHAPES, TINY_CONFIGS) if args.tiny else (SHAPES, CONFIGS)
    if not args.tiny and args.sweep == "wide":
        configs = WIDE_CONFIGS
    if args.kernel == "mosaic":
        if jax.default_backend() != "gpu":
            raise SystemExit("--kernel mosaic needs a Hopper GPU (Mosaic GPU has no CPU lowering)")
        configs = MOSAIC_CONFIGS
    if args.shapes and not args.tiny:
        shapes = {name: SHAPES[name] for name in args.shapes}
    if args.tiny:
        args.rows, args.weights, args.repeats = [16], 2, 2
    interpret = jax.default_backend() != "gpu"
    bandwidth = None if args.tiny else copy_bandwidth()
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "kernel": args.kernel,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "copy_bandwidth_tb_s": None if bandwidth is None else bandwidth / 1e12, "cases": []}
    key = jax.random.PRNGKey(0)
    for name, (k, n) in shapes.items():
        keys = jax.random.split(key, args.weights + 1)
        ws = [(jax.random.normal(kk, (k, n), _F32) * k ** -0.5).astype(_BF16) for kk in keys[1:]]
        for rows in args.rows:
            x = jax.random.normal(keys[0], (rows, k), _F32).astype(_BF16)
            bytes_per_gemm = 2 * (k * n + rows * k + rows * n)
            xla = chain(lambda x, w: jnp.dot(x, w, preferred_element_type=_F32).astype(_BF16))
            ref = np.asarray(xla(x, ws))
            case = {"proj": name, "k": k, "n": n, "rows": rows, "configs": []}
            seconds = median_call_seconds(lambda: xla(x, ws), args.repeats) / args.weights
            case["xla_us"] = seconds * 1e6
            case["xla_of_bandwidth"] = bytes_per_gemm / seconds / bandwidth if bandwidth else None
            for config in configs:
                if args.kernel == "mosaic":
                    if n % (2 * config[0]) or k % config[1]:
                        continue
                    gemm = functools.partial(mosaic_gemm, config=config)
                else:
                    block_n, block_k, split_k = config[:3]
                    if n % block_n or k % (split_k * block_k):
                        continue
                    gemm = functools.partial(pallas_gemm, config=config, interpret=interpret)
                try:
                    fn = chain(gemm)
                    out = np.asarray(fn(x, ws))
                    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                    seconds = median_call_seconds(lambda: fn(x, ws), args.repeats) / args.weights
                    case["configs"].append({"config": config, "us": seconds * 1e6, "rel_err_vs_xla": err,
                                            "of_bandwidth": bytes_per_gemm / seconds / bandwidth if bandwidth else None})
                except Exception as error:  # a config Triton cannot compile: recorded, the others run
                    case["configs"].append({"config": config, "error": f"{type(error).__name__}: {str(error)[:200]}"})
            timed = [c for c in case["configs"] if "us" in c]
            best = min(timed, key=lambda c: c["us"]) if timed else None
            case["best"] = best
            case["best_over_xla"] = best["us"] / case["xla_us"] if best else None
            result["cases"].append(case)
            print(json.dumps({key: case[key] for key in ("proj", "rows", "xla_us", "best_over_xla")} |
                             {"best": best}), flush=True)
            if args.out:  # after every case: a call cut short keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
