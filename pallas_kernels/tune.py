"""Offline tile profiler: time candidate tile configs on this device, write the winners.

    python -m pallas_kernels.tune [--plan default|quick|serve] [--hidden 4096] [--time-budget 120]
                                  [--table pallas_kernels/tile_table.json] [--log tune_log.json]

For each (op, shape bucket) of the plan (sgmv_shrink / sgmv_expand at prefill sizes,
bgmv_shrink / bgmv_expand at decode batches) it compiles candidate TileConfigs (block rows,
block k / n, rank chunk, k splits, num_warps, num_stages), checks each candidate's output
against a float64 host reference on sampled rows (a wrong candidate never wins), times it on
the device and writes the fastest into the table under
`table[jax.devices()[0].device_kind][op][shape_bucket(rows, in_dim, out_dim)]`, with its
median time ("us") and the heuristic's ("heuristic_us") next to the config fields (the
lookup ignores those). Entries of other devices, ops and buckets are kept.

Search: pass 1 times the heuristic plus a few seed configs per op; pass 2 times the
one-step neighbours (each field one notch up or down) of the pass-1 winner. Candidates are
lowered one by one and compiled in a thread pool (XLA's compile releases the GIL); timings
run afterwards, one at a time, so compilation never overlaps a measurement.

Timing (`measure`): one call runs `steps` back-to-back kernel launches on different input
sets (rotating buffers larger than L2 where it matters) inside one jitted function, and many
such calls are queued before a single block_until_ready; the median over trials of wall time
per step is device-bound when the queue never drains (the host's share of that time is
reported as `host_frac`; near 1 means dispatch-bound).
"""

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import bgmv_gpu, sgmv_gpu
from pallas_kernels.tile_fit import fit_tiles
from pallas_kernels.routing import make_routing
from pallas_kernels.tiles import TABLE_PATH, TileConfig, heuristic_tiles, shape_bucket

OPS = ("sgmv_shrink", "sgmv_expand", "bgmv_shrink", "bgmv_expand")

# Values each field may take, per op (fit_tiles then makes a config legal for the shape).
DOMAINS = {
    "sgmv_shrink": dict(block_rows=(16, 32, 64, 128), block_k=(64, 128, 256, 512),
                        k_splits=(1, 2, 4, 8, 16), rank_chunk=(16, 32, 64),
                        num_warps=(2, 4, 8), num_stages=(1, 2, 3, 4)),
    "sgmv_expand": dict(block_rows=(16, 32, 64, 128), block_n=(64, 128, 256, 512),
                        col_blocks=(1, 2, 4, 8, 16), rank_chunk=(16, 32, 64),
                        num_warps=(2, 4, 8), num_stages=(1, 2, 3)),
    "bgmv_shrink": dict(block_k=(64, 128, 256, 512, 1024), k_splits=(1, 2, 4, 8, 16, 32, 64),
                        rank_chunk=(16, 32, 64), num_warps=(1, 2, 4, 8), num_stages=(1, 2, 3)),
    "bgmv_expand": dict(block_n=(64, 128, 256, 512, 1024, 2048), rank_chunk=(16, 32, 64),
                        num_warps=(1, 2, 4, 8), num_stages=(1, 2)),
}

