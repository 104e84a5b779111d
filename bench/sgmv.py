"""SGMV (prefill) and BGMV (decode) Pallas kernels against the XLA LoRA backends, one run.

    PYTHONPATH=. python bench/sgmv.py [--out bench/results] [--tag h100] [--quick]

Workloads (docs/architecture.md, "Benchmark workloads"), h = 4096, bf16 activations and pools:
- decode (BGMV, `pk.bgmv_lora`): batch 1..64, r = 16, Punica's popularity cases: Distinct (one
  adapter per request), Uniform (ceil(sqrt(B)) adapters), Skewed (Zipf 1.5), Identical (one);
- prefill (SGMV, `pk.sgmv_lora`): T = 4096 and 8192, r = 16 and 64, 4 and 64 adapters (equal
  segments), and a mixed-rank case (16 adapters of ranks 8/16/32/64 in an r_max = 64 pool).
The adapter pool holds exactly the adapters of the batch; rows are grouped by adapter (the
scheduler's order), so no baseline pays for a permutation.

Paths, all computing y += scale * (x @ A[slot]) @ B[slot] with bf16 operands and f32
accumulation (v rounded to bf16 between the two products, as the kernels do):
- pallas: the GPU kernels (split-K shrink partials fed to the in-place expand; the routing
  tables are built once per batch, outside the timed step, as a model does for its layers);
- ragged_dot: `lax.ragged_dot` twice (group sizes per pool slot);
- gather: gather each row's A/B, then batched einsums (jaxlora's "gather" backend);
- onehot: x against every pool slot, then a one-hot selection (jaxlora's "onehot");
- loop: one masked dense product per pool slot (jaxlora's "loop").
These re-implement `jaxlora.lora.ops`' backends on already-grouped rows, without the
library's row permutation and f32 up-casts: the best case for XLA.

Timing (`pallas_kernels.tune.measure`): each jitted call chains `steps` updates of y (donated,
so the kernels update it in place) over different input sets (x, A, B rotate, so the pools
are not served from L2 where they exceed it), many calls are queued before one
block_until_ready, and the median over trials of wall time per step is reported; host_frac
near 1 would mean the numbers are dispatch-bound. HBM floor = bytes / the device-to-device
copy bandwidth measured in the same run, bytes = x read + A/B read for the adapters used (at
their ranks) + y read and written. Prints a table, writes sgmv_<tag>.json and sgmv_<tag>.png.
"""

import argparse
import dataclasses
import datetime
import json
import math
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from bench.timing import copy_bandwidth  # noqa: E402
from pallas_kernels.tune import compile_all, measure, rel_err  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
PATHS = ("pallas", "ragged_dot", "gather", "onehot", "loop")
XLA_PATHS = PATHS[1:]


