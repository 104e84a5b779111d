"""Paged attention kernel (`pallas_kernels.paged_attention_gpu`) against the engine's gather
baseline, Llama-3.1-8B attention shape, one run.

    PYTHONPATH=. python bench/paged_attention.py [--out bench/results] [--tag h200] [--quick]

Shape: H=32, Hkv=8, Dh=128, bf16, page_size 16, 64 pages (1024 positions) per row, a stacked
cache of 8 layers over 16,448 pages (4.3 GB each for K and V, so the kernels' address arithmetic
runs in 64 bits and the working set is far beyond L2). Steps:
- decode-only, 32 / 64 / 256 rows, context lengths uniform in [8, 1024);
- mixed: 4 prefill chunks of 256 tokens at offsets 0/256/512/768 (chunked prefill) + 64 decode
  rows as above (T = 1088).
Pages are a random permutation of the pool. Paths, per layer:
- kernel: `paged_attention_gpu` reading the stack in place at the layer's offset (the default
  tiles, and a sweep of tiles/splits);
- gather: what `jaxlora.models.paged.paged_decoder_layer` does today: each token's whole block
  table gathered (`k[layer, tables]`, [T, 1024, Hkv, Dh]) and a dense masked softmax.
Timing: each jitted call runs one path over the 8 layers (different pages each, as a model's
layers); `pallas_kernels.tune.measure` queues calls and reports the median wall time per layer;
`bench.timing.kernel_times` adds the device time from a profiler trace where CUPTI answers.
Bytes (the floor): the K/V rows each row must read (its context, per KV head) + q read + out
written; floor time = bytes / 4.0 TB/s (the JAX copy rate measured on the H200), also
reported against the copy bandwidth measured in this run. Correctness: every timed kernel
configuration against the pure-jnp reference on the same step (bf16 bound 1e-2).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.timing import copy_bandwidth, kernel_times  # noqa: E402
from pallas_kernels.paged_attention import paged_attention_reference  # noqa: E402
from pallas_kernels.paged_attention_gpu import PagedBlocks, default_splits, paged_attention_gpu  # noqa: E402
from pallas_kernels.tune import compile_all, measure, rel_err  # noqa: E402

FLOOR_BPS = 4.0e12
BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Shape:
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    pages_per_row: int = 64
    layers: int = 8
    num_pages: int = 16448


@dataclasses.dataclass
class Case:
    name: str
    decode: int
    chunks: tuple = ()  # (tokens, offset) per prefill chunk


CASES = [Case("decode32", 32), Case("decode64", 64), Case("decode256", 256),
         Case("mixed", 64, ((256, 0), (256, 256), (256, 512), (256, 768)))]
QUICK_SHAPE = Shape(heads=8, kv_heads=2, head_dim=32, page_size=16, pages_per_row=8, layers=2, num_pages=160)
QUICK_CASES = [Case("decode8", 8), Case("mixed", 4, ((20, 0), (12, 30)))]


def make_step(case: Case, shape: Shape, seed: int):
    """(q [T, H, Dh], tables [R, P], row_starts [R+1], positions [T], keys per row [R]) with
    the prefill chunks first, then the decode rows; pages a random permutation of the pool."""
    rng = np.random.default_rng(seed)
    span = shape.pages_per_row * shape.page_size
    rows = [(n, off) for n, off in case.chunks] + [(1, int(c) - 1) for c in rng.integers(8, span, case.decode)]
    lengths = [n for n, _ in rows]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    positions = np.concatenate([off + np.arange(n) for n, off in rows]).astype(np.int32)
    keys = np.array([n + off for n, off in rows])
    tables = rng.permutation(shape.num_pages)[:len(rows) * shape.pages_per_row]
    tables = tables.reshape(len(rows), shape.pages_per_row).astype(np.int32)
    q = jax.random.normal(jax.random.key(seed), (int(starts[-1]), shape.heads, shape.head_dim), BF16)
    return q, jnp.asarray(tables), jnp.asarray(starts), jnp.asarray(positions), keys


def step_bytes(q, keys, shape: Shape) -> int:
    kv = int(keys.sum()) * shape.kv_heads * shape.head_dim * 2 * 2  # K and V, bf16
    return kv + 2 * q.size * 2  # q read, out written


def gather_attention(q, k, v, tables, starts, positions, layer: int):
    """The engine's path today (`paged_decoder_layer`): per token its row's whole block table
    gathered from the layer, then `jaxlora.nn.layers.attention`'s dense masked softmax."""
    tokens, heads, head_dim = q.shape
    kv_heads, page_size = k.shape[3], k.shape[2]
    row = jnp.searchsorted(starts, jnp.arange(tokens), side="right") - 1
    token_tables = tables[jnp.clip(row, 0, tables.shape[0] - 1)]
    span = tables.shape[1] * page_size
    keys = k[layer, token_tables].reshape(tokens, span, kv_heads, head_dim)
    values = v[layer, token_tables].reshape(tokens, span, kv_heads, head_dim)
    mask = jnp.arange(span)[None, :] <= positions[:, None]
    grouped = q.reshape(tokens, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("tkgd,tskd->tkgs", grouped, keys, preferred_element_type=jnp.float32) * head_dim**-0.5
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("tkgs,tskd->tkgd", probs, values, preferred_element_type=jnp.float32)
    return out.reshape(tokens, heads, head_dim).astype(q.dtype)


def layers_fn(path, layers: int, blocks=None):
    """jit of one path over every layer of the stack: returns the per-layer outputs."""
    def run(q, k, v, tables, starts, positions):
        if path == "gather":
            return tuple(gather_attention(q, k, v, tables, starts, positions, l) for l in range(layers))
        return tuple(paged_attention_gpu(q, k, v, tables, starts, positions, layer=jnp.int32(l), blocks=blocks,
                                         interpret=jax.default_backend() != "gpu") for l in range(layers))
    return jax.jit(run)


def sweep(case: Case, quick: bool) -> dict:
    """name -> PagedBlocks: the default first, then variants of one choice each."""
    out = {"default": PagedBlocks()}
    if quick:
        out["splits2_kernel_merge"] = PagedBlocks(num_splits=2, block_kv=32, merge="kernel")
        return out
    variants = dict(stages2=dict(num_stages=2), no_prefetch=dict(prefetch_pages=False), kv32=dict(block_kv=32))
    if case.chunks:
        variants |= dict(q8=dict(block_q=8), q32=dict(block_q=32), splits2=dict(num_splits=2))
    else:
        variants |= dict(kernel_merge=dict(merge="kernel"), splits1=dict(num_splits=1), splits2=dict(num_splits=2),
                         splits8=dict(num_splits=8), q16=dict(block_q=16), warps2=dict(num_warps=2))
    return out | {name: PagedBlocks(**kw) for name, kw in variants.items()}


def run_case(case: Case, shape: Shape, k, v, quick: bool, profile: bool) -> dict:
    q, tables, starts, positions, keys = make_step(case, shape, seed=len(case.name))
    args = (q, k, v, tables, starts, positions)
    floor_us = step_bytes(q, keys, shape) / FLOOR_BPS * 1e6
    check_layer = shape.layers - 1
    expected = paged_attention_reference(q, k[check_layer], v[check_layer], tables, starts, positions)
    configs = sweep(case, quick)
    fns = {name: layers_fn("kernel", shape.layers, blocks) for name, blocks in configs.items()}
    fns["gather"] = layers_fn("gather", shape.layers)
    lowered = {}
    for name, fn in fns.items():
        try:
            lowered[name] = fn.lower(*args)
        except Exception as err:  # noqa: BLE001 - a configuration that does not lower is reported
            lowered[name] = err
    ok = [name for name, low in lowered.items() if not isinstance(low, Exception)]
    compiled = dict(lowered) | dict(zip(ok, compile_all([lowered[name] for name in ok], jobs=8)))
    result = dict(case=case.name, tokens=int(q.shape[0]), rows=int(tables.shape[0]), mean_keys=float(keys.mean()),
                  bytes=step_bytes(q, keys, shape), floor_us=floor_us,
                  default_splits=default_splits(q.shape[0], tables.shape[0], shape.kv_heads,
                                                shape.pages_per_row * shape.page_size, PagedBlocks().block_kv),
                  paths={})
    for name, exe in compiled.items():
        if isinstance(exe, Exception):
            result["paths"][name] = dict(error=f"{type(exe).__name__}: {str(exe)[:400]}")
            print(f"  {case.name} {name}: compile failed: {str(exe)[:300]}", flush=True)
            continue
        outs = exe(*args)
        err = rel_err(np.asarray(outs[check_layer], np.float32), np.asarray(expected, np.float32))
        us, host = measure(lambda: exe(*args), shape.layers, target_s=0.02)
        entry = dict(us=us, host_frac=host, rel_err=err, floor_frac=floor_us / us,
                     config=dataclasses.asdict(configs[name]) if name in configs else None)
        if profile:
            with tempfile.TemporaryDirectory() as log_dir:
                try:
                    prof = kernel_times(lambda: exe(*args), 5, log_dir)
                    entry["device_us"] = prof["device_ms"] * 1e3 / shape.layers
                    entry["kernels"] = prof["kernels"]
                except Exception as err_:  # noqa: BLE001 - no CUPTI: wall time only
                    entry["profile_error"] = str(err_)[:200]
        result["paths"][name] = entry
        print(f"  {case.name:9s} {name:18s} {us:9.1f} us/layer  floor {floor_us:7.1f} us ({floor_us / us:5.2f})"
              f"  err {err:.1e}" + (f"  device {entry['device_us']:.1f} us" if entry.get("device_us") else ""),
              flush=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results"))
    parser.add_argument("--tag", default=None)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke test in interpret mode)")
    parser.add_argument("--cases", nargs="*", default=None)
    args = parser.parse_args()
    device = jax.devices()[0]
    words = device.device_kind.lower().split()
    tag = args.tag or (words[1] if len(words) > 1 else words[0])
    shape, cases = (QUICK_SHAPE, QUICK_CASES) if args.quick else (Shape(), CASES)
    cases = [c for c in cases if args.cases is None or c.name in args.cases]
    print(f"{device.device_kind} | jax {jax.__version__} | backend {jax.default_backend()}", flush=True)
    bandwidth = copy_bandwidth(1 << 24 if args.quick else 1 << 30)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)", flush=True)
    pool = (shape.layers, shape.num_pages, shape.page_size, shape.kv_heads, shape.head_dim)
    k = jax.random.normal(jax.random.key(1), pool, BF16)
    v = jax.random.normal(jax.random.key(2), pool, BF16)
    report = dict(device=device.device_kind, jax=jax.__version__, date=datetime.date.today().isoformat(),
                  shape=dataclasses.asdict(shape), copy_GBps=bandwidth / 1e9, floor_GBps=FLOOR_BPS / 1e9,
                  timing="median wall time per layer of queued 8-layer calls (tune.measure); device_us from a "
                         "profiler trace where available", cases=[])
    for case in cases:
        report["cases"].append(run_case(case, shape, k, v, args.quick, profile=not args.quick))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"paged_attention_{tag}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"\n{device.device_kind} | jax {jax.__version__} | {report['date']} | copy {bandwidth / 1e9:.0f} GB/s | "
          f"us per layer (wall: queued calls; device: profiler, kernels + merge); floor = bytes / "
          f"{FLOOR_BPS / 1e12:.1f} TB/s; frac = floor / device")
    print(f"{'case':10s} {'rows':>5s} {'T':>5s} {'MB':>7s} {'floor':>7s} {'wall':>7s} {'device':>7s} {'frac':>5s} "
          f"{'best dev':>8s} {'(config)':16s} {'gather':>8s} {'x':>5s}")
    for res in report["cases"]:
        paths = res["paths"]
        dev = lambda n: paths.get(n, {}).get("device_us") or paths.get(n, {}).get("us", float("nan"))
        timed = [n for n, p in paths.items() if "us" in p and n != "gather"]
        best = min(timed, key=dev) if timed else None
        kern = dev("default")
        print(f"{res['case']:10s} {res['rows']:5d} {res['tokens']:5d} {res['bytes'] / 1e6:7.1f} {res['floor_us']:7.1f} "
              f"{paths.get('default', {}).get('us', float('nan')):7.1f} {kern:7.1f} {res['floor_us'] / kern:5.2f} "
              f"{dev(best):8.1f} {str(best):16s} {dev('gather'):8.1f} {dev('gather') / kern:5.1f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
