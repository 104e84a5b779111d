"""bench/timing.py's trace reading: kernel time summed per name and category, and the device's busy
time as the union of kernel intervals (overlapping kernels on two streams count once), from a
profiler trace written here (no GPU)."""

import gzip
import json

import pytest

from bench.timing import busy_us, host_self_times, trace_kernel_times


def _trace(path, events):
    meta = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}}]
    path.mkdir(parents=True)
    with gzip.open(path / "x.trace.json.gz", "wt") as out:
        json.dump({"traceEvents": meta + events}, out)


def test_busy_is_the_union_of_intervals():
    assert busy_us([]) == 0
    assert busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17  # [0, 12] and [20, 25]


def test_trace_kernel_times_per_step(tmp_path):
    kernel = lambda name, ts, dur, pid=7: {"ph": "X", "name": name, "pid": pid, "ts": ts, "dur": dur}
    _trace(tmp_path / "plugins" / "profile", [
        kernel("gemm_fusion_dot_1", 0, 1000), kernel("sgmv_paged_shrink", 500, 1000),  # overlap 500 us
        kernel("loop_add_fusion", 3000, 1000), kernel("gemm_fusion_dot_1", 5000, 1000),
        kernel("python_host_call", 0, 9000, pid=1)])  # a host event: not counted
    times = trace_kernel_times(str(tmp_path), per=2)
    assert times["device_ms"] == pytest.approx(2.0) and times["busy_ms"] == pytest.approx(1.75)
    assert times["kernels"][0] == {"name": "gemm_fusion_dot_1", "calls": 1.0, "total_ms": 1.0}
    assert times["categories"] == pytest.approx({"matmul (cuBLAS/XLA)": 1.0, "pallas/triton kernels": 0.5,
                                                 "XLA fusions (elementwise/reduce)": 0.5})


def test_no_trace_no_kernels(tmp_path):
    times = trace_kernel_times(str(tmp_path))
    assert times["kernels"] == [] and times["device_ms"] == 0 and times["busy_ms"] == 0


def test_host_self_times_subtract_nested_events():
    """A host event's self time is its duration less its nested events' (per thread); device events
    and other threads do not nest into it."""
    event = lambda name, ts, dur, tid=1, pid=1: {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
    events = [event("run_step", 0, 1000), event("Execute", 100, 600), event("copy", 200, 100),
              event("launch", 720, 50), event("run_step", 2000, 500), event("Execute", 2000, 500),
              event("other_thread", 0, 3000, tid=2), event("kernel", 0, 3000, pid=7)]
    host = {h["name"]: h for h in host_self_times(events, {7}, per=2)}
    assert set(host) == {"run_step", "Execute", "copy", "launch", "other_thread"}
    assert host["run_step"]["self_ms"] == pytest.approx((1000 - 600 - 50) / 2e3)
    assert host["Execute"] == {"name": "Execute", "calls": 1.0, "self_ms": pytest.approx((600 - 100 + 500) / 2e3)}
    assert host["copy"]["self_ms"] == pytest.approx(0.05) and host["other_thread"]["self_ms"] == pytest.approx(1.5)
