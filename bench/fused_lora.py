"""Benchmark of the fused LoRA training kernels (LoRAFusion D/E/I/K/L) against XLA, one run.

For each shape (m, k, n, r), bf16, dropout p = 0.1, scale 2, and 1 and 4 adapters (equal row
shares), it times, device side (warm-up, then `calls` back-to-back calls against one
block_until_ready, median of `samples` such batches):
  base      the frozen base layer: forward y = x @ W, and forward + dX = dY W^T (W frozen)
  xla       the unfused LoRA layer in plain jnp: y = x @ W + s * (dropout(x) @ A) @ B, gradients
            by jax.vjp (multi-adapter: one such LoRA per segment on static slices, concatenated);
            the dropout mask is the same (seed, row, column) hash as the kernels'
  fused     fused_lora_linear_single (1 adapter) / fused_lora_linear (4 adapters), impl "gpu",
            once per GEMM backend of `--gemms` (E and L as Mosaic GPU wgmma kernels, "mosaic",
            and as Triton kernels, "triton"; D, I, K are Triton kernels in both)
  E, L      the two GEMM kernels alone per backend (the case's layout), reported as fractions
            of cuBLAS: x @ W (base fwd) for E and dY @ W^T ("base dX") for L
"fwd" is y; "fwd+bwd" is y plus dX, dA, dB for a random dY. In the same run each fused output
and gradient is checked against the float32 reference (`impl="reference"` on upcast inputs,
highest matmul precision) by relative norm error. A bytes-moved model (which tensors each
variant reads and writes) is printed beside the times. `--sweep` also times each of the five
kernels under candidate block configs on the first shape (one adapter); `--mosaic-sweep` the
Mosaic GPU E and L under MOSAIC_SWEEP configs there.

Run from the repo root: PYTHONPATH=. python3 bench/fused_lora.py [--out DIR] [--sweep]
CPU smoke run (every kernel in interpret mode, tiny shape):
  JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/fused_lora.py --shapes 256x128x128x16 --out /tmp
"""

import argparse
import dataclasses
import datetime
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from pallas_kernels import fused_lora_gpu, fused_lora_mgpu
from pallas_kernels.fused_lora import (
    GEMMS,
    fused_lora_linear,
    fused_lora_linear_single,
    make_layout,
    mosaic_blocks,
)
from pallas_kernels.fused_lora_layout import (
    FusedLoRAConfig,
    default_config,
    dropout_mask,
    identity_tile_layout,
)

SHAPES = [(8192, 4096, 4096, 16), (8192, 8192, 8192, 16), (8192, 4096, 14336, 16),
          (8192, 14336, 4096, 16)]
P_DROP, SCALE, SEED = 0.1, 2.0, 7
BF16 = jnp.bfloat16
INTERPRET = jax.default_backend() != "gpu"  # CPU smoke runs: kernels in interpret mode


def log(*args):
    print(*args, flush=True)


def device_time(fn, *args, samples: int = 5, target_s: float = 0.05):
    """Median us per call: warm up, then batches of back-to-back calls, one sync each (one
    call, one batch in interpret mode: a smoke run, not a timing)."""
    if INTERPRET:
        samples, target_s = 1, 0.0
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    estimate = time.perf_counter() - start
    calls = int(min(50, max(1 if INTERPRET else 3, target_s / max(estimate, 1e-6))))
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times) * 1e6, {"calls": calls, "samples_us":
                                             [round(t * 1e6, 1) for t in times]}


# --- the layers ---------------------------------------------------------------------------------

def xla_lora(x, w, a, b, row0=0):
    keep = dropout_mask(SEED, x.shape[0], x.shape[1], P_DROP, row_offset=row0)
    xhat = jnp.where(keep, x, 0) * jnp.asarray(1.0 / (1.0 - P_DROP), x.dtype)
    return x @ w + (SCALE * ((xhat @ a) @ b)).astype(x.dtype)


