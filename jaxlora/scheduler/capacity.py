"""Token capacity per microbatch from a small throughput profile.

The profiler runs fixed-length microbatches of a few sizes and records throughput (tokens/s).
Throughput rises with the microbatch size until the device is saturated, then flattens. The
capacity is the **smallest** size whose throughput reaches `fraction` (default 95%) of the best
measured throughput: beyond that knee a larger microbatch buys almost no throughput but costs
memory, padding waste, and fewer microbatches to fill the pipeline with.

The measurement is a callable (tokens -> throughput), so a trainer passes a real timed step
and tests pass a synthetic curve.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CapacityProfile:
    """Measured (tokens per microbatch -> throughput) pairs and the capacity chosen from them."""

    tokens: tuple[int, ...]
    throughput: tuple[float, ...]
    fraction: float
    capacity: int


def power_of_two_candidates(smallest: int = 512, largest: int = 16384) -> tuple[int, ...]:
    """Candidate microbatch sizes smallest, 2*smallest, ... up to largest (inclusive)."""
    if smallest <= 0 or largest < smallest:
        raise ValueError(f"need 0 < smallest <= largest, got {smallest}, {largest}")
    sizes, size = [], smallest
    while size <= largest:
        sizes.append(size)
        size *= 2
    return tuple(sizes)


def choose_capacity(
    tokens: Sequence[int], throughput: Sequence[float], fraction: float = 0.95
) -> int:
    """Smallest token count whose throughput is >= fraction * the maximum throughput."""
    if len(tokens) != len(throughput) or not tokens:
        raise ValueError("need equally many (>0) token sizes and throughputs")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    best = max(throughput)
    if best <= 0:
        raise ValueError("no positive throughput was measured")
    pairs = sorted(zip(tokens, throughput))
    return next(size for size, rate in pairs if rate >= fraction * best)


def profile_token_capacity(
    measure: Callable[[int], float],
    candidates: Sequence[int] | None = None,
    fraction: float = 0.95,
    repeats: int = 1,
) -> CapacityProfile:
    """Measure throughput per candidate size (median of `repeats` runs); pick the capacity."""
    sizes = tuple(sorted(set(candidates or power_of_two_candidates())))
    if any(size <= 0 for size in sizes):
        raise ValueError(f"candidate sizes must be positive, got {sizes}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    rates = tuple(float(statistics.median(measure(s) for _ in range(repeats))) for s in sizes)
    return CapacityProfile(sizes, rates, fraction, choose_capacity(sizes, rates, fraction))
