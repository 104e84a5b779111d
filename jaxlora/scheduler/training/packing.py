"""Packing one (global batch, adapter group) into microbatches: Algorithm 1, lines 2-10.

First-fit decreasing is always computed. Stage 1 MILP looks for fewer microbatches; stage 2,
with that count fixed, empties the smallest microbatch as far as it can so the others are
full and the remainder can be merged with the next block. The MILP result is kept only when
it beats greedy on (microbatch count, smallest microbatch's padded tokens); otherwise greedy.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from jaxlora.scheduler.training import milp
from jaxlora.scheduler.training.samples import Microbatch, Sample, padded_tokens, real_tokens
from jaxlora.scheduler.training.greedy import first_fit_decreasing


@dataclass(frozen=True)
class PackResult:
    """Microbatches sorted by padded tokens, largest first (the underfilled one is last)."""

    microbatches: tuple[Microbatch, ...]
    source: str  # "greedy" or "milp"
    greedy_quality: tuple[int, int]
    milp_status: tuple[str, ...]
    seconds: float


def quality(microbatches: Sequence[Microbatch], multiple: int) -> tuple[int, int]:
    """(count, padded tokens of the smallest microbatch): smaller is better, lexicographically."""
    if not microbatches:
        return (0, 0)
    return (len(microbatches), min(padded_tokens(mb, multiple) for mb in microbatches))


def largest_first(microbatches: Sequence[Microbatch], multiple: int) -> tuple[Microbatch, ...]:
    """Order microbatches by padded tokens, descending; samples inside by adapter then index."""
    ordered = sorted(microbatches, key=lambda mb: -padded_tokens(mb, multiple))
    return tuple(tuple(sorted(mb)) for mb in ordered)


def _stage_one_needed(
    samples: Sequence[Sample], greedy: Sequence[Microbatch], capacity: int
) -> bool:
    """False when greedy already meets the lower bound ceil(tokens / capacity)."""
    return len(greedy) > math.ceil(real_tokens(samples) / capacity)


def _stage_two_needed(
    samples: Sequence[Sample], bins: Sequence[Microbatch], capacity: int, multiple: int
) -> bool:
    """False when the smallest microbatch already holds only what the others cannot."""
    floor = max(0, real_tokens(samples) - (len(bins) - 1) * capacity)
    return len(bins) > 1 and quality(bins, multiple)[1] > floor


def _run_milp(
    samples, greedy, capacity, multiple, time_limit_s
) -> tuple[list[Microbatch], list[str]]:
    best, statuses = list(greedy), []
    if _stage_one_needed(samples, greedy, capacity):
        outcome = milp.min_bins(samples, capacity, multiple, greedy, time_limit_s)
        statuses.append(f"min_bins: {outcome.status}")
        if outcome.microbatches is not None and len(outcome.microbatches) < len(best):
            best = list(outcome.microbatches)
    if _stage_two_needed(samples, best, capacity, multiple):
        outcome = milp.min_smallest(samples, capacity, multiple, best, time_limit_s)
        statuses.append(f"min_smallest: {outcome.status}")
        found = outcome.microbatches
        if found is not None and quality(found, multiple) < quality(best, multiple):
            best = list(outcome.microbatches)
    return best, statuses


def pack_block(
    samples: Sequence[Sample],
    capacity: int,
    padding_multiple: int,
    time_limit_s: float = 1.0,
    use_milp: bool = True,
) -> PackResult:
    """Pack one block's samples; each MILP stage runs under `time_limit_s` seconds."""
    began = time.perf_counter()
    greedy = first_fit_decreasing(samples, capacity, padding_multiple)
    best, statuses = greedy, []
    if use_milp and samples:
        best, statuses = _run_milp(samples, greedy, capacity, padding_multiple, time_limit_s)
    greedy_q = quality(greedy, padding_multiple)
    source = "milp" if quality(best, padding_multiple) < greedy_q else "greedy"
    chosen = best if source == "milp" else greedy
    return PackResult(
        largest_first(chosen, padding_multiple),
        source,
        greedy_q,
        tuple(statuses),
        time.perf_counter() - began,
    )