def segments(m: int, num: int, rank: int):
    """(bounds, (seg_starts, seg_slot, ranks, scales, drops)): `num` equal row shares."""
    bounds = [m * i // num for i in range(num + 1)]
    meta = (jnp.array(bounds, jnp.int32), jnp.arange(num, dtype=jnp.int32),
            jnp.full((num,), rank, jnp.int32), jnp.full((num,), SCALE, jnp.float32),
            jnp.full((num,), P_DROP, jnp.float32))
    return bounds, meta


def layers(m: int, num: int, rank: int, gemms=GEMMS):
    """(xla, {gemm: fused}, reference) layer functions f(x, w, a, b) -> y for `num` adapters."""
    bounds, meta = segments(m, num, rank)

    if num == 1:
        def xla(x, w, a, b):
            return xla_lora(x, w, a[0], b[0])

        def fused(x, w, a, b, gemm):
            return fused_lora_linear_single(x, w, a[0], b[0], SCALE, P_DROP, SEED, impl="gpu",
                                            gemm=gemm)
    else:
        def xla(x, w, a, b):
            return jnp.concatenate([xla_lora(x[lo:hi], w, a[i], b[i], lo)
                                    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))])

        def fused(x, w, a, b, gemm):
            return fused_lora_linear(x, w, a, b, *meta, SEED, impl="gpu", gemm=gemm)

    def reference(x, w, a, b):
        return fused_lora_linear(x, w, a, b, *meta, SEED, impl="reference")

    return xla, {gemm: functools.partial(fused, gemm=gemm) for gemm in gemms}, reference


def fwd_bwd(layer):
    """(x, w, a, b, dy) -> (y, dX, dA, dB) by jax.vjp (W frozen: no dW)."""
    def run(x, w, a, b, dy):
        y, vjp = jax.vjp(lambda x, a, b: layer(x, w, a, b), x, a, b)
        return (y, *vjp(dy))
    return run


def base_fwd(x, w):
    return x @ w


def base_fwd_dx(x, w, dy):
    y, vjp = jax.vjp(lambda x: x @ w, x)
    return y, vjp(dy)[0]


def base_dx(dy, w):
    """The GEMM L replaces: dY @ W^T (cuBLAS through XLA)."""
    return dy @ w.T


# --- the GEMM kernels E and L alone -------------------------------------------------------------

def gemm_kernels(m, k, n, r, num, gemm, cfg: FusedLoRAConfig):
    """{"E": (fn, args), "L": (fn, args)}: the GEMM kernels of backend `gemm` on the case's
    layout (random S / dS; r <= 16 so the rank block is 16)."""
    x, w, a, b, dy = make_inputs(m, k, n, r, num)
    a = jnp.pad(a, ((0, 0), (0, 0), (0, 16 - r)))
    b = jnp.pad(b, ((0, 0), (0, 16 - r), (0, 0)))
    layout = make_layout(*segments(m, num, r)[1], m, impl="gpu", dtype=BF16, config=cfg,
                         gemm=gemm)
    padded = (layout.num_tiles * layout.block_m, 16)
    s = jax.random.normal(jax.random.PRNGKey(2), padded, BF16)
    ds = jax.random.normal(jax.random.PRNGKey(3), padded, BF16)
    seed = jnp.array([SEED], jnp.int32)
    if gemm == "mosaic":
        mcfg = mosaic_blocks(cfg, k, n)
        interp = fused_lora_mgpu.interpret_params() if INTERPRET else False
        e = functools.partial(fused_lora_mgpu.base_expand_mgpu, cfg=mcfg, interpret=interp)
        l_ = functools.partial(fused_lora_mgpu.grad_x_mgpu, cfg=mcfg, interpret=interp)
    else:
        e = functools.partial(fused_lora_gpu.base_expand_gpu, cfg=cfg, interpret=INTERPRET)
        l_ = functools.partial(fused_lora_gpu.grad_x_gpu, cfg=cfg, interpret=INTERPRET)
    return {"E": (lambda x, w, s, b, lay: e(x, w, s, b, lay), (x, w, s, b, layout)),
            "L": (lambda dy, w, ds, a, lay: l_(dy, w, ds, a, lay, seed), (dy, w, ds, a, layout))}


def mcfg(bn, warps, stages, group=8):
    """A Mosaic GPU E / L config (128-row tiles, 64-deep steps)."""
    return FusedLoRAConfig(block_m=128, block_k=64, block_n=bn, num_warps=warps,
                           num_stages=stages, group_m=group)


# the default (2 compute warpgroups x 128 columns, 3 stages) and 2 stages; 2 warpgroups x 64
# columns with 4 stages; 1 warpgroup x 128 columns with 4 / 3 stages; wider / narrower bands
MOSAIC_SWEEP = [mcfg(256, 8, 3), mcfg(256, 8, 2), mcfg(128, 8, 4), mcfg(128, 4, 4),
                mcfg(128, 4, 3), mcfg(256, 8, 3, 16), mcfg(256, 8, 3, 4)]


