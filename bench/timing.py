"""Host-side timing shared by the benchmarks: back-to-back calls against one final sync."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def copy_bandwidth(num_bytes: int = 1 << 30, repeats: int = 50) -> float:
    """Device copy bandwidth in bytes/s, counting the bytes read plus the bytes written: a jitted
    negation of a float32 array of `num_bytes`, donated so each call reads it and writes it once in
    place (no allocation per call; a * 1.0001 in bf16 would fold to a no-op), timed by
    `median_call_seconds` after one compiling call."""
    negate = jax.jit(lambda a: -a, donate_argnums=0)
    state = [jnp.ones((num_bytes // 4,), jnp.float32)]

    def call():
        state[0] = negate(state[0])
        return state[0]

    jax.block_until_ready(call())
    return 2 * num_bytes / median_call_seconds(call, repeats)


def median_call_seconds(fn, repeats: int, rounds: int = 3) -> float:
    """Median over `rounds` of (time of `repeats` back-to-back calls of `fn`) / repeats; only the
    last call of a round is waited for (calls on one device run in issue order)."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats - 1):
            fn()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - start) / repeats)
    return statistics.median(times)


def kernel_times(fn, calls: int, log_dir: str) -> dict:
    """Device kernel time of `calls` calls of `fn` (already compiled) from a JAX profiler trace:
    {"kernels": [{"name", "calls", "total_ms"}] sorted by time, "categories": {category: ms},
    "device_ms", "wall_ms"}, per call of `fn`. Empty kernel lists mean the trace held no device
    events (no CUPTI)."""
    jax.block_until_ready(fn())
    start = time.perf_counter()
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
    wall_ms = (time.perf_counter() - start) * 1e3 / calls
    times = trace_kernel_times(log_dir, calls)
    times.pop("busy_ms")
    return {**times, "wall_ms": wall_ms}


def trace_kernel_times(log_dir: str, per: int = 1) -> dict:
    """The GPU kernels of the newest profiler trace under `log_dir`, divided by `per` (e.g. the
    steps or calls traced): {"kernels": [{"name", "calls", "total_ms"}] by time, "categories":
    {category: ms}, "device_ms" (kernel time summed), "busy_ms" (time any kernel ran: the union of
    their intervals, so overlapping streams count once)}."""
    import glob
    import gzip
    import json

    paths = sorted(glob.glob(f"{log_dir}/**/*.trace.json.gz", recursive=True))
    events = json.load(gzip.open(paths[-1]))["traceEvents"] if paths else []
    device_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                   and "/device:GPU" in str(e.get("args", {}).get("name", ""))}
    totals: dict[str, list] = {}
    spans = []
    for event in events:
        if event.get("ph") == "X" and event.get("pid") in device_pids and "dur" in event:
            entry = totals.setdefault(event["name"], [0, 0.0])
            entry[0] += 1
            entry[1] += event["dur"] / 1e3
            spans.append((float(event["ts"]), float(event["ts"]) + float(event["dur"])))
    kernels = sorted(({"name": name, "calls": n / per, "total_ms": ms / per} for name, (n, ms) in totals.items()),
                     key=lambda k: -k["total_ms"])
    categories: dict[str, float] = {}
    for kernel in kernels:
        category = kernel_category(kernel["name"])
        categories[category] = categories.get(category, 0.0) + kernel["total_ms"]
    return {"kernels": kernels, "categories": categories, "device_ms": sum(categories.values()),
            "busy_ms": busy_us(spans) / 1e3 / per, "host": host_self_times(events, device_pids, per, top=40),
            "host_threads": host_thread_times(events, device_pids, per)}


def host_thread_times(events: list, device_pids: set, per: int = 1, threads: int = 8, top: int = 15) -> list:
    """`host_self_times` thread by thread: [{"thread" (its name in the trace), "busy_ms" (its top-level
    events' time), "events": its costliest events by self time}], the `threads` busiest first, divided
    by `per`: which thread the host's time goes to (the engine's, or the adapter readers')."""
    names = {(e["pid"], e.get("tid")): str(e.get("args", {}).get("name", ""))
             for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    by_thread: dict = {}
    for event in events:
        if event.get("ph") == "X" and "dur" in event and event.get("pid") not in device_pids:
            by_thread.setdefault((event["pid"], event.get("tid")), []).append(event)
    rows = []
    for key, thread in by_thread.items():
        spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in thread]
        rows.append({"thread": names.get(key, str(key)), "busy_ms": busy_us(spans) / 1e3 / per,
                     "events": host_self_times(thread, set(), per, top=top)})
    return sorted(rows, key=lambda row: -row["busy_ms"])[:threads]


def host_self_times(events: list, device_pids: set, per: int = 1, top: int = 25) -> list:
    """The host side of a trace: [{"name", "calls", "self_ms"}] per event name, divided by `per`,
    costliest first (`top`): each event's duration less that of the events nested in it on its
    thread (self time, so nested names do not count twice), e.g. where a step's host dispatch goes."""
    threads: dict = {}
    for event in events:
        if event.get("ph") == "X" and "dur" in event and event.get("pid") not in device_pids:
            threads.setdefault((event["pid"], event.get("tid")), []).append(event)
    totals: dict[str, list] = {}
    for thread in threads.values():
        thread.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list = []  # [event, end, child time] of the open events
        for event in thread + [None]:
            start = float("inf") if event is None else float(event["ts"])
            while stack and stack[-1][1] <= start:
                done, end, child = stack.pop()
                entry = totals.setdefault(done["name"], [0, 0.0])
                entry[0] += 1
                entry[1] += float(done["dur"]) - child
                if stack:
                    stack[-1][2] += float(done["dur"])
            if event is not None:
                stack.append([event, start + float(event["dur"]), 0.0])
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:top]
    return [{"name": name, "calls": n / per, "self_ms": us / 1e3 / per} for name, (n, us) in ranked]


def busy_us(spans) -> float:
    """The length of the union of (start, end) intervals (any unit)."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy


def kernel_category(name: str) -> str:
    """A coarse class of a GPU kernel name: cuBLAS/cuDNN matmul, Pallas/Triton, XLA fusion, other."""
    lowered = name.lower()
    if any(tag in lowered for tag in ("gemm", "xmma", "cutlass", "nvjet", "sm90", "cublas", "matmul")):
        return "matmul (cuBLAS/XLA)"
    if any(tag in lowered for tag in ("mha", "sgmv", "bgmv", "fused_lora", "pallas", "triton")):
        return "pallas/triton kernels"
    if "fusion" in lowered or "loop_" in lowered or "input_" in lowered:
        return "XLA fusions (elementwise/reduce)"
    if "memcpy" in lowered or "memset" in lowered:
        return "copies"
    return "other"