@dataclasses.dataclass
class Case:
    name: str
    kind: str  # "prefill" | "decode"
    rows: int
    hidden: int
    r_max: int
    row_slot: np.ndarray  # [rows] int32, sorted (grouped by adapter)
    slot_rank: np.ndarray  # [pool] int32
    sets: int  # input sets (x, A, B) rotated through
    reps: int  # times a jitted call goes over them (steps per call = sets * reps)
    popularity: str = ""

    @property
    def pool(self) -> int:
        return int(self.slot_rank.size)

    @property
    def slot_scale(self) -> np.ndarray:
        return np.linspace(0.5, 2.0, self.pool).astype(np.float32)

    def floor_bytes(self) -> int:
        used = np.unique(self.row_slot)
        ab = sum(2 * self.hidden * int(self.slot_rank[s]) * 2 for s in used)
        return self.rows * self.hidden * 2 + 2 * self.rows * self.hidden * 2 + ab

    def schedule(self, path: str) -> tuple[int, int]:
        """(sets, reps) of one jitted call of `path`: fewer for the slow XLA paths (their
        steps take milliseconds, and a per-slot loop unrolls into many dots)."""
        if path == "loop":
            return max(1, min(self.sets, 16 // self.pool)), 1
        if path == "gather" and self.kind == "prefill":
            return self.sets, 1
        return self.sets, self.reps

    def params(self) -> dict:
        return dict(kind=self.kind, rows=self.rows, hidden=self.hidden, r_max=self.r_max,
                    adapters=int(np.unique(self.row_slot).size), popularity=self.popularity,
                    ranks=sorted(set(int(r) for r in self.slot_rank)))


def prefill_case(rows, rank, adapters, hidden=4096, ranks=None, name=None) -> Case:
    sizes = np.full(adapters, rows // adapters)
    sizes[: rows - sizes.sum()] += 1
    slot_rank = np.asarray(ranks if ranks is not None else [rank] * adapters, np.int32)
    return Case(name or f"prefill T={rows} r={rank} n={adapters}", "prefill", rows, hidden,
                int(slot_rank.max()), np.repeat(np.arange(adapters, dtype=np.int32), sizes),
                slot_rank, sets=4, reps=4)


def decode_case(batch, popularity, hidden=4096, rank=16, seed=0) -> Case:
    rng = np.random.default_rng(seed + batch)
    if popularity == "distinct":
        slots = np.arange(batch)
    elif popularity == "uniform":
        slots = np.arange(batch) % math.ceil(math.sqrt(batch))
    elif popularity == "skewed":
        p = np.arange(1, batch + 1, dtype=np.float64) ** -1.5
        draws = rng.choice(batch, batch, p=p / p.sum())
        labels, counts = np.unique(draws, return_counts=True)
        relabel = {int(lab): i for i, lab in enumerate(labels[np.argsort(-counts,
                                                                         kind="stable")])}
        slots = np.array([relabel[int(d)] for d in draws])
    elif popularity == "identical":
        slots = np.zeros(batch, int)
    else:
        raise ValueError(popularity)
    slots = np.sort(slots).astype(np.int32)
    pool = int(slots.max()) + 1
    return Case(f"decode B={batch} {popularity}", "decode", batch, hidden, rank, slots,
                np.full(pool, rank, np.int32), sets=8, reps=8, popularity=popularity)


def default_cases(quick: bool = False) -> list[Case]:
    """All cases, in priority order (a run cut short keeps the targets' cases)."""
    cases = [prefill_case(4096, 16, 4), prefill_case(4096, 16, 64),
             decode_case(64, "distinct"), decode_case(32, "distinct"),
             prefill_case(8192, 16, 4), prefill_case(8192, 16, 64)]
    if quick:
        return cases
    cases += [prefill_case(4096, 64, 4), prefill_case(4096, 64, 64),
              prefill_case(8192, 64, 4), prefill_case(8192, 64, 64),
              prefill_case(4096, 64, 16, ranks=[8, 16, 32, 64] * 4,
                           name="prefill T=4096 mixed r=8..64 n=16"),
              decode_case(16, "distinct")]
    for batch in (64, 32, 16):
        for pop in ("uniform", "skewed", "identical"):
            cases.append(decode_case(batch, pop))
    one = decode_case(1, "distinct")
    one.name, one.popularity = "decode B=1 (one adapter)", "all"
    cases.append(one)
    return cases


def smoke_cases() -> list[Case]:
    cases = [prefill_case(64, 16, 4, hidden=64),
             prefill_case(64, 32, 4, hidden=64, ranks=[8, 16, 32, 16], name="prefill mixed")]
    for pop in ("distinct", "uniform", "skewed", "identical"):
        cases.append(decode_case(8, pop, hidden=64))
    for case in cases:
        case.sets, case.reps = 2, 2
    return cases


# ------------------------------------------------------------------------------ the paths


def _update(y, delta):
    return (y.astype(F32) + delta).astype(y.dtype)


def _ragged(y, x, a, b, meta):
    v = jax.lax.ragged_dot(x, a, meta["group_sizes"], preferred_element_type=F32)
    v = (v * meta["row_scale"][:, None]).astype(x.dtype)
    return _update(y, jax.lax.ragged_dot(v, b, meta["group_sizes"], preferred_element_type=F32))


def _gather(y, x, a, b, meta):
    slot = jnp.maximum(meta["row_slot"], 0)
    v = jnp.einsum("nk,nkr->nr", x, a[slot], preferred_element_type=F32)
    v = (v * meta["row_scale"][:, None]).astype(x.dtype)
    return _update(y, jnp.einsum("nr,nrm->nm", v, b[slot], preferred_element_type=F32))


def _onehot(y, x, a, b, meta):
    select = (meta["row_slot"][:, None] == jnp.arange(a.shape[0])).astype(F32)
    select = select * meta["row_scale"][:, None]
    v_all = jnp.einsum("nk,skr->nsr", x, a, preferred_element_type=F32)
    v_all = (v_all * select[:, :, None]).astype(x.dtype)
    return _update(y, jnp.einsum("nsr,srm->nm", v_all, b, preferred_element_type=F32))


def _loop(y, x, a, b, meta):
    delta = jnp.zeros(y.shape, F32)
    for slot in range(a.shape[0]):
        v = jnp.dot(x, a[slot], preferred_element_type=F32).astype(x.dtype)
        e = jnp.dot(v, b[slot], preferred_element_type=F32)
        mask = (meta["row_slot"] == slot)[:, None]
        delta = delta + jnp.where(mask, meta["row_scale"][:, None] * e, 0.0)
    return _update(y, delta)


STEP_KW = {}


def _pallas(y, x, a, b, meta):
    if "routing" in meta:
        return pk.sgmv_lora(y, x, a, b, meta["seg_starts"], meta["seg_slot"], meta["seg_rank"],
                            meta["seg_scale"], routing=meta["routing"], **STEP_KW)
    return pk.bgmv_lora(y, x, a, b, meta["row_slot"], meta["row_rank"], meta["row_scale"],
                        **STEP_KW)


STEPS = {"pallas": _pallas, "ragged_dot": _ragged, "gather": _gather, "onehot": _onehot,
         "loop": _loop}


def make_run(path: str, num_sets: int, reps: int):
    step = jax.jit(STEPS[path])

    def run(y, sets, meta):
        for _ in range(reps):
            for x, a, b in sets[:num_sets]:
                # each step's inputs depend on the previous y: XLA can neither merge the
                # repeated steps on one input set (CSE) nor fuse across steps.
                y, x, a, b = jax.lax.optimization_barrier((y, x, a, b))
                y = step(y, x, a, b, meta)
        return y

    return jax.jit(run, donate_argnums=0)


def metadata(case: Case) -> dict:
    slots = case.row_slot
    ranks, scales = case.slot_rank, case.slot_scale
    meta = dict(row_slot=jnp.asarray(slots), row_rank=jnp.asarray(ranks[slots]),
                row_scale=jnp.asarray(scales[slots]),
                group_sizes=jnp.asarray(np.bincount(slots, minlength=case.pool).astype(np.int32)))
    if case.kind == "prefill":
        seg_slot = np.unique(slots).astype(np.int32)
        starts = np.searchsorted(slots, np.r_[seg_slot, case.pool]).astype(np.int32)
        meta.update(seg_starts=jnp.asarray(starts), seg_slot=jnp.asarray(seg_slot),
                    seg_rank=jnp.asarray(ranks[seg_slot]), seg_scale=jnp.asarray(scales[seg_slot]))
        meta["routing"] = pk.sgmv_lora_routing(meta["seg_starts"], case.rows, case.hidden,
                                               case.hidden, case.r_max, **STEP_KW)
    return meta


def make_sets(case: Case, seed: int = 0):
    """`case.sets` input sets (x, A, B); pool columns/rows beyond a slot's rank are zero."""
    live = np.arange(case.r_max)[None, :] < case.slot_rank[:, None]  # [pool, r]
    sets = []
    for i in range(case.sets):
        kx, ka, kb = jax.random.split(jax.random.PRNGKey(seed * 1000 + i), 3)
        x = jax.random.normal(kx, (case.rows, case.hidden), F32).astype(BF16)
        a = jax.random.normal(ka, (case.pool, case.hidden, case.r_max), F32) * case.hidden ** -0.5
        b = jax.random.normal(kb, (case.pool, case.r_max, case.hidden), F32) * case.r_max ** -0.5
        a = jnp.where(jnp.asarray(live)[:, None, :], a, 0).astype(BF16)
        b = jnp.where(jnp.asarray(live)[:, :, None], b, 0).astype(BF16)
        sets.append((x, a, b))
    return tuple(sets)


def spec_sets(case: Case):
    x = jax.ShapeDtypeStruct((case.rows, case.hidden), BF16)
    a = jax.ShapeDtypeStruct((case.pool, case.hidden, case.r_max), BF16)
    b = jax.ShapeDtypeStruct((case.pool, case.r_max, case.hidden), BF16)
    return tuple((x, a, b) for _ in range(case.sets))


def reference_delta(case: Case, sets, steps: int, rows: np.ndarray) -> np.ndarray:
    """float64 sum over the first `steps` sets of scale * (x @ A) @ B on the given rows
    (one pass: multiply by the reps)."""
    slots = case.row_slot[rows]
    scale = case.slot_scale.astype(np.float64)[slots]
    total = np.zeros((rows.size, case.hidden))
    for x, a, b in sets[:steps]:
        xr = np.asarray(x[jnp.asarray(rows)], np.float64)
        used = np.unique(slots)
        a_np = {int(s): np.asarray(a[int(s)], np.float64) for s in used}
        b_np = {int(s): np.asarray(b[int(s)], np.float64) for s in used}
        for i, s in enumerate(slots):
            total[i] += scale[i] * (xr[i] @ a_np[int(s)]) @ b_np[int(s)]
    return total


def null_call_us(case: Case) -> float:
    """Host time per call of an executable with a pallas run's arguments and no device work:
    the per-call dispatch cost that the steps of one call share."""
    run = jax.jit(lambda y, sets, meta: y, donate_argnums=0)
    sets, meta = make_sets(case), metadata(case)
    state = [jnp.zeros((case.rows, case.hidden), BF16)]

    def call():
        state[0] = run(state[0], sets, meta)
        return state[0]

    us, _ = measure(call, 1, target_s=0.02)
    return us


# ---------------------------------------------------------------------------------- driver


def run_case(case: Case, compiled: dict, bandwidth: float) -> dict:
    meta = metadata(case)
    sets = make_sets(case)
    y0 = jax.random.normal(jax.random.PRNGKey(7), (case.rows, case.hidden), F32).astype(BF16)
    sample = np.sort(np.random.default_rng(0).choice(case.rows, min(case.rows, 64),
                                                     replace=False))
    refs = {}
    floor_bytes = case.floor_bytes()
    floor_us = floor_bytes / bandwidth * 1e6
    out = dict(name=case.name, params=case.params(), floor_bytes=floor_bytes,
               floor_us=floor_us, results={})
    if case.kind == "prefill":
        shrink_cfg, expand_cfg = pk.sgmv_lora_tiles(case.rows, case.hidden, case.hidden,
                                                    case.r_max)
        out["tiles"] = dict(shrink=dataclasses.asdict(shrink_cfg),
                            expand=dataclasses.asdict(expand_cfg))
    for path in PATHS:
        exe = compiled.get(path)
        res = {}
        if exe is None or isinstance(exe, Exception):
            res["error"] = "not compiled" if exe is None else f"{type(exe).__name__}: " \
                f"{str(exe)[:400]}"
            out["results"][path] = res
            continue
        num_sets, reps = case.schedule(path)
        steps = num_sets * reps
        try:
            got = exe(jnp.array(y0, copy=True), sets, meta)
            if num_sets not in refs:
                refs[num_sets] = reference_delta(case, sets, num_sets, sample)
            diff = np.asarray(got[jnp.asarray(sample)], np.float64) - np.asarray(
                y0[jnp.asarray(sample)], np.float64)
            res["rel_err"] = rel_err(diff, reps * refs[num_sets])
            state = [jnp.array(y0, copy=True)]

            def call(state=state):
                state[0] = exe(state[0], sets, meta)
                return state[0]

            us, host = measure(call, steps, target_s=0.02)
            res.update(us=us, host_frac=host, steps=steps, GBps=floor_bytes / (us * 1e-6) / 1e9,
                       frac_floor=floor_us / us)
            del state, got
        except Exception as err:  # noqa: BLE001
            res["error"] = f"{type(err).__name__}: {str(err)[:400]}"
        out["results"][path] = res
    xla = {p: r["us"] for p, r in out["results"].items() if p in XLA_PATHS and "us" in r}
    if xla:
        best = min(xla, key=xla.get)
        out["best_xla"] = dict(path=best, us=xla[best])
        if "us" in out["results"]["pallas"]:
            out["speedup_vs_best_xla"] = xla[best] / out["results"]["pallas"]["us"]
    del sets
    return out


def _fmt(res: dict) -> str:
    if "us" not in res:
        return "err"
    flag = "!" if res.get("rel_err", 0) > 2e-2 else ""
    return f"{res['us']:.1f}{flag}"


def table_lines(results: list) -> list[str]:
    head = (f"{'case':36s} {'floor':>7s} {'pallas':>8s} {'GB/s':>6s} {'%floor':>6s} "
            + " ".join(f"{p:>10s}" for p in XLA_PATHS) + f" {'best XLA':>10s} {'speedup':>7s}")
    lines = [head, "-" * len(head)]
    for out in results:
        pal = out["results"].get("pallas", {})
        cells = " ".join(f"{_fmt(out['results'].get(p, {})):>10s}" for p in XLA_PATHS)
        best = out.get("best_xla", {}).get("path", "-")
        speed = out.get("speedup_vs_best_xla")
        lines.append(
            f"{out['name']:36s} {out['floor_us']:7.1f} {_fmt(pal):>8s} "
            f"{pal.get('GBps', 0):6.0f} {100 * pal.get('frac_floor', 0):5.0f}% {cells} "
            f"{best:>10s} {('%.1fx' % speed) if speed else '-':>7s}")
    return lines


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["cases"]
    fig, (ax_d, ax_p) = plt.subplots(1, 2, figsize=(15, 5.5))
    decode = [r for r in results if r["params"]["kind"] == "decode"]
    pops = ("distinct", "uniform", "skewed", "identical")
    colors = dict(zip(pops, ("C0", "C1", "C2", "C3")))
    one = [r for r in decode if r["params"]["popularity"] == "all"]
    for pop in pops:
        rows = sorted(one + [r for r in decode if r["params"]["popularity"] == pop],
                      key=lambda r: r["params"]["rows"])
        rows = [r for r in rows if "us" in r["results"].get("pallas", {}) and "best_xla" in r]
        if not rows:
            continue
        batch = [r["params"]["rows"] for r in rows]
        ax_d.plot(batch, [r["results"]["pallas"]["us"] for r in rows], "o-",
                  color=colors[pop], label=f"pallas {pop}")
        ax_d.plot(batch, [r["best_xla"]["us"] for r in rows], "x--", color=colors[pop],
                  label=f"best XLA {pop}")
        ax_d.plot(batch, [r["floor_us"] for r in rows], ":", color=colors[pop], alpha=0.5)
    ax_d.set(xscale="log", yscale="log", xlabel="decode batch", ylabel="us per LoRA layer",
             title="BGMV decode, h=4096, r=16 (dotted: HBM floor)")
    ax_d.legend(fontsize=7)
    prefill = [r for r in results if r["params"]["kind"] == "prefill"]
    width = 0.8 / (len(PATHS) + 1)
    for i, path_name in enumerate(PATHS):
        vals = [r["results"].get(path_name, {}).get("us", np.nan) for r in prefill]
        ax_p.bar(np.arange(len(prefill)) + i * width, vals, width, label=path_name)
    ax_p.bar(np.arange(len(prefill)) + len(PATHS) * width, [r["floor_us"] for r in prefill],
             width, label="HBM floor", color="k")
    ax_p.set_xticks(np.arange(len(prefill)) + 0.4,
                    [r["name"].replace("prefill ", "").replace(" ", "\n", 2) for r in prefill],
                    fontsize=7)
    ax_p.set(yscale="log", ylabel="us per LoRA layer (shrink+expand)",
             title="SGMV prefill, h=4096")
    ax_p.legend(fontsize=7)
    fig.suptitle(f"{report['device']} | jax {report['jax']} | {report['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path(__file__).resolve().parent / "results")
    parser.add_argument("--tag", default=None, help="file name tag (default: from the device)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, kernels in interpret mode off a GPU (plumbing test)")
    parser.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1))
    parser.add_argument("--time-budget", type=float, default=1e9,
                        help="seconds; groups of cases not started by then are skipped")
    parser.add_argument("--group", type=int, default=6, help="cases compiled together")
    parser.add_argument("--plot-from", type=pathlib.Path, default=None,
                        help="only render the PNG from a JSON report")
    args = parser.parse_args(argv)
    if args.plot_from:
        report = json.loads(args.plot_from.read_text())
        plot(report, args.plot_from.with_suffix(".png"))
        print("\n".join(table_lines(report["cases"])))
        return
    device = jax.devices()[0]
    kind_words = device.device_kind.lower().split()
    tag = args.tag or (kind_words[1] if len(kind_words) > 1 else kind_words[0])
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    print(f"{device.device_kind} | jax {jax.__version__} | backend {jax.default_backend()}",
          flush=True)
    cases = smoke_cases() if args.smoke else default_cases(args.quick)
    if jax.default_backend() != "gpu":
        STEP_KW["impl"] = "gpu"  # the GPU kernels in interpret mode
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)", flush=True)
    report = dict(device=device.device_kind, jax=jax.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  copy_GBps=bandwidth / 1e9, timing="median wall time per step of queued "
                  "device-bound calls (see module docstring)", cases=[])
    json_path = args.out / f"sgmv_{tag}.json"
    report["dispatch_us_per_call"] = null_call_us(cases[0])
    print(f"dispatch of an empty call with the same arguments: "
          f"{report['dispatch_us_per_call']:.0f} us", flush=True)
    deadline = start + args.time_budget
    # Cases in priority order, in groups: lower all paths of a group, compile them in a
    # thread pool, then time them (compiling never overlaps a measurement).
    for first in range(0, len(cases), args.group):
        group = cases[first: first + args.group]
        if time.time() > deadline:
            print(f"time budget spent: skipping {[c.name for c in group]}", flush=True)
            continue
        t0 = time.time()
        lowered = []  # (case index in group, path, Lowered or exception)
        for ci, case in enumerate(group):
            meta = metadata(case)
            y_spec = jax.ShapeDtypeStruct((case.rows, case.hidden), BF16)
            for path in PATHS:
                try:
                    run = make_run(path, *case.schedule(path))
                    lowered.append((ci, path, run.lower(y_spec, spec_sets(case), meta)))
                except Exception as err:  # noqa: BLE001
                    lowered.append((ci, path, err))
        t1 = time.time()
        todo = [low for _, _, low in lowered if not isinstance(low, Exception)]
        done = iter(compile_all(todo, args.jobs))
        compiled = [dict() for _ in group]
        for ci, path, low in lowered:
            compiled[ci][path] = low if isinstance(low, Exception) else next(done)
        print(f"[{len(lowered)} executables: lowered {t1 - t0:.0f}s, compiled "
              f"{time.time() - t1:.0f}s]", flush=True)
        for ci, case in enumerate(group):
            out = run_case(case, compiled[ci], bandwidth)
            report["cases"].append(out)
            print(table_lines([out])[-1], flush=True)
            json_path.write_text(json.dumps(report, indent=1) + "\n")
        del compiled, lowered, todo
    print(f"\n{device.device_kind} | jax {jax.__version__} | {report['date']} | copy "
          f"{bandwidth / 1e9:.0f} GB/s | times in us per LoRA layer (shrink+expand); "
          "! = rel err > 2e-2")
    print("\n".join(table_lines(report["cases"])))
    errors = [(c["name"], p, r["error"]) for c in report["cases"]
              for p, r in c["results"].items() if "error" in r]
    for name, path, err in errors[:8]:
        print(f"error {name} {path}: {err[:300]}")
    try:
        plot(report, json_path.with_suffix(".png"))
    except Exception as err:  # noqa: BLE001
        print(f"no plot: {err}")
    print(f"wrote {json_path} ({time.time() - start:.0f}s)")


if __name__ == "__main__":
    main()