# Pass-1 seeds beyond the heuristic: (field overrides) per op.
SEEDS = {
    "sgmv_shrink": [
        dict(block_rows=64, block_k=256, k_splits=4, num_warps=4, num_stages=3),
        dict(block_rows=128, block_k=128, k_splits=8, num_warps=8, num_stages=3),
        dict(block_rows=32, block_k=256, k_splits=2, num_warps=4, num_stages=3),
        dict(block_rows=64, block_k=128, k_splits=8, num_warps=4, num_stages=4),
        dict(block_rows=128, block_k=256, k_splits=4, num_warps=8, num_stages=3),
        dict(block_rows=64, block_k=512, k_splits=2, num_warps=8, num_stages=2),
        dict(block_rows=32, block_k=128, k_splits=4, num_warps=4, num_stages=4),
        dict(block_rows=16, block_k=256, k_splits=4, num_warps=4, num_stages=3),
    ],
    "sgmv_expand": [
        dict(block_rows=64, block_n=128, num_warps=4, num_stages=2),
        dict(block_rows=32, block_n=256, num_warps=4, num_stages=2),
        dict(block_rows=64, block_n=256, num_warps=8, num_stages=2),
        dict(block_rows=128, block_n=128, num_warps=8, num_stages=2),
        dict(block_rows=128, block_n=256, num_warps=8, num_stages=1),
        dict(block_rows=32, block_n=128, num_warps=4, num_stages=1),
        dict(block_rows=32, block_n=256, col_blocks=4, num_warps=4, num_stages=2),
        dict(block_rows=64, block_n=128, col_blocks=8, num_warps=4, num_stages=2),
        dict(block_rows=64, block_n=256, col_blocks=4, num_warps=8, num_stages=2),
        dict(block_rows=128, block_n=128, col_blocks=4, num_warps=8, num_stages=2),
    ],
    "bgmv_shrink": [
        dict(block_k=256, k_splits=16, num_warps=4),
        dict(block_k=128, k_splits=32, num_warps=2),
        dict(block_k=512, k_splits=8, num_warps=4),
        dict(block_k=256, k_splits=8, num_warps=4, num_stages=2),
        dict(block_k=128, k_splits=16, num_warps=4),
        dict(block_k=512, k_splits=4, num_warps=8, num_stages=2),
        dict(block_k=1024, k_splits=4, num_warps=8),
        dict(block_k=64, k_splits=64, num_warps=1),
    ],
    "bgmv_expand": [
        dict(block_n=256, num_warps=4),
        dict(block_n=128, num_warps=2),
        dict(block_n=512, num_warps=4),
        dict(block_n=1024, num_warps=8),
        dict(block_n=2048, num_warps=8),
        dict(block_n=64, num_warps=1),
        dict(block_n=512, num_warps=8),
        dict(block_n=256, num_warps=2),
    ],
}


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One tuning target: `op` at (rows, in_dim, out_dim) with pool rank r_max."""

    op: str
    rows: int
    hidden: int
    r_max: int

    @property
    def dims(self) -> tuple[int, int, int]:
        if self.op.endswith("shrink"):
            return self.rows, self.hidden, self.r_max
        return self.rows, self.r_max, self.hidden

    @property
    def key(self) -> str:
        return shape_bucket(*self.dims)


def default_plan(hidden: int = 4096, quick: bool = False) -> list[Bucket]:
    """Buckets in priority order (the time budget cuts from the end)."""
    prefill = [(4096, 16), (4096, 64), (8192, 16), (8192, 64)]
    decode = [64, 16, 32, 1, 8] if not quick else [64, 16]
    plan = []
    for rows, rank in prefill[: 2 if quick else 4]:
        plan += [Bucket("sgmv_shrink", rows, hidden, rank), Bucket("sgmv_expand", rows, hidden,
                                                                   rank)]
        if rows == 4096 and rank == 16:
            for batch in decode[:2]:
                plan += [Bucket("bgmv_shrink", batch, hidden, 16),
                         Bucket("bgmv_expand", batch, hidden, 16)]
    for batch in decode[2:]:
        plan += [Bucket("bgmv_shrink", batch, hidden, 16), Bucket("bgmv_expand", batch, hidden,
                                                                  16)]
    return plan


def serve_plan(rows: int = 64) -> list[Bucket]:
    """The decode (BGMV) shapes of the Llama-3.1-8B serving step that the default plan lacks: the
    down projection's shrink (k = 14336), the k/v (n = 1024) and gate/up (n = 14336) expands."""
    return [Bucket("bgmv_expand", rows, 14336, 16), Bucket("bgmv_shrink", rows, 14336, 16),
            Bucket("bgmv_expand", rows, 1024, 16)]


