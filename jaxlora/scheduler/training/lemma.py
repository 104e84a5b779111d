"""The bubble lemma (LoRAFusion §4.2.3) and no-op insertion.

With S pipeline stages (1F1B), the backward of microbatch k leaves the first stage only after
the forwards of microbatches k+1 .. k+S-1 have entered. If the last sample of adapter a's
global batch j is in microbatch k, a's optimizer steps after that backward, so no sample of
a's batch j+1 may enter before microbatch k+S-1 has: its first microbatch index must be
>= k + S (at least S-1 microbatches in between). With S = 1 this only forbids two global
batches of one adapter in one microbatch.

Where packing and merging leave a gap that is too short, empty (no-op) microbatches are
inserted. `LemmaState` carries what the check needs across schedule chunks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from jaxlora.scheduler.training.samples import Microbatch, batch_index


class ScheduleError(ValueError):
    """A schedule breaks an invariant that no-op insertion cannot repair."""


@dataclass(frozen=True)
class LemmaState:
    """Index of the next microbatch, and per adapter (latest global batch, its last index)."""

    next_index: int = 0
    last_seen: Mapping[int, tuple[int, int]] = field(default_factory=dict)


def batches_in(mb: Microbatch, global_batch_size: Mapping[int, int]) -> dict[int, int]:
    """adapter -> global batch index of its samples in this microbatch (must be unique)."""
    found: dict[int, int] = {}
    for sample in mb:
        batch = batch_index(sample, global_batch_size)
        if found.setdefault(sample.adapter_id, batch) != batch:
            raise ScheduleError(
                f"adapter {sample.adapter_id} has global batches {found[sample.adapter_id]} "
                f"and {batch} in one microbatch"
            )
    return found


def earliest_index(
    batches: Mapping[int, int], last_seen: Mapping[int, tuple[int, int]], num_stages: int
) -> int:
    """Smallest microbatch index at which a microbatch holding `batches` may enter."""
    earliest = 0
    for adapter, batch in batches.items():
        if adapter not in last_seen:
            continue
        seen_batch, seen_index = last_seen[adapter]
        if seen_batch > batch:
            raise ScheduleError(
                f"adapter {adapter}: global batch {batch} after batch {seen_batch} started"
            )
        if seen_batch < batch:
            earliest = max(earliest, seen_index + num_stages)
    return earliest


def _advance(last_seen: dict[int, tuple[int, int]], batches: Mapping[int, int], index: int) -> None:
    for adapter, batch in batches.items():
        last_seen[adapter] = (batch, index)


def insert_noops(
    microbatches: Sequence[Microbatch],
    global_batch_size: Mapping[int, int],
    num_stages: int,
    state: LemmaState = LemmaState(),
) -> tuple[list[Microbatch], LemmaState]:
    """The microbatches with empty ones inserted wherever the lemma needs a longer gap."""
    out: list[Microbatch] = []
    index, last_seen = state.next_index, dict(state.last_seen)
    for mb in microbatches:
        batches = batches_in(mb, global_batch_size)
        need = earliest_index(batches, last_seen, num_stages)
        out.extend(() for _ in range(max(0, need - index)))
        index = max(index, need)
        _advance(last_seen, batches, index)
        out.append(mb)
        index += 1
    return out, LemmaState(index, last_seen)


def count_noops(
    microbatches: Sequence[Microbatch],
    global_batch_size: Mapping[int, int],
    num_stages: int,
    state: LemmaState = LemmaState(),
) -> int:
    """How many no-ops `insert_noops` would add (the existing empty ones excluded)."""
    fixed, _ = insert_noops(microbatches, global_batch_size, num_stages, state)
    return len(fixed) - len(microbatches)


def lemma_violations(
    microbatches: Sequence[Microbatch],
    global_batch_size: Mapping[int, int],
    num_stages: int,
    state: LemmaState = LemmaState(),
) -> list[str]:
    """Every place where a global batch enters too early or out of order (no fixing)."""
    problems: list[str] = []
    last_seen = dict(state.last_seen)
    for offset, mb in enumerate(microbatches):
        index = state.next_index + offset
        try:
            batches = batches_in(mb, global_batch_size)
            need = earliest_index(batches, last_seen, num_stages)
        except ScheduleError as err:
            problems.append(f"microbatch {index}: {err}")
            continue
        if need > index:
            problems.append(f"microbatch {index}: enters before {need} (bubble lemma)")
        _advance(last_seen, batches, index)
    return problems
