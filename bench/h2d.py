"""Host -> device copy bandwidth of adapter-sized arrays: pageable numpy (what the engine copies
today) against jax arrays in pinned host memory, alone and with a Python thread holding the GIL
in small steps beside it (the engine's disk readers), in one run.

    PYTHONPATH=. python bench/h2d.py [--mb 84 13] [--out FILE]
    PYTHONPATH=. python bench/h2d.py --tiny        # CPU smoke test

Writes JSON (device, jax version, date, MB/s per case, median of --repeats copies, each timed to
its block_until_ready)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import threading
import time

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import jax
import numpy as np


def copy_seconds(make_source, target, repeats: int) -> list[float]:
    """Seconds of `repeats` copies of `make_source()` to `target` (a sharding in device memory)."""
    times = []
    for _ in range(repeats):
        source = make_source()
        started = time.perf_counter()
        jax.block_until_ready(jax.device_put(source, target))
        times.append(time.perf_counter() - started)
    return times


def gil_holder(stop: threading.Event) -> None:
    """Small pure-Python steps that keep taking the GIL (a reader thread parsing adapters)."""
    while not stop.is_set():
        total = 0
        for i in range(2000):
            total += i


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[84.0, 13.0])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default="bench/results/h2d.json")
    args = parser.parse_args()
    if args.tiny:
        args.mb, args.repeats = [4.0], 3
    device = jax.devices()[0]
    on_device = jax.sharding.SingleDeviceSharding(device, memory_kind=device.default_memory().kind)
    kinds = [m.kind for m in device.addressable_memories()]
    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host") if "pinned_host" in kinds else None
    rng = np.random.default_rng(0)
    report = {"device": device.device_kind, "jax": jax.__version__, "backend": jax.default_backend(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "memory_kinds": kinds, "cases": []}
    for mb in args.mb:
        host = rng.standard_normal(int(mb * 2**20) // 4, np.float32).view(np.uint16)  # bf16-sized bytes
        sources = {"pageable numpy": lambda: host}
        if pinned is not None:
            held = jax.device_put(host, pinned)
            sources["pinned host jax"] = lambda: held
        for busy in (False, True):
            stop = threading.Event()
            threads = [threading.Thread(target=gil_holder, args=(stop,)) for _ in range(2 if busy else 0)]
            for thread in threads:
                thread.start()
            for name, make in sources.items():
                times = copy_seconds(make, on_device, args.repeats)
                median = float(np.median(times))
                case = {"mb": mb, "source": name, "gil_busy_threads": len(threads), "median_s": median,
                        "mb_per_s": mb / median, "min_s": min(times)}
                report["cases"].append(case)
                print(f"{mb:6.1f} MB  {name:16}  busy threads {len(threads)}: {median * 1e3:8.2f} ms  "
                      f"{mb / median / 1024:6.2f} GB/s", flush=True)
            stop.set()
            for thread in threads:
                thread.join()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"device {report['device']}, jax {report['jax']}; wrote {args.out}")


if __name__ == "__main__":
    main()