def legal(bucket: Bucket, cfg: TileConfig) -> TileConfig:
    """The config the dispatcher would run for this bucket (ops.choose_tiles' fitting)."""
    legal_cfg = fit_tiles(cfg, "gpu", *bucket.dims, bucket.r_max)
    if bucket.op.startswith("bgmv"):
        legal_cfg = dataclasses.replace(legal_cfg, block_rows=1)
    if bucket.op != "sgmv_expand":
        legal_cfg = dataclasses.replace(legal_cfg, col_blocks=1)
    if not bucket.op.endswith("shrink"):
        legal_cfg = dataclasses.replace(legal_cfg, k_splits=1)
    return legal_cfg


def seed_candidates(bucket: Bucket) -> list[TileConfig]:
    base = heuristic_tiles(bucket.op, *bucket.dims, "gpu")
    cands = [base] + [dataclasses.replace(base, **seed) for seed in SEEDS[bucket.op]]
    return _dedupe(bucket, cands)


def neighbor_candidates(bucket: Bucket, cfg: TileConfig) -> list[TileConfig]:
    """Each field of DOMAINS[op] moved one notch up or down."""
    cands = []
    for field, values in DOMAINS[bucket.op].items():
        current = getattr(cfg, field)
        below = [v for v in values if v < current]
        above = [v for v in values if v > current]
        for value in (below[-1:] + above[:1]):
            cands.append(dataclasses.replace(cfg, **{field: value}))
    center = legal(bucket, cfg)
    return [c for c in _dedupe(bucket, cands) if c != center]


def _dedupe(bucket: Bucket, cands) -> list[TileConfig]:
    seen, out = set(), []
    for cfg in cands:
        cfg = legal(bucket, cfg)
        if cfg not in seen:
            seen.add(cfg)
            out.append(cfg)
    return out


# ---------------------------------------------------------------------------------- timing


def measure(call, steps: int, *, target_s: float = 0.01, trials: int = 5, warmup: int = 2):
    """(median us per step, host share of wall time) of `call()`, which launches `steps`
    steps and returns something to block on; calls are queued back to back."""
    out = None
    for _ in range(warmup):
        out = call()
    jax.block_until_ready(out)
    start = time.perf_counter()
    jax.block_until_ready(call())
    single = time.perf_counter() - start
    reps = int(min(200, max(2, target_s / max(single, 1e-6))))
    per_step, host = [], []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(reps):
            out = call()
        queued = time.perf_counter()
        jax.block_until_ready(out)
        end = time.perf_counter()
        per_step.append((end - start) / (reps * steps))
        host.append((queued - start) / (end - start))
    return float(np.median(per_step) * 1e6), float(np.median(host))


def compile_all(lowered: list, jobs: int) -> list:
    """Compile `jax.stages.Lowered` objects in a thread pool; an exception stands for a
    failed compile."""
    def one(low):
        try:
            return low.compile()
        except Exception as err:  # noqa: BLE001 - a candidate that does not compile loses
            return err

    if jobs <= 1:
        return [one(low) for low in lowered]
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(one, lowered))


# ------------------------------------------------------------------------------- workloads


def _normal(key, shape, scale, dtype):
    return (jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32) * scale).astype(dtype)


