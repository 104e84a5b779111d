"""Time the SGMV (prefill) and BGMV (decode) kernels against XLA baselines.

    python bench/sgmv.py [--rows 4096] [--hidden 4096] [--rank 16] [--adapters 4 64]

SGMV: shrink + expand, T rows split evenly over the adapters, against `lax.ragged_dot` (the
XLA grouped matmul). BGMV: one row per request (batch 256), each its own adapter, against a
gather + einsum. Prints one line per case (median microseconds over --iters runs). Pools and metadata are jit
arguments (not constants), so XLA cannot constant-fold the baselines.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk


def _median_us(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e6)


def _pool(num_slots, hidden, rank, dtype):
    ka, kb = jax.random.split(jax.random.PRNGKey(1))
    lora_a = (jax.random.normal(ka, (num_slots, hidden, rank)) / hidden**0.5).astype(dtype)
    lora_b = (jax.random.normal(kb, (num_slots, rank, hidden)) / rank**0.5).astype(dtype)
    return lora_a, lora_b


def bench_sgmv(rows, hidden, rank, adapters, iters, dtype=jnp.bfloat16):
    x = jax.random.normal(jax.random.PRNGKey(0), (rows, hidden)).astype(dtype)
    lora_a, lora_b = _pool(adapters, hidden, rank, dtype)
    sizes = np.full(adapters, rows // adapters)
    sizes[-1] += rows - sizes.sum()
    starts = jnp.asarray(np.concatenate([[0], np.cumsum(sizes)]), jnp.int32)
    slots = jnp.arange(adapters, dtype=jnp.int32)
    ranks = jnp.full((adapters,), rank, jnp.int32)
    scales = jnp.ones((adapters,), jnp.float32)
    y = jnp.zeros((rows, hidden), dtype)

    group_sizes = jnp.asarray(sizes, jnp.int32)

    @jax.jit
    def kernels(x, y, lora_a, lora_b, starts, slots, ranks, scales):
        v = pk.sgmv_shrink(x, lora_a, starts, slots, ranks)
        return pk.sgmv_expand(y, v, lora_b, starts, slots, ranks, scales)

    @jax.jit
    def ragged(x, y, lora_a, lora_b, group_sizes):
        v = jax.lax.ragged_dot(x, lora_a, group_sizes).astype(dtype)
        return y + jax.lax.ragged_dot(v, lora_b, group_sizes).astype(dtype)

    kernel_args = (x, y, lora_a, lora_b, starts, slots, ranks, scales)
    ragged_args = (x, y, lora_a, lora_b, group_sizes)
    expected = ragged(*ragged_args).astype(jnp.float32)
    err = jnp.linalg.norm(kernels(*kernel_args).astype(jnp.float32) - expected)
    err = float(err / jnp.linalg.norm(expected))
    print(f"sgmv T={rows} h={hidden} r={rank} adapters={adapters}: "
          f"kernels {_median_us(kernels, *kernel_args, iters=iters):.0f} us, "
          f"ragged_dot {_median_us(ragged, *ragged_args, iters=iters):.0f} us, rel diff {err:.1e}")


def bench_bgmv(batch, hidden, rank, iters, dtype=jnp.bfloat16):
    x = jax.random.normal(jax.random.PRNGKey(0), (batch, hidden)).astype(dtype)
    lora_a, lora_b = _pool(batch, hidden, rank, dtype)
    row_slot = jnp.arange(batch, dtype=jnp.int32)
    row_rank = jnp.full((batch,), rank, jnp.int32)
    row_scale = jnp.ones((batch,), jnp.float32)
    y = jnp.zeros((batch, hidden), dtype)

    @jax.jit
    def kernels(x, y, lora_a, lora_b, row_slot, row_rank, row_scale):
        v = pk.bgmv_shrink(x, lora_a, row_slot, row_rank)
        return pk.bgmv_expand(y, v, lora_b, row_slot, row_rank, row_scale)

    @jax.jit
    def gather(x, y, lora_a, lora_b, row_slot):
        v = jnp.einsum("bk,bkr->br", x, lora_a[row_slot]).astype(dtype)
        return y + jnp.einsum("br,brn->bn", v, lora_b[row_slot]).astype(dtype)

    args = (x, y, lora_a, lora_b, row_slot)
    print(f"bgmv B={batch} h={hidden} r={rank} (distinct adapters): "
          f"kernels {_median_us(kernels, *args, row_rank, row_scale, iters=iters):.0f} us, "
          f"gather+einsum {_median_us(gather, *args, iters=iters):.0f} us")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, nargs="+", default=[4, 64])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    print(jax.devices()[0].device_kind, jax.__version__)
    for adapters in args.adapters:
        bench_sgmv(args.rows, args.hidden, args.rank, adapters, args.iters)
    bench_bgmv(args.batch, args.hidden, args.rank, args.iters)


if __name__ == "__main__":
    main()