def mosaic_sweep(m, k, n, r, cfg: FusedLoRAConfig, base_us):
    """E and L (1 adapter) under each MOSAIC_SWEEP config, as fractions of cuBLAS."""
    rows = []
    for cand in MOSAIC_SWEEP:
        trial = dataclasses.replace(cfg, mosaic=cand)
        try:
            result = gemm_fractions(m, k, n, r, 1, ["mosaic"], trial, base_us)["mosaic"]
        except Exception as error:  # a config that does not compile (shared memory, ...)
            result = f"error: {type(error).__name__}: {str(error)[:200]}"
        row = {"config": dataclasses.asdict(cand), "result": result}
        try:  # the blocks the resolver runs (fewer stages / narrower when cand's do not fit)
            fitted = mosaic_blocks(trial, k, n)
            if fitted != cand:
                row["fitted"] = dataclasses.asdict(fitted)
        except ValueError as error:
            row["fitted"] = f"error: {error}"
        rows.append(row)
        log(f"mosaic sweep bn {cand.block_n} warps {cand.num_warps} stages {cand.num_stages} "
            f"group {cand.group_m}: {result}")
    return rows


def gemm_fractions(m, k, n, r, num, gemms, cfg, base_us):
    """Device time of E and L per backend and as fractions of cuBLAS (base_us: the times of
    x @ W and dY @ W^T)."""
    out = {}
    for gemm in gemms:
        out[gemm] = {}
        for name, (fn, args) in gemm_kernels(m, k, n, r, num, gemm, cfg).items():
            us = device_time(jax.jit(fn), *args)[0]
            cublas = base_us["base_fwd"] if name == "E" else base_us["base_dx"]
            out[gemm][name] = {"us": round(us, 1), "fraction_of_cublas": round(cublas / us, 3)}
    return out


# --- bytes moved (model) ------------------------------------------------------------------------

def bytes_model(m, k, n, r, num, cfg: FusedLoRAConfig):
    """Bytes each variant reads + writes, counting every tensor an op touches once (bf16 = 2,
    float32 partials = 4). The unfused XLA model materialises every op's output (XLA fuses
    some elementwise ops, so it is an upper bound for that variant)."""
    e2, e4 = 2, 4
    mk, kn, mn, mr, kr, rn = m * k, k * n, m * n, m * r, num * k * r, num * r * n
    bm = cfg.block_m
    tiles = m // bm + (0 if num == 1 else num + 1)
    nn_i = n // min(cfg.kernel("grad_s_b").block_n, n)
    segs = 1 if num == 1 else num + 2
    fused_fwd = e2 * (mk + kr + mr) + e2 * (mk + kn + mr + rn + mn)          # D, E
    fused_bwd = (e2 * (mn + mr + rn) + e4 * (nn_i * mr + tiles * r * n)      # I
                 + e4 * (nn_i * mr + tiles * r * n) + e2 * mr + e4 * rn      # dS, dB sums
                 + e2 * (mk + mr) + e4 * 2 * cfg.splits * segs * k * r       # K (+ sum)
                 + e2 * (mn + kn + mr + kr + mk))                           # L
    base_f = e2 * (mk + kn + mn)
    xla_fwd = (base_f + e2 * 2 * mk + e2 * (mk + kr + mr) + e2 * (mr + rn + mn)
               + e2 * 3 * mn)
    xla_bwd = (e2 * (mn + rn + mr) + e2 * (mr + mn + rn) + e2 * (mk + mr + kr)
               + e2 * (mr + kr + mk) + e2 * 2 * mk + e2 * (mn + kn + mk) + e2 * 3 * mk)
    return {"base_fwd": base_f, "base_fwd_dx": 2 * base_f,
            "xla_fwd": xla_fwd, "xla_fwd_bwd": xla_fwd + xla_bwd,
            "fused_fwd": fused_fwd, "fused_fwd_bwd": fused_fwd + fused_bwd}


# --- correctness --------------------------------------------------------------------------------

def rel_errors(got, want):
    def err(g, w):
        g, w = g.astype(jnp.float32), w.astype(jnp.float32)
        return jnp.linalg.norm(g - w) / jnp.linalg.norm(w)
    return [float(err(g, w)) for g, w in zip(got, want)]