def uniform_segments(rows: int, adapters: int, num_segments: int = 64):
    """(starts [S+1], slots [S]): rows split evenly over slots 0..adapters-1, padded to S
    segments with empty slot -1 ones (one compiled executable serves every layout)."""
    sizes = np.full(adapters, rows // adapters)
    sizes[: rows - sizes.sum()] += 1
    starts = np.full(num_segments + 1, rows, np.int32)
    starts[: adapters + 1] = np.concatenate([[0], np.cumsum(sizes)])
    slots = np.full(num_segments, -1, np.int32)
    slots[:adapters] = np.arange(adapters)
    return starts, slots


def _scales(num):
    return np.linspace(0.5, 2.0, num).astype(np.float32)


def rel_err(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


def _barrier(*values):
    """optimization_barrier: makes a step's inputs depend on the previous step's output, so
    XLA can neither merge repeated steps on the same input set (CSE) nor reorder them."""
    return jax.lax.optimization_barrier(values)


class _Workload:
    """Inputs and a candidate-runner builder for one bucket.

    `build(cfg)` -> (fn, [args per layout]); fn runs `self.steps` kernel launches, chained
    (each step's inputs pass through an optimization barrier with the previous output), over
    `self.sets` input sets `self.reps` times. `check` -> relative error against a float64
    host reference on sampled rows. Off a GPU the kernels run in interpret mode (the CPU test
    of the profiler's plumbing).
    """

    dtype = jnp.bfloat16
    interpret = property(lambda self: jax.default_backend() != "gpu")

    def __init__(self, bucket: Bucket, sets: int, steps: int = 16):
        self.bucket = bucket
        self.sets = sets
        self.reps = max(1, steps // sets)

    @property
    def steps(self) -> int:
        return self.sets * self.reps


class SgmvShrinkWorkload(_Workload):
    LAYOUTS = (4, 64)

    def __init__(self, bucket, sets=4, steps=16):
        super().__init__(bucket, sets, steps)
        rows, hidden, r = bucket.rows, bucket.hidden, bucket.r_max
        self.xs = tuple(_normal(10 + i, (rows, hidden), 1.0, self.dtype) for i in range(sets))
        self.a = _normal(1, (64, hidden, r), hidden ** -0.5, self.dtype)
        self.layouts = [uniform_segments(rows, n) for n in self.LAYOUTS]

    def meta(self, cfg, layout):
        starts, slots = self.layouts[layout]
        ranks = np.full(slots.shape, self.bucket.r_max, np.int32)
        route = make_routing(jnp.asarray(starts), self.bucket.rows, cfg.block_rows)
        return jnp.asarray(starts), jnp.asarray(slots), jnp.asarray(ranks), route

    def build(self, cfg):
        step = jax.jit(lambda x, a, starts, slots, ranks, route: sgmv_gpu.sgmv_shrink_gpu(
            x, a, starts, slots, ranks, route, cfg, self.interpret))

        def run(xs, a, starts, slots, ranks, route):
            outs = [jnp.zeros((), jnp.float32)]
            for _ in range(self.reps):
                for x in xs:
                    x, a_in, _ = _barrier(x, a, outs[-1])
                    outs.append(step(x, a_in, starts, slots, ranks, route))
            return tuple(outs[1:])  # every step's output is live (none is pruned)

        return run, [(self.xs, self.a, *self.meta(cfg, i)) for i in range(len(self.layouts))]

    def check(self, outs, layout):
        starts, slots = self.layouts[layout]
        v = np.asarray(jnp.sum(outs[-1], axis=0))
        rows = np.random.default_rng(0).choice(self.bucket.rows, min(128, self.bucket.rows),
                                               replace=False)
        seg = np.searchsorted(starts, rows, side="right") - 1
        x = np.asarray(self.xs[-1][rows], np.float64)
        a = np.asarray(self.a[slots[seg]], np.float64)
        return rel_err(v[rows], np.einsum("nk,nkr->nr", x, a))


class SgmvExpandWorkload(_Workload):
    LAYOUTS = (4, 64)

    def __init__(self, bucket, sets=1, steps=16, parts=4):
        super().__init__(bucket, 1, steps)
        rows, hidden, r = bucket.rows, bucket.hidden, bucket.r_max
        self.y = _normal(2, (rows, hidden), 1.0, self.dtype)
        self.v = _normal(3, (parts, rows, r), 1.0, jnp.float32)
        self.b = _normal(4, (64, r, hidden), r ** -0.5, self.dtype)
        self.layouts = [uniform_segments(rows, n) for n in self.LAYOUTS]

    def meta(self, cfg, layout):
        starts, slots = self.layouts[layout]
        ranks = np.full(slots.shape, self.bucket.r_max, np.int32)
        scales = _scales(slots.size)
        route = make_routing(jnp.asarray(starts), self.bucket.rows, cfg.block_rows)
        return (jnp.asarray(starts), jnp.asarray(slots), jnp.asarray(ranks),
                jnp.asarray(scales), route)

    def build(self, cfg):
        step = jax.jit(lambda y, v, b, starts, slots, ranks, scales, route:
                       sgmv_gpu.sgmv_expand_gpu(y, v, b, starts, slots, ranks, scales, route,
                                                cfg, self.interpret))

        def run(y, v, b, starts, slots, ranks, scales, route):
            for _ in range(self.steps):
                y, v_in, b_in = _barrier(y, v, b)
                y = step(y, v_in, b_in, starts, slots, ranks, scales, route)
            return y

        return run, [(self.y, self.v, self.b, *self.meta(cfg, i))
                     for i in range(len(self.layouts))]

    def check(self, y0, out, layout):
        starts, slots = self.layouts[layout]
        scales = _scales(slots.size).astype(np.float64)
        rows = np.random.default_rng(0).choice(self.bucket.rows, min(128, self.bucket.rows),
                                               replace=False)
        seg = np.searchsorted(starts, rows, side="right") - 1
        v = np.asarray(self.v, np.float64).sum(0)[rows]
        v = np.asarray(jnp.asarray(v, jnp.float32).astype(self.dtype), np.float64)
        b = np.asarray(self.b[slots[seg]], np.float64)
        delta = self.steps * scales[seg][:, None] * np.einsum("nr,nrm->nm", v, b)
        got = np.asarray(out[rows], np.float64) - np.asarray(y0[rows], np.float64)
        return rel_err(got, delta)


def _decode_sets(bucket: Bucket, sets: int | None) -> int:
    """Input sets to rotate: ~160 MB of pools (more than L2), at most 16."""
    set_bytes = bucket.rows * bucket.hidden * bucket.r_max * 2
    return sets or int(min(16, max(2, math.ceil(160e6 / set_bytes))))


class BgmvShrinkWorkload(_Workload):
    def __init__(self, bucket, sets=None, steps=64):
        rows, hidden, r = bucket.rows, bucket.hidden, bucket.r_max
        super().__init__(bucket, _decode_sets(bucket, sets), steps)
        self.xs = tuple(_normal(20 + i, (rows, hidden), 1.0, self.dtype)
                        for i in range(self.sets))
        self.pools = tuple(_normal(40 + i, (rows, hidden, r), hidden ** -0.5, self.dtype)
                           for i in range(self.sets))
        self.slot = jnp.arange(rows, dtype=jnp.int32)
        self.rank = jnp.full((rows,), r, jnp.int32)

    def build(self, cfg):
        step = jax.jit(lambda x, a, slot, rank: bgmv_gpu.bgmv_shrink_gpu(
            x, a, slot, rank, cfg, self.interpret))

        def run(xs, pools, slot, rank):
            outs = [jnp.zeros((), jnp.float32)]
            for _ in range(self.reps):
                for x, a in zip(xs, pools):
                    x, a, _ = _barrier(x, a, outs[-1])
                    outs.append(step(x, a, slot, rank))
            return tuple(outs[1:])  # every step's output is live (none is pruned)

        return run, [(self.xs, self.pools, self.slot, self.rank)]

    def check(self, outs, layout):
        v = np.asarray(jnp.sum(outs[-1], axis=0), np.float64)
        x, a = np.asarray(self.xs[-1], np.float64), np.asarray(self.pools[-1], np.float64)
        return rel_err(v, np.einsum("nk,nkr->nr", x, a))


class BgmvExpandWorkload(_Workload):
    def __init__(self, bucket, sets=None, steps=64, parts=8):
        rows, hidden, r = bucket.rows, bucket.hidden, bucket.r_max
        super().__init__(bucket, _decode_sets(bucket, sets), steps)
        self.y = _normal(5, (rows, hidden), 1.0, self.dtype)
        self.vs = tuple(_normal(60 + i, (parts, rows, r), 1.0, jnp.float32)
                        for i in range(self.sets))
        self.pools = tuple(_normal(80 + i, (rows, r, hidden), r ** -0.5, self.dtype)
                           for i in range(self.sets))
        self.slot = jnp.arange(rows, dtype=jnp.int32)
        self.rank = jnp.full((rows,), r, jnp.int32)
        self.scale = jnp.linspace(0.5, 2.0, rows, dtype=jnp.float32)

    def build(self, cfg):
        step = jax.jit(lambda y, v, b, slot, rank, scale: bgmv_gpu.bgmv_expand_gpu(
            y, v, b, slot, rank, scale, cfg, self.interpret))

        def run(y, vs, pools, slot, rank, scale):
            for _ in range(self.reps):
                for v, b in zip(vs, pools):
                    y, v, b = _barrier(y, v, b)
                    y = step(y, v, b, slot, rank, scale)
            return y

        return run, [(self.y, self.vs, self.pools, self.slot, self.rank, self.scale)]

    def check(self, y0, out, layout):
        scale = np.asarray(self.scale, np.float64)
        delta = 0
        for v, b in zip(self.vs, self.pools):
            v = np.asarray(jnp.sum(v, 0).astype(self.dtype), np.float64)
            delta = delta + scale[:, None] * np.einsum("nr,nrm->nm", v,
                                                       np.asarray(b, np.float64))
        got = np.asarray(out, np.float64) - np.asarray(y0, np.float64)
        return rel_err(got, self.reps * delta)


WORKLOADS = {"sgmv_shrink": SgmvShrinkWorkload, "sgmv_expand": SgmvExpandWorkload,
             "bgmv_shrink": BgmvShrinkWorkload, "bgmv_expand": BgmvExpandWorkload}
CHAINED = {"sgmv_expand", "bgmv_expand"}
TOLERANCE = 2e-2  # bf16 operands, f32 accumulation


def run_candidates(work, cands: list[TileConfig], jobs: int, log: list,
                   trials: int = 5) -> list[tuple]:
    """Lower, compile (pool), check and time each candidate: [(us, cfg)] of the good ones."""
    bucket = work.bucket
    chained = bucket.op in CHAINED
    lowered, builds = [], []
    for cfg in cands:
        try:
            run, arg_sets = work.build(cfg)
            donate = (0,) if chained else ()
            lowered.append(jax.jit(run, donate_argnums=donate).lower(*arg_sets[0]))
            builds.append(arg_sets)
        except Exception as err:  # noqa: BLE001
            lowered.append(None)
            builds.append(err)
    compiled = compile_all([low for low in lowered if low is not None], jobs)
    compiled_iter = iter(compiled)
    results = []
    for cfg, low, arg_sets in zip(cands, lowered, builds):
        entry = dict(op=bucket.op, bucket=bucket.key, config=dataclasses.asdict(cfg))
        exe = next(compiled_iter) if low is not None else arg_sets
        if isinstance(exe, Exception):
            entry["error"] = f"{type(exe).__name__}: {str(exe)[:300]}"
            log.append(entry)
            continue
        try:
            times, errs, host = [], [], []
            for layout, args in enumerate(arg_sets):
                if chained:
                    y0 = args[0]
                    state = [jnp.array(y0, copy=True)]
                    out = exe(jnp.array(y0, copy=True), *args[1:])
                    errs.append(work.check(y0, out, layout))

                    def call(state=state, rest=args[1:]):
                        state[0] = exe(state[0], *rest)
                        return state[0]
                else:
                    errs.append(work.check(exe(*args), layout))

                    def call(args=args):
                        return exe(*args)
                us, host_frac = measure(call, work.steps, trials=trials)
                times.append(us)
                host.append(host_frac)
            entry.update(us=float(np.sum(times)), per_layout_us=times, rel_err=max(errs),
                         host_frac=max(host))
            if not max(errs) <= TOLERANCE:
                entry["error"] = f"rel err {max(errs):.2e} > {TOLERANCE}"
            else:
                results.append((float(np.sum(times)), cfg))
        except Exception as err:  # noqa: BLE001
            entry["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        log.append(entry)
    return results


def tune_bucket(bucket: Bucket, jobs: int, log: list, deadline: float, *,
                max_candidates: int | None = None, trials: int = 5, sets: int | None = None,
                steps: int | None = None):
    """(best (us, cfg), heuristic us or None) for one bucket."""
    kwargs = {k: v for k, v in dict(sets=sets, steps=steps).items() if v}
    work = WORKLOADS[bucket.op](bucket, **kwargs)
    seeds = seed_candidates(bucket)[:max_candidates]
    results = run_candidates(work, seeds, jobs, log, trials)
    heuristic = legal(bucket, heuristic_tiles(bucket.op, *bucket.dims, "gpu"))
    heuristic_us = next((us for us, cfg in results if cfg == heuristic), None)
    if not results:
        return None, heuristic_us
    best = min(results, key=lambda item: item[0])
    if time.time() < deadline:
        tried = set(seeds)
        neighbors = [c for c in neighbor_candidates(bucket, best[1]) if c not in tried]
        results += run_candidates(work, neighbors[:max_candidates], jobs, log, trials)
        best = min(results, key=lambda item: item[0])
    del work
    return best, heuristic_us


def tune(plan: list[Bucket], table: dict, time_budget: float, jobs: int, log: list,
         on_update=None, **bucket_kw) -> dict:
    """Tune the buckets of `plan` (in order, until the time budget is spent) into `table`
    (`bucket_kw`: max_candidates / trials / sets for `tune_bucket`)."""
    kind = jax.devices()[0].device_kind
    start = time.time()
    deadline = start + time_budget
    for bucket in plan:
        if time.time() > deadline:
            print(f"time budget spent: skipping {bucket.op} {bucket.key}", flush=True)
            continue
        t0 = time.time()
        best, heuristic_us = tune_bucket(bucket, jobs, log, deadline - 0.35 * time_budget,
                                         **bucket_kw)
        if best is None:
            print(f"{bucket.op} {bucket.key}: no candidate ran", flush=True)
            continue
        us, cfg = best
        entry = dataclasses.asdict(cfg) | {"us": round(us, 2)}
        if heuristic_us is not None:
            entry["heuristic_us"] = round(heuristic_us, 2)
        table.setdefault(kind, {}).setdefault(bucket.op, {})[bucket.key] = entry
        print(f"{bucket.op:12s} {bucket.key:16s} best {us:8.1f} us (heuristic "
              f"{heuristic_us if heuristic_us is None else round(heuristic_us, 1)}) "
              f"{_short(cfg)}  [{time.time() - t0:.0f}s]", flush=True)
        if on_update is not None:
            on_update(table)
    return table


def _short(cfg: TileConfig) -> str:
    return (f"rows={cfg.block_rows} k={cfg.block_k} n={cfg.block_n} rc={cfg.rank_chunk} "
            f"ks={cfg.k_splits} w={cfg.num_warps} s={cfg.num_stages}")


def write_table(table: dict, path: pathlib.Path) -> None:
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", choices=("default", "quick", "serve"), default="default")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--time-budget", type=float, default=600.0, help="seconds")
    parser.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1),
                        help="parallel compiles")
    parser.add_argument("--table", type=pathlib.Path, default=TABLE_PATH)
    parser.add_argument("--out", type=pathlib.Path, nargs="*", default=[],
                        help="extra paths to write the table to")
    parser.add_argument("--log", type=pathlib.Path, default=None, help="JSON of every candidate")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        raise SystemExit("the profiler times the Triton kernels: run it on a GPU")
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    text = args.table.read_text() if args.table.exists() else ""
    table = json.loads(text) if text.strip() else {}
    plan = serve_plan() if args.plan == "serve" else default_plan(args.hidden, args.plan == "quick")
    plan = [b for b in plan if b.op in args.ops]
    log: list = []

    def save(table):  # after every bucket: a run cut short keeps what it measured
        for path in [args.table, *args.out]:
            write_table(table, path)
        if args.log:
            args.log.write_text(json.dumps(log, indent=1) + "\n")

    table = tune(plan, table, args.time_budget, args.jobs, log, on_update=save)
    save(table)
    errors = [e for e in log if "error" in e]
    print(f"{len(log)} candidates, {len(errors)} rejected; table written to {args.table}")
    for entry in errors[:5]:
        print("  rejected:", entry["op"], entry["bucket"], entry["config"], entry["error"])


if __name__ == "__main__":
    main()
