"""The host's cost of one adapter load on the engine's own path (issue 34): what the engine thread
spends, per adapter, in `StagedCopies`' two calls, measured apart from a serving trace.

A load is a prefetch (`serve.adapter_copies.start_copy`: `pool.to_device(pool.padded(prepared))`, a
`jax.device_put` of the slot's arrays, DMA from pinned host memory on a GPU) and a commit
(`pool.write_padded`: the jitted slot update). In the 8B traces these cost the engine thread
0.9 + 2.4 ms a load (the guard's distinct case, 64 loads of 84 MB) but ~11 ms of prefetch a load in
Compress-then-Serve's uncompressed run (282 loads of 84 MB; H200, 2026-11-29) and ~4 ms in the disk
trace's first steps (8 MB): this probe says which part of a load takes the host's time and whether
it depends on the bytes, the number of arrays, copies already in flight, or the device being busy.

Cases (host ms a load, median over --repeats; the device time of the copies is not the point):
- `issue`: `start_copy` alone, the previous load's copy finished (one copy in flight at a time);
- `issue burst`: --burst copies issued back to back (a step's prefetch of several adapters);
- `issue busy`: `start_copy` while the device runs a ~--busy-ms chain of matmuls (a step);
- `write`: `write_padded` of a finished copy; `write busy`: the same while the device is busy;
- `flat issue`: the same bytes as one array (one `device_put` of one pinned buffer), to tell the
  per-array cost from the per-byte one.

    PYTHONPATH=. python bench/load_probe.py [--targets all|qv] [--out FILE]
    PYTHONPATH=. python bench/load_probe.py --tiny      # CPU smoke run (2-layer model)"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.pool import AdapterPool
from jaxlora.models.presets import llama8b_config
from jaxlora.nn.model_config import PROJECTIONS
from serve.adapter_copies import start_copy
from serve.stats import EngineStats

TARGETS = {"all": PROJECTIONS, "qv": ("q_proj", "v_proj")}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="2-layer tiny model on any backend (smoke test)")
    parser.add_argument("--targets", choices=sorted(TARGETS), default="all")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=8, help="device pool slots (loads cycle through them)")
    parser.add_argument("--adapters", type=int, default=8, help="distinct prepared adapters (pinned host copies)")
    parser.add_argument("--repeats", type=int, default=16)
    parser.add_argument("--burst", type=int, default=4)
    parser.add_argument("--busy-ms", type=float, default=20.0, help="device time of the busy chain (GPU)")
    parser.add_argument("--out", default=None, help="JSON (default bench/results/load_probe[_tiny].json)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.repeats, args.adapters, args.slots = 4, 3, 3
    args.out = args.out or f"bench/results/load_probe{'_tiny' if args.tiny else ''}.json"
    return args


def busy_chain(ms: float, tiny: bool):
    """A jitted chain of bf16 matmuls taking about `ms` of device time (measured once), and its input."""
    n = 256 if tiny else 8192
    x = jnp.ones((n, n), jnp.bfloat16)

    @jax.jit
    def chain(x, steps):
        return jax.lax.fori_loop(0, steps, lambda _, y: (y @ x) * 1e-3, x)

    jax.block_until_ready(chain(x, 1))
    started = time.perf_counter()
    jax.block_until_ready(chain(x, 10))
    per_step = (time.perf_counter() - started) / 10
    steps = max(1, round(ms / 1e3 / per_step))
    jax.block_until_ready(chain(x, steps))  # compiled for this trip count's shape (a traced scalar: same program)
    return lambda: chain(x, steps)


def median_ms(times: list[float]) -> float:
    return 1e3 * float(np.median(times))


def measure(pool: AdapterPool, prepared: list, args, busy) -> dict:
    """Host ms a load for each case of the module doc."""
    stats = EngineStats()
    times: dict[str, list[float]] = {name: [] for name in
                                      ("issue", "issue burst", "issue busy", "write", "write busy", "flat issue")}
    flat_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0],
                                                      memory_kind=jax.devices()[0].default_memory().kind)
    flats = [jax.device_put(np.zeros(p.nbytes, np.uint8), pool._host_sharding) if pool.pinned
             else np.zeros(p.nbytes, np.uint8) for p in prepared[:2]]
    slot = 0

    def next_slot():
        nonlocal slot
        slot = (slot + 1) % pool.num_slots
        return slot

    for i in range(args.repeats):
        entry = prepared[i % len(prepared)]
        started = time.perf_counter()  # issue: nothing in flight
        copy = start_copy(pool, entry, stats)
        times["issue"].append(time.perf_counter() - started)
        values = copy.result()
        jax.block_until_ready(values)
        started = time.perf_counter()  # write: the copy is on the device
        pool.write_padded(next_slot(), entry.name, values)
        times["write"].append(time.perf_counter() - started)
        jax.block_until_ready(pool.arrays)

        started = time.perf_counter()  # a burst of copies issued back to back
        burst = [start_copy(pool, prepared[(i + j) % len(prepared)], stats) for j in range(args.burst)]
        times["issue burst"].append((time.perf_counter() - started) / args.burst)
        jax.block_until_ready([c.result() for c in burst])

        running = busy()  # the device busy with a step's worth of work
        started = time.perf_counter()
        copy = start_copy(pool, entry, stats)
        times["issue busy"].append(time.perf_counter() - started)
        values = copy.result()
        started = time.perf_counter()
        pool.write_padded(next_slot(), entry.name, values)
        times["write busy"].append(time.perf_counter() - started)
        jax.block_until_ready((running, pool.arrays))

        flat = flats[i % len(flats)]
        started = time.perf_counter()
        moved = jax.device_put(flat, flat_sharding)
        times["flat issue"].append(time.perf_counter() - started)
        jax.block_until_ready(moved)
    return {name: {"median_ms": median_ms(t), "max_ms": 1e3 * max(t), "samples": len(t)} for name, t in times.items()}


def main(argv=None) -> None:
    args = parse_args(argv)
    config = llama8b_config(2 if args.tiny else 32, args.tiny)
    gpu = jax.default_backend() == "gpu"
    targets = TARGETS[args.targets]
    pool = AdapterPool(config, args.slots, args.rank, targets, jnp.bfloat16, donate=True, pinned=gpu)
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets)
    started = time.perf_counter()
    prepared = []
    for i in range(args.adapters):
        prepared.append(pool.prepare(random_adapter(f"a{i}", config, lora, seed=i)))  # cast to bf16 once
    made_s = time.perf_counter() - started
    pool.evict(0)  # compiles the slot update, as warm-up does
    jax.block_until_ready(pool.arrays)
    busy = busy_chain(args.busy_ms, args.tiny)
    leaves = len(jax.tree.leaves(pool.padded(prepared[0])))
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "backend": jax.default_backend(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "model": {"shape": "tiny" if args.tiny else "Llama-3.1-8B", "layers": config.num_layers},
              "adapter": {"targets": list(targets), "rank": args.rank, "bytes": prepared[0].nbytes, "arrays": leaves,
                          "pinned": pool.pinned},
              "settings": vars(args), "prepare_s": made_s, "cases": measure(pool, prepared, args, busy)}
    print(f"{report['device']} ({report['backend']}), adapter {prepared[0].nbytes / 2**20:.1f} MiB in {leaves} arrays, "
          f"pinned {pool.pinned}: host ms a load")
    for name, case in report["cases"].items():
        print(f"  {name:12} {case['median_ms']:8.3f} (max {case['max_ms']:.3f})")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
