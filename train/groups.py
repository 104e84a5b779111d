"""Training steps from the scheduler's microbatches. With the batch split over `data` devices one
step runs up to `width` microbatches side by side (one packed row each); their gradients add up
exactly as if they ran one after another, as long as no adapter steps its optimizer between them.
So a step never holds two global batches of one adapter, and never crosses a checkpoint boundary
(checkpoints land on the same microbatch index whatever the mesh, so a run resumes on another)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping

from jaxlora.scheduler.training.samples import Microbatch, batch_index


@dataclasses.dataclass
class StepGroup:
    """Microbatches [start, stop) of the schedule run as one step; `rows` the non-empty ones (one
    row each, at most `width`); `completed` the slots (adapter ids) whose global batch completes
    in this step, whose optimizer steps right after it."""

    start: int
    stop: int
    rows: list[Microbatch]
    completed: list[int]

    @property
    def samples(self) -> Microbatch:
        """All samples of the step as one microbatch (what the bubble lemma looks at)."""
        return tuple(sample for row in self.rows for sample in row)


class _Completions:
    """Counts each adapter's samples from the start of the schedule to see its global batches end."""

    def __init__(self, global_batch_size: Mapping[int, int]):
        self.sizes = global_batch_size
        self.seen = {adapter: 0 for adapter in global_batch_size}

    def completed(self, microbatch: Microbatch) -> list[int]:
        done = []
        for sample in microbatch:
            self.seen[sample.adapter_id] += 1
            if self.seen[sample.adapter_id] % self.sizes[sample.adapter_id] == 0:
                done.append(sample.adapter_id)
        return done


def _batches(microbatch: Microbatch, global_batch_size: Mapping[int, int]) -> dict[int, int]:
    return {sample.adapter_id: batch_index(sample, global_batch_size) for sample in microbatch}


def step_groups(microbatches: Iterable[Microbatch], width: int, global_batch_size: Mapping[int, int],
                checkpoint_every: int, start: int = 0) -> Iterator[StepGroup]:
    """The steps of the microbatches from index `start` on (those before only count towards the
    global batches), each closed when full, before a microbatch of an adapter's next global
    batch, or at a multiple of `checkpoint_every`."""
    completions = _Completions(global_batch_size)
    group: StepGroup | None = None
    open_batches: dict[int, int] = {}
    for index, microbatch in enumerate(microbatches):
        completed = completions.completed(microbatch)
        if index < start:
            continue
        batches = _batches(microbatch, global_batch_size)
        clash = any(open_batches.get(adapter, batch) != batch for adapter, batch in batches.items())
        if group is not None and (clash or (microbatch and len(group.rows) == width)):
            yield group
            group = None
        if group is None:
            group, open_batches = StepGroup(index, index, [], []), {}
        if microbatch:
            group.rows.append(microbatch)
        open_batches.update(batches)
        group.completed.extend(completed)
        group.stop = index + 1
        if group.stop % checkpoint_every == 0:
            yield group
            group = None
    if group is not None:
        yield group