# --- one (shape, adapters) case -----------------------------------------------------------------

def make_inputs(m, k, n, r, num, key=0):
    keys = jax.random.split(jax.random.PRNGKey(key), 5)
    x = jax.random.normal(keys[0], (m, k), BF16)
    w = (jax.random.normal(keys[1], (k, n), jnp.float32) / k ** 0.5).astype(BF16)
    a = (jax.random.normal(keys[2], (num, k, r), jnp.float32) / k ** 0.5).astype(BF16)
    b = (jax.random.normal(keys[3], (num, r, n), jnp.float32) / r ** 0.5).astype(BF16)
    dy = jax.random.normal(keys[4], (m, n), BF16)
    return x, w, a, b, dy


def correctness(case, fused_fbs, xla_fb, reference, m, k, n, r, num):
    """Relative errors of each fused backend and of XLA vs the float32 reference (fresh
    inputs, the same jitted functions as timed)."""
    cx, cw, ca, cb, cdy = make_inputs(m, k, n, r, num, key=1)
    with jax.default_matmul_precision("highest"):
        up = [v.astype(jnp.float32) for v in (cx, cw, ca, cb, cdy)]
        want = jax.jit(fwd_bwd(reference))(*up)
    names = ["y", "dx", "da", "db"]
    case["rel_err_xla"] = dict(zip(names, rel_errors(xla_fb(cx, cw, ca, cb, cdy), want)))
    case["rel_err_fused"], case["finite"] = {}, {}
    for gemm, fused_fb in fused_fbs.items():
        got = fused_fb(cx, cw, ca, cb, cdy)
        case["rel_err_fused"][gemm] = dict(zip(names, rel_errors(got, want)))
        case["finite"][gemm] = bool(all(bool(jnp.all(jnp.isfinite(v.astype(jnp.float32))))
                                        for v in got))


def run_case(m, k, n, r, num, cfg, gemms=GEMMS):
    x, w, a, b, dy = make_inputs(m, k, n, r, num)
    xla, fused, reference = layers(m, num, r, gemms)
    case = {"m": m, "k": k, "n": n, "rank": r, "adapters": num, "gemms": list(gemms)}
    fused_fbs = {gemm: jax.jit(fwd_bwd(layer)) for gemm, layer in fused.items()}
    xla_fb = jax.jit(fwd_bwd(xla))
    correctness(case, fused_fbs, xla_fb, reference, m, k, n, r, num)

    times, detail = {}, {}
    timed = [("base_fwd", jax.jit(base_fwd), (x, w)),
             ("base_dx", jax.jit(base_dx), (dy, w)),
             ("base_fwd_dx", jax.jit(base_fwd_dx), (x, w, dy)),
             ("xla_fwd", jax.jit(xla), (x, w, a, b)),
             ("xla_fwd_bwd", xla_fb, (x, w, a, b, dy))]
    for gemm in gemms:
        timed += [(f"fused_{gemm}_fwd", jax.jit(fused[gemm]), (x, w, a, b)),
                  (f"fused_{gemm}_fwd_bwd", fused_fbs[gemm], (x, w, a, b, dy))]
    for name, fn, args in timed:
        times[name], detail[name] = device_time(fn, *args)
    case["us"] = {key: round(v, 1) for key, v in times.items()}
    case["timing"] = detail
    case["gemm_kernels"] = gemm_fractions(m, k, n, r, num, gemms, cfg, times)
    case["bytes"] = bytes_model(m, k, n, r, num, cfg)
    flops = 2 * m * k * n
    case["base_tflops"] = {"fwd": flops / times["base_fwd"] / 1e6,
                           "dx": flops / times["base_dx"] / 1e6,
                           "fwd_dx": 2 * flops / times["base_fwd_dx"] / 1e6}
    case["ratio"] = {gemm: {
        "fused_fwd_bwd_over_base_fwd_dx": times[f"fused_{gemm}_fwd_bwd"] / times["base_fwd_dx"],
        "fused_fwd_over_base_fwd": times[f"fused_{gemm}_fwd"] / times["base_fwd"],
        "xla_over_fused_fwd_bwd": times["xla_fwd_bwd"] / times[f"fused_{gemm}_fwd_bwd"],
        "xla_over_fused_fwd": times["xla_fwd"] / times[f"fused_{gemm}_fwd"],
    } for gemm in gemms}
    return case


# --- per-kernel sweep ---------------------------------------------------------------------------

