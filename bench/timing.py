"""Host-side timing shared by the benchmarks: back-to-back calls against one final sync."""

from __future__ import annotations

import statistics
import time

import jax


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
