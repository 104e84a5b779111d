"""Where one disk read of a PEFT adapter goes (issue 34 item 5): the adapter store's read of
bench/slora_disk.py's 8B-shaped adapters (ranks 4/8/16 on q_proj+v_proj, bfloat16), stage by
stage, for the reader before this change (`legacy_read`: safetensors' `get_tensor` per tensor, a
transposed copy per tensor, `check_finite` on the placed arrays) and today's
(`jaxlora.lora.peft_io.load_peft_adapter` over `jaxlora.lora.safetensors_io`), in one run.

    PYTHONPATH=. python bench/disk_reads.py [--adapters 48] [--dir /tmp/disk_reads_adapters]
    PYTHONPATH=. python bench/disk_reads.py --tiny      # CPU smoke test (tiny shape)

Conditions: cold (the file's pages written back and dropped from the page cache with
posix_fadvise DONTNEED before each read) and warm; alone, and beside a stand-in for the serving
engine's thread (`EngineThread`: 5 ms of pure Python holding the GIL, then 5 ms waiting with it
released, or never waiting): each call of the reader that releases the GIL may then cost up to
the switch interval, 5 ms, before it runs again, and each time a reader takes the GIL the engine
thread's work stretches ("engine stretch", 1.0 = no loss). Per stage: the median ms per adapter
over the adapters (ranks mixed), the floor being `open(file, "rb").read()` of the same file.
Then the store as the engine runs it: `AdapterStore` with 4 reader threads reading every adapter
(cold), and the engine thread's start of a host -> device copy per rank (`copy_ms`). JSON at
--out (device, date, all figures). GIL hand-offs depend on the OS's scheduling: the figures
beside the engine thread move between runs (2x seen); compare before/after within one run."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import threading
import time

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from bench.slora_disk import adapter_name, write_adapters
from jaxlora.lora import peft_io, safetensors_io
from jaxlora.lora.adapter import LoraAdapter, check_finite, empty_module
from jaxlora.lora.pool import AdapterPool
from jaxlora.models.presets import llama8b_config
from serve.adapter_store import AdapterStore


# ---- the two readers, stage by stage ----------------------------------------------------------------

def stage_timer(times: dict):
    """`lap(stage)`: records in `times` the seconds since the previous lap (or since this call)."""
    clock = [time.perf_counter()]

    def lap(stage: str) -> None:
        now = time.perf_counter()
        times[stage], clock[0] = now - clock[0], now

    return lap


def legacy_stages(path: str, base, pool: AdapterPool) -> dict:
    """The read before this change (peft_io at 74eb595), timed per stage: {stage: seconds}."""
    times = {}
    lap = stage_timer(times)

    file = os.path.join(path, peft_io.CONFIG_FILE)
    with open(file) as f:  # jaxlora.jsonfile.read_json_file before this change
        config = peft_io.lora_config_from_peft(json.load(f), base, file)
    lap("config")
    with safe_open(os.path.join(path, peft_io.WEIGHTS_FILE), framework="numpy") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    lap("read + tensors")
    adapter = LoraAdapter(os.path.basename(path), config, {})
    dtype = peft_io._common_float_dtype(tensors)
    for module in config.target_modules:
        adapter.modules[module] = empty_module(base, config, module, dtype)
    for key, tensor in tensors.items():
        layer, name, part = peft_io._parse_key(key, path, base)
        weights = adapter.modules[name]
        rank = int(weights.rank[layer])
        if part == "A":
            weights.a[layer, :, :rank] = tensor.T
        else:
            weights.b[layer, :rank, :] = tensor.T
    lap("place")
    check_finite(adapter, path)
    lap("finite")
    prepared = pool.prepare(adapter, check=False)
    lap("prepare")
    return times, prepared


def new_stages(path: str, base, pool: AdapterPool) -> dict:
    """Today's read (`load_peft_adapter` with the pool's host dtype, then `prepare`), per stage."""
    times = {}
    lap = stage_timer(times)

    config = peft_io.read_adapter_config(path, base)
    lap("config")
    buffer = safetensors_io.read_file(os.path.join(path, peft_io.WEIGHTS_FILE))
    lap("read")
    weights = safetensors_io.parse(buffer)
    tensors = weights.tensors()
    lap("header + views")
    bad = weights.maybe_nonfinite()
    lap("finite")
    adapter = peft_io.adapter_from_peft(config, tensors, base, os.path.basename(path), path,
                                        host_dtype=pool.host_dtype, check_finite_values=bad)
    lap("place")
    prepared = pool.prepare(adapter, check=False)
    lap("prepare")
    return times, prepared


def floor_stages(path: str, base, pool) -> dict:
    started = time.perf_counter()
    with open(os.path.join(path, peft_io.WEIGHTS_FILE), "rb") as f:
        f.read()
    return {"open().read()": time.perf_counter() - started}, None


def store_read(pool: AdapterPool, base):
    """The store's read function, as `serve.residency.Residency.read` does it."""
    return lambda path, name: pool.prepare(peft_io.load_peft_adapter(path, base, name, keep_dtype=True,
                                                                     host_dtype=pool.host_dtype), check=False)