def kernel_times(m, k, n, r, cfg: FusedLoRAConfig, kernels=("shrink", "base_expand", "grad_s_b",
                                                            "grad_a", "grad_x")):
    """Device time of each kernel (single adapter, identity layout) under `cfg`."""
    x, w, a, b, dy = make_inputs(m, k, n, r, 1)
    layout = identity_tile_layout(m, cfg.block_m, jnp.array([r], jnp.int32),
                                  jnp.full((1,), SCALE, jnp.float32),
                                  jnp.full((1,), P_DROP, jnp.float32))
    seed = jnp.array([SEED], jnp.int32)
    padded = (layout.num_tiles * layout.block_m, 16)  # S / dS in the tile layout (r <= 16)
    s = jax.random.normal(jax.random.PRNGKey(2), padded, BF16)
    ds = jax.random.normal(jax.random.PRNGKey(3), padded, BF16)

    def grad_s_b(dy, s, b, lay):
        parts, dbp = fused_lora_gpu.grad_s_b_gpu(dy, s, b, lay, cfg, INTERPRET)
        return jnp.sum(parts, 0).astype(dy.dtype), jnp.sum(dbp, 0)

    def grad_a(x, ds, lay):
        return jnp.sum(fused_lora_gpu.grad_a_gpu(x, ds, lay, seed, cfg, INTERPRET), 0)

    fns = {
        "shrink": (lambda x, a, lay: fused_lora_gpu.shrink_gpu(x, a, lay, seed, cfg, INTERPRET),
                   (x, a, layout)),
        "base_expand": (lambda x, w, s, b, lay: fused_lora_gpu.base_expand_gpu(
            x, w, s, b, lay, cfg, INTERPRET), (x, w, s, b, layout)),
        "grad_s_b": (grad_s_b, (dy, s, b, layout)),
        "grad_a": (grad_a, (x, ds, layout)),
        "grad_x": (lambda dy, w, ds, a, lay: fused_lora_gpu.grad_x_gpu(
            dy, w, ds, a, lay, seed, cfg, INTERPRET), (dy, w, ds, a, layout)),
    }
    out = {}
    for name in kernels:
        fn, args = fns[name]
        try:
            out[name] = round(device_time(jax.jit(fn), *args, samples=3, target_s=0.02)[0], 1)
        except Exception as error:  # a config that does not compile (shared memory, ...)
            out[name] = f"error: {type(error).__name__}: {str(error)[:200]}"
    return out


def kcfg(bm=None, bk=None, bn=None, warps=4, stages=3):
    return FusedLoRAConfig(block_m=bm or 128, block_k=bk or 64, block_n=bn or 128,
                           num_warps=warps, num_stages=stages)


SWEEP = {
    "base_expand": [kcfg(128, 64, 256, 8, 3), kcfg(128, 64, 256, 8, 4), kcfg(128, 64, 128, 4, 4),
                    kcfg(128, 64, 128, 8, 4), kcfg(128, 128, 128, 8, 3),
                    kcfg(256, 64, 128, 8, 3), kcfg(64, 64, 256, 4, 4), kcfg(128, 128, 256, 8, 2)],
    "grad_x": [kcfg(128, 256, 64, 8, 3), kcfg(128, 256, 64, 8, 4), kcfg(128, 128, 64, 4, 4),
               kcfg(128, 128, 64, 8, 4), kcfg(128, 128, 128, 8, 3), kcfg(256, 128, 64, 8, 3),
               kcfg(64, 256, 64, 4, 4), kcfg(128, 256, 128, 8, 2)],
    "shrink": [kcfg(32, 128, None, 4, 3), kcfg(64, 128, None, 4, 3), kcfg(16, 256, None, 4, 3),
               kcfg(64, 64, None, 4, 4), kcfg(32, 256, None, 4, 2), kcfg(128, 64, None, 4, 3),
               kcfg(64, 256, None, 8, 3)],
    "grad_s_b": [kcfg(64, None, 256, 4, 2), kcfg(32, None, 512, 4, 2), kcfg(64, None, 128, 4, 2),
                 kcfg(128, None, 128, 8, 2), kcfg(16, None, 512, 4, 2), kcfg(64, None, 512, 8, 2)],
    "grad_a": [kcfg(128, 64, None, 4, 3), kcfg(64, 64, None, 4, 3), kcfg(128, 32, None, 4, 3),
               kcfg(128, 128, None, 8, 3), kcfg(64, 128, None, 4, 4)],
}


