"""Verification of a final schedule (Algorithm 1, line 15).

Checks: every sample appears exactly once, every microbatch fits the padded capacity, the
bubble lemma holds (no-ops already inserted), and the optimizer-step indices point at the
last microbatch of each global batch. Violations raise `ScheduleError` listing them all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from jaxlora.scheduler.training.samples import Microbatch, Sample, batch_index, padded_tokens
from jaxlora.scheduler.training.lemma import LemmaState, ScheduleError, lemma_violations


def capacity_violations(
    microbatches: Sequence[Microbatch], capacity: int, multiple: int, first_index: int = 0
) -> list[str]:
    return [
        f"microbatch {first_index + i}: {padded_tokens(mb, multiple)} padded tokens > {capacity}"
        for i, mb in enumerate(microbatches)
        if padded_tokens(mb, multiple) > capacity
    ]


def coverage_violations(
    microbatches: Sequence[Microbatch], expected: Iterable[Sample]
) -> list[str]:
    """Samples missing, repeated, or not expected."""
    counts = Counter(s for mb in microbatches for s in mb)
    wanted = set(expected)
    problems = [f"missing {s}" for s in sorted(wanted - counts.keys())]
    problems += [f"unexpected {s}" for s in sorted(counts.keys() - wanted)]
    problems += [f"{s} scheduled {n} times" for s, n in sorted(counts.items()) if n > 1]
    return problems


def completion_violations(
    microbatches: Sequence[Microbatch], completions: Mapping[int, Mapping[int, int]],
    global_batch_size: Mapping[int, int], first_index: int = 0,
) -> list[str]:
    last: dict[tuple[int, int], int] = {}
    for offset, mb in enumerate(microbatches):
        for s in mb:
            last[(s.adapter_id, batch_index(s, global_batch_size))] = first_index + offset
    listed = {(a, j): i for a, done in completions.items() for j, i in done.items()}
    problems = [
        f"completion of {key} is {listed.get(key)}, expected {i}"
        for key, i in sorted(last.items())
        if listed.get(key) != i
    ]
    extra = sorted(listed.keys() - last.keys())
    return problems + [f"completion of {key} lists no samples" for key in extra]


def _raise_if(problems: list[str]) -> None:
    if problems:
        shown = "\n  ".join(problems[:20])
        raise ScheduleError(f"{len(problems)} schedule problem(s):\n  {shown}")


def check_chunk(
    microbatches: Sequence[Microbatch], global_batch_size: Mapping[int, int],
    capacity: int, multiple: int, num_stages: int, start: LemmaState, seen: set[Sample],
) -> None:
    """Check one emitted chunk and add its samples to `seen` (duplicates across chunks fail)."""
    problems = capacity_violations(microbatches, capacity, multiple, start.next_index)
    problems += lemma_violations(microbatches, global_batch_size, num_stages, start)
    samples = [s for mb in microbatches for s in mb]
    repeated = [s for s, n in Counter(samples).items() if n > 1 or s in seen]
    problems += [f"{s} scheduled more than once" for s in sorted(repeated)]
    _raise_if(problems)
    seen.update(samples)


def verify_schedule(
    schedule, expected: Iterable[Sample], global_batch_size: Mapping[int, int],
    capacity: int, multiple: int, num_stages: int,
) -> None:
    """Full check of a `Schedule` that starts at microbatch 0."""
    mbs = schedule.microbatches
    problems = coverage_violations(mbs, expected)
    problems += capacity_violations(mbs, capacity, multiple)
    problems += lemma_violations(mbs, global_batch_size, num_stages)
    problems += completion_violations(
        mbs, schedule.completions, global_batch_size, schedule.first_index
    )
    _raise_if(problems)
