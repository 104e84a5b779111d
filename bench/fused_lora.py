"""Benchmark of the fused LoRA training kernels (LoRAFusion D/E/I/K/L) against plain XLA.

For x [m, k], W [k, n], rank r, bf16, it times (median of --iters runs, jitted):
  base      x @ W (forward) / dX = dY W^T (backward): the lower bound
  xla       unfused LoRA in XLA: y = x @ W + s * (dropout(x) @ A) @ B, JAX autodiff
            (multi-adapter: one such LoRA per segment on static slices, concatenated)
  fused     fused_lora_linear(_single) (impl=--impl)
for one adapter and for --adapters adapters of equal share; "fwd" is y, "fwd+bwd" is y plus
dX, dA, dB. The dropout mask of the XLA baseline uses the same hash (not jax.random).

Run from the repo root: python bench/fused_lora.py [--m 4096 --k 4096 --n 4096 --rank 16]
[--out FILE.json] (prefix PYTHONPATH=. where the project is not pip-installed).
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_kernels.fused_lora import fused_lora_linear, fused_lora_linear_single
from pallas_kernels.fused_lora_layout import dropout_mask


def timed(fn, *args, iters: int):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def xla_lora(x, w, a, b, scale, p, seed, row0=0):
    keep = dropout_mask(seed, x.shape[0], x.shape[1], p, row_offset=row0)
    xhat = jnp.where(keep, x, 0) * jnp.asarray(1.0 / (1.0 - p), x.dtype)
    return x @ w + (scale * ((xhat @ a) @ b)).astype(x.dtype)


def grads(fn):
    def loss(x, a, b):
        return jnp.sum(fn(x, a, b).astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--impl", default=None)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    m, k, n, r, num = args.m, args.k, args.n, args.rank, args.adapters
    dtype = jnp.bfloat16
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(keys[0], (m, k), dtype)
    w = (jax.random.normal(keys[1], (k, n), jnp.float32) / k ** 0.5).astype(dtype)
    a = (jax.random.normal(keys[2], (num, k, r), jnp.float32) / k ** 0.5).astype(dtype)
    b = (jax.random.normal(keys[3], (num, r, n), jnp.float32) / r ** 0.5).astype(dtype)
    p, scale, seed = 0.1, 2.0, 7
    bounds = [m * i // num for i in range(num + 1)]
    seg_starts = jnp.array(bounds, jnp.int32)
    seg_slot = jnp.arange(num, dtype=jnp.int32)
    ranks = jnp.full((num,), r, jnp.int32)
    scales = jnp.full((num,), scale, jnp.float32)
    drops = jnp.full((num,), p, jnp.float32)

    def multi_fused(x, a, b):
        return fused_lora_linear(x, w, a, b, seg_starts, seg_slot, ranks, scales, drops, seed,
                                 impl=args.impl)

    def multi_xla(x, a, b):
        return jnp.concatenate([
            xla_lora(x[lo:hi], w, a[i], b[i], scale, p, seed, lo)
            for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))])

    def single_fused(x, a, b):
        return fused_lora_linear_single(x, w, a[0], b[0], scale, p, seed, impl=args.impl)

    def single_xla(x, a, b):
        return xla_lora(x, w, a[0], b[0], scale, p, seed)

    base = jax.jit(lambda x: x @ w)
    base_bwd = jax.jit(lambda dy: dy @ w.T)
    results = {
        "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "shape": {"m": m, "k": k, "n": n, "rank": r, "adapters": num, "dtype": "bfloat16"},
        "base_fwd_us": timed(base, x, iters=args.iters),
        "base_fwd_plus_dx_us": timed(base, x, iters=args.iters)
        + timed(base_bwd, jnp.ones((m, n), dtype), iters=args.iters),
    }
    for name, fn in [("single_xla", single_xla), ("single_fused", single_fused),
                     ("multi_xla", multi_xla), ("multi_fused", multi_fused)]:
        results[f"{name}_fwd_us"] = timed(jax.jit(fn), x, a, b, iters=args.iters)
        results[f"{name}_fwd_bwd_us"] = timed(grads(fn), x, a, b, iters=args.iters)
    for key, value in results.items():
        print(f"{key:28s} {value:.1f}" if isinstance(value, float) else f"{key:28s} {value}")
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