# around the H100 winners of SWEEP (8 warps, 128 x 128 tiles)
SWEEP_FINE = {
    "base_expand": [kcfg(128, 64, 128, 8, 5), kcfg(128, 32, 128, 8, 6), kcfg(64, 64, 128, 4, 4),
                    kcfg(128, 64, 64, 4, 4)],
    "grad_x": [kcfg(128, 128, 64, 8, 5), kcfg(128, 128, 32, 8, 6), kcfg(64, 128, 64, 4, 4),
               kcfg(128, 64, 64, 4, 4)],
}


def sweep(m, k, n, r, base_cfg: FusedLoRAConfig, table=None):
    rows = []
    for name, candidates in (table or SWEEP).items():
        for cand in candidates:
            layout_bm = max(base_cfg.block_m, cand.block_m)
            cfg = dataclasses.replace(base_cfg, block_m=layout_bm, **{name: cand})
            splits_list = [base_cfg.splits] if name != "grad_a" else [4, 8]
            for splits in splits_list:
                cfg = dataclasses.replace(cfg, splits=splits)
                t = kernel_times(m, k, n, r, cfg, kernels=(name,))[name]
                row = {"kernel": name, "layout_bm": layout_bm, "splits": splits,
                       "config": dataclasses.asdict(cand), "us": t}
                rows.append(row)
                log(f"sweep {name:12s} {cand.block_m:4d} {cand.block_k:4d} {cand.block_n:4d} "
                    f"w{cand.num_warps} s{cand.num_stages} splits {splits}: {t}")
    return rows


# --- report -------------------------------------------------------------------------------------