# ---- conditions ---------------------------------------------------------------------------------------

def drop_cache(file: str) -> None:
    """Drops `file`'s pages from the page cache (written back first: dirty pages stay; no root needed)."""
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class EngineThread:
    """A stand-in for a serving engine's thread: `busy_ms` of pure Python (holding the GIL), then
    `wait_ms` waiting with the GIL released (for the device), over and over. Records each busy
    segment's wall time: beside the readers it stretches by the time they held the GIL."""

    def __init__(self, busy_ms: float, wait_ms: float):
        self.busy_ms, self.wait_ms, self.segments = busy_ms, wait_ms, []
        self._loops = self._calibrate(busy_ms)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _calibrate(busy_ms: float) -> int:
        EngineThread._work(20000)
        started, loops = time.perf_counter(), 200000
        EngineThread._work(loops)
        return max(1, int(loops * busy_ms / 1e3 / (time.perf_counter() - started)))

    @staticmethod
    def _work(loops: int) -> None:
        total = 0
        for i in range(loops):
            total += i

    def _run(self):
        while not self._stop.is_set():
            started = time.perf_counter()
            self._work(self._loops)
            self.segments.append(time.perf_counter() - started)
            if self.wait_ms:
                time.sleep(self.wait_ms / 1e3)

    def stretch(self, since: int) -> float:
        """Mean busy-segment wall time from segment `since` over the median of those before it
        (the thread alone, `__enter__`): 1.0 is no loss."""
        alone = float(np.median(self.segments[:since]))
        return float(np.mean(self.segments[since:] or [alone])) / alone

    def __enter__(self):
        self._thread.start()
        time.sleep(0.2)  # segments alone: the baseline of `stretch`
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


ENGINES = {"alone": None, "engine 50% busy": (5.0, 5.0), "engine 100% busy": (5.0, 0.0)}


def time_stages(stages, paths: list, base, pool, cold: bool) -> list[dict]:
    """[{stage: seconds, "total": seconds}] of `stages` over `paths`, one row per read."""
    rows = []
    for path in paths:
        if cold:
            drop_cache(os.path.join(path, peft_io.WEIGHTS_FILE))
        times, _ = stages(path, base, pool)
        rows.append({**times, "total": sum(times.values())})
    return rows


def medians(rows: list[dict]) -> dict:
    """{stage: median ms} over `rows`."""
    return {stage: 1e3 * float(np.median([r[stage] for r in rows])) for stage in rows[0]}


def stage_table(paths: list, base, pool, repeats: int, trials: int) -> dict:
    """{condition: {reader: {stage: ms}}} for cold/warm x `ENGINES`. Beside the engine thread each
    reader runs `trials` times on a fresh thread (the GIL hand-offs fall into different regimes
    from one thread to the next): the medians pool every read, "trial totals" are each trial's
    median total, "engine stretch" the mean over trials of the engine thread's (1.0: no loss)."""
    table = {}
    for cold in (True, False):
        for engine_label, engine in ENGINES.items():
            label = f"{'cold' if cold else 'warm'}, {engine_label}"
            table[label] = {}
            for reader, stages in (("floor", floor_stages), ("before", legacy_stages), ("after", new_stages)):
                use = paths[:8] if engine else paths  # up to ~0.7 s a legacy read beside the engine thread
                use = use if cold else use * repeats
                if engine is None:
                    table[label][reader] = medians(time_stages(stages, use, base, pool, cold))
                    continue
                rows, totals, stretches = [], [], []
                for _ in range(trials):
                    with EngineThread(*engine) as thread:
                        since = len(thread.segments)
                        trial = time_stages(stages, use, base, pool, cold)
                        stretches.append(thread.stretch(since))
                    rows += trial
                    totals.append(medians(trial)["total"])
                table[label][reader] = {**medians(rows), "engine stretch": float(np.mean(stretches)),
                                        "trial totals": totals}
            print_condition(label, table[label])
    return table


def print_condition(label: str, readers: dict) -> None:
    print(f"\n{label}: ms per adapter (median)")
    for reader, stages in readers.items():
        print(f"  {reader:7} " + "  ".join(f"{stage} {ms:.2f}" if not isinstance(ms, list) else
                                           f"{stage} {'/'.join(f'{t:.0f}' for t in ms)}"
                                           for stage, ms in stages.items()), flush=True)


def store_run(paths: list, base, pool, readers: int, engine, legacy: bool) -> dict:
    """Every adapter of `paths` read through an `AdapterStore` of `readers` threads (cold), with
    the reader before this change (`legacy`) or today's, beside `engine` (EngineThread args)."""
    for path in paths:
        drop_cache(os.path.join(path, peft_io.WEIGHTS_FILE))
    read = (lambda path, name: legacy_stages(path, base, pool)[1]) if legacy else store_read(pool, base)
    store = AdapterStore(read, os.path.dirname(paths[0]), readers=readers)
    thread = EngineThread(*engine).__enter__() if engine else None
    since, started = (len(thread.segments) if thread else 0), time.perf_counter()
    for future in [store.ensure(os.path.basename(path)) for path in paths]:
        future.result()
    seconds = time.perf_counter() - started
    result = {"adapters": len(paths), "readers": readers, "wall_s": seconds,
              "ms_per_adapter": 1e3 * seconds / len(paths), "read_seconds_summed": store.stats.disk_read_seconds,
              "ms_per_read": 1e3 * store.stats.disk_read_seconds / len(paths)}
    if thread is not None:
        result["engine_stretch"] = thread.stretch(since)
        thread.__exit__()
    store.close()
    return result