def markdown(results):
    lines = [f"Device: {results['device']}, jax {results['jax']}, {results['date']}; bf16, "
             f"p = {P_DROP}; median device time per call (us). E / L: the GEMM kernels alone, "
             "as fractions of cuBLAS (x @ W, dY @ W^T).", "",
             "| m, k, n, r | adapters | GEMMs | base fwd | base fwd+dX | XLA LoRA fwd "
             "| XLA fwd+bwd | fused fwd | fused fwd+bwd | fused/base (fwd+bwd) "
             "| XLA/fused (fwd+bwd) | E / cuBLAS | L / cuBLAS | max rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in results["cases"]:
        u = c["us"]
        for gemm in c["gemms"]:
            q, g = c["ratio"][gemm], c["gemm_kernels"][gemm]
            lines.append(
                f"| {c['m']}, {c['k']}, {c['n']}, {c['rank']} | {c['adapters']} | {gemm} "
                f"| {u['base_fwd']:.0f} | {u['base_fwd_dx']:.0f} | {u['xla_fwd']:.0f} "
                f"| {u['xla_fwd_bwd']:.0f} | {u[f'fused_{gemm}_fwd']:.0f} "
                f"| {u[f'fused_{gemm}_fwd_bwd']:.0f} "
                f"| {q['fused_fwd_bwd_over_base_fwd_dx']:.3f} | {q['xla_over_fused_fwd_bwd']:.2f} "
                f"| {g['E']['fraction_of_cublas']:.3f} | {g['L']['fraction_of_cublas']:.3f} "
                f"| {max(c['rel_err_fused'][gemm].values()):.1e} |")
    lines += ["", "Bytes moved (model, MB):", "",
              "| m, k, n, r | adapters | base fwd | base fwd+dX | XLA fwd | XLA fwd+bwd "
              "| fused fwd | fused fwd+bwd |", "|---|---|---|---|---|---|---|---|"]
    for c in results["cases"]:
        by = c["bytes"]
        lines.append(f"| {c['m']}, {c['k']}, {c['n']}, {c['rank']} | {c['adapters']} | "
                     + " | ".join(f"{by[key] / 1e6:.0f}" for key in
                                  ["base_fwd", "base_fwd_dx", "xla_fwd", "xla_fwd_bwd",
                                   "fused_fwd", "fused_fwd_bwd"]) + " |")
    return "\n".join(lines)


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results["cases"]
    gemms = cases[0]["gemms"] if cases else []
    bwd = ["base_fwd_dx", "xla_fwd_bwd"] + [f"fused_{g}_fwd_bwd" for g in gemms]
    fwd = ["base_fwd", "xla_fwd"] + [f"fused_{g}_fwd" for g in gemms]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5), sharey=False)
    for ax, group, title in [(axes[0], bwd, "forward + backward"), (axes[1], fwd, "forward")]:
        width = 0.8 / len(group)
        for i, name in enumerate(group):
            base = "base_fwd_dx" if "bwd" in name or "dx" in name else "base_fwd"
            vals = [c["us"][name] / c["us"][base] for c in cases]
            xs = [j + i * width for j in range(len(cases))]
            ax.bar(xs, vals, width, label=name.replace("_", " "))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
        ax.set_xticklabels([f"{c['m']}x{c['k']}x{c['n']}\n{c['adapters']} ad." for c in cases],
                           fontsize=7)
        ax.axhline(1.0, color="k", lw=0.5)
        ax.set_ylabel("time / frozen base layer")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(f"Fused LoRA vs XLA, {results['device']}, jax {results['jax']}, "
                 f"{results['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--name", default="fused_lora")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--fine", action="store_true", help="sweep SWEEP_FINE, not SWEEP")
    parser.add_argument("--mosaic-sweep", action="store_true",
                        help="time E and L under MOSAIC_SWEEP configs on the first shape")
    parser.add_argument("--shapes", default="all", help="all, indices into SHAPES, or MxKxNxR,...")
    parser.add_argument("--adapters", default="1,4")
    parser.add_argument("--gemms", default=",".join(GEMMS),
                        help="GEMM backends of the fused layer to time (mosaic, triton)")
    parser.add_argument("--budget-s", type=float, default=1e9,
                        help="start no new case after this many seconds")
    parser.add_argument("--plot-only", default=None, help="render the PNG of a results JSON")
    args = parser.parse_args()
    if args.plot_only:
        with open(args.plot_only) as file:
            results = json.load(file)
        print(markdown(results))
        plot(results, args.plot_only.replace(".json", ".png"))
        return
    os.makedirs(args.out, exist_ok=True)
    cfg = default_config("gpu")
    if args.shapes == "all":
        shapes = SHAPES
    elif "x" in args.shapes:  # explicit, e.g. 256x128x128x16 (CPU smoke runs)
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    else:
        shapes = [SHAPES[int(i)] for i in args.shapes.split(",")]
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "dropout": P_DROP, "scale": SCALE, "dtype": "bfloat16",
               "config": dataclasses.asdict(cfg), "cases": []}
    json_path = os.path.join(args.out, f"{args.name}.json")

    def save():
        with open(json_path, "w") as file:
            json.dump(results, file, indent=1)

    log(f"device {results['device']} jax {results['jax']}")
    begin = time.perf_counter()
    for m, k, n, r in shapes:
        for num in [int(v) for v in args.adapters.split(",")]:
            if time.perf_counter() - begin > args.budget_s:
                log(f"skipped {m}x{k}x{n} a{num}: over --budget-s")
                continue
            start = time.perf_counter()
            case = run_case(m, k, n, r, num, cfg, tuple(args.gemms.split(",")))
            results["cases"].append(case)
            save()
            log(f"{m}x{k}x{n} r{r} a{num}: {case['us']} GEMMs {case['gemm_kernels']} "
                f"err {case['rel_err_fused']} ({time.perf_counter() - start:.0f} s)")
    if args.mosaic_sweep:
        m, k, n, r = shapes[0]
        x, w, _, _, dy = make_inputs(m, k, n, r, 1)
        base_us = {"base_fwd": device_time(jax.jit(base_fwd), x, w)[0],
                   "base_dx": device_time(jax.jit(base_dx), dy, w)[0]}
        results["mosaic_sweep"] = {"shape": [m, k, n, r], "base_us": base_us,
                                   "rows": mosaic_sweep(m, k, n, r, cfg, base_us)}
        save()
    if args.sweep:
        m, k, n, r = shapes[0]
        results["kernels_default"] = kernel_times(m, k, n, r, cfg)
        save()
        log("kernels (default config)", results["kernels_default"])
        results["sweep"] = {"shape": [m, k, n, r],
                            "rows": sweep(m, k, n, r, cfg, SWEEP_FINE if args.fine else SWEEP)}
        save()
    try:
        plot(results, json_path.replace(".json", ".png"))
    except Exception as error:  # no matplotlib there: render here with --plot-only
        log("plot failed:", error)
    log(markdown(results))


if __name__ == "__main__":
    sys.exit(main())