def copy_ms(paths: list, base, repeats: int) -> dict:
    """{rank: {way: ms}}: the engine thread's time to start one slot's host -> device copy of a
    prepared adapter (pinned host memory, as on a GPU server: `padded`, where the host pads lower
    ranks with numpy, then `to_device`), and the same until the copy is done ("+ done"). (A
    device-side pad was tried and reverted: the guard's decode steps slowed with it, NOTES_serve.)"""
    pool = AdapterPool(base, 1, 16, ("q_proj", "v_proj"), dtype=jnp.bfloat16, pinned=True)
    read, out = store_read(pool, base), {}
    ways = {"copy": lambda p: pool.to_device(pool.padded(p))}
    for path in paths[:3]:
        prepared = read(path, os.path.basename(path))
        rank = int(next(iter(prepared.values.values()))["a"].shape[2])
        out[rank] = {}
        for way, copy in ways.items():
            jax.block_until_ready(copy(prepared))  # warm before timing
            started, done = [], []
            for _ in range(repeats):
                clock = time.perf_counter()
                values = copy(prepared)
                started.append(time.perf_counter() - clock)
                jax.block_until_ready(values)
                done.append(time.perf_counter() - clock)
            out[rank][way] = 1e3 * float(np.median(started))
            out[rank][way + " + done"] = 1e3 * float(np.median(done))
    return out


def check_same(paths: list, base, pool) -> None:
    """The two readers give the same host arrays (bit for bit)."""
    for path in paths[:3]:
        old, new = legacy_stages(path, base, pool)[1], new_stages(path, base, pool)[1]
        for module, parts in old.values.items():
            for part, value in parts.items():
                np.testing.assert_array_equal(np.asarray(value), np.asarray(new.values[module][part]))
                assert np.asarray(value).dtype == np.asarray(new.values[module][part]).dtype


# ---- main -------------------------------------------------------------------------------------------

def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shape, 6 adapters (CPU smoke test)")
    parser.add_argument("--adapters", type=int, default=None, help="adapter folders (default 48; --tiny: 6)")
    parser.add_argument("--dir", default=None, help="default /tmp/disk_reads_adapters[_tiny]")
    parser.add_argument("--repeats", type=int, default=3, help="warm reads of each adapter alone")
    parser.add_argument("--trials", type=int, default=3, help="engine threads per reader and condition")
    parser.add_argument("--out", default=None, help="JSON (default bench/results/disk_reads_cpu[_tiny].json)")
    args = parser.parse_args(argv)
    base = llama8b_config(2 if args.tiny else 32, args.tiny)
    count = args.adapters or (6 if args.tiny else 48)
    root = args.dir or f"/tmp/disk_reads_adapters{'_tiny' if args.tiny else ''}"
    disk = write_adapters(root, base, count, [4, 8, 16], ["q_proj", "v_proj"])
    paths = [os.path.join(root, adapter_name(i)) for i in range(count)]
    pool = AdapterPool(base, 1, 16, ("q_proj", "v_proj"), dtype=jnp.bfloat16)
    print(f"{count} adapters in {root}: {disk['bytes_on_disk'] / count / 2**20:.1f} MiB each on average", flush=True)
    check_same(paths, base, pool)
    report = {"device": jax.devices()[0].device_kind, "cpu": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "jax": jax.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "switch_interval_s":
              sys.getswitchinterval(), "adapters": count, "mean_file_bytes": disk["bytes_on_disk"] / count,
              "stages_ms": stage_table(paths, base, pool, args.repeats, args.trials)}
    report["store"] = {f"{'before' if legacy else 'after'}, {label}": store_run(paths, base, pool, 4, engine, legacy)
                       for legacy in (True, False) for label, engine in ENGINES.items()}
    report["copy_start_ms"] = copy_ms(paths, base, max(5, args.repeats))
    print("\nstore, 4 reader threads, cold:")
    for label, run in report["store"].items():
        print(f"  {label:26} {run['ms_per_adapter']:7.2f} ms per adapter (wall), {run['ms_per_read']:7.2f} ms per "
              f"read (summed over threads)" + (f", engine stretch {run['engine_stretch']:.3f}" if "engine_stretch" in run
                                              else ""))
    print("host -> device copy of a prepared adapter (pinned), engine thread ms:")
    for rank, ways in sorted(report["copy_start_ms"].items()):
        print(f"  rank {rank:2d}: " + "  ".join(f"{way} {ms:.2f}" for way, ms in ways.items()))
    out = args.out or f"bench/results/disk_reads_cpu{'_tiny' if args.tiny else ''}.json"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"device {report['device']}; wrote {out}")


if __name__ == "__main__":
    main()
