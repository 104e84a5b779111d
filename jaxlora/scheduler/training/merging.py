"""Merging across blocks (LoRAFusion §4.2.5, Algorithm 1 lines 12-14).

Blocks are the packed (global batch, adapter group) units in schedule order: batch-major,
groups in their fixed order. The last microbatch of a block is its underfilled one (stage 2
made it small); samples of the next block's smallest microbatch move into it, largest
first, while they fit the padded capacity and their adapter's previous global batch ended at
least S microbatches earlier (the bubble lemma, see `lemma`). When a donor microbatch
empties it disappears, which shifts everything after it one slot earlier; that is accepted
only when the pipeline slots (microbatches plus the no-ops they need) do not increase.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jaxlora.scheduler.training.samples import Microbatch, Sample, batch_index, padded_tokens
from jaxlora.scheduler.training.greedy import decreasing
from jaxlora.scheduler.training.lemma import LemmaState, count_noops


def _last_positions(
    flat: Sequence[Microbatch], global_batch_size: Mapping[int, int], state: LemmaState
) -> dict[tuple[int, int], int]:
    """(adapter, global batch) -> index of the last microbatch holding it."""
    last = {(a, batch): index for a, (batch, index) in state.last_seen.items()}
    for offset, mb in enumerate(flat):
        for sample in mb:
            key = (sample.adapter_id, batch_index(sample, global_batch_size))
            last[key] = state.next_index + offset
    return last


def _lemma_allows(
    sample: Sample, index: int, last: Mapping[tuple[int, int], int],
    global_batch_size: Mapping[int, int], num_stages: int,
) -> bool:
    previous = last.get((sample.adapter_id, batch_index(sample, global_batch_size) - 1))
    return previous is None or previous + num_stages <= index


def _move_into(
    receiver: Microbatch, donor: Microbatch, allowed, capacity: int, multiple: int
) -> tuple[Microbatch, Microbatch]:
    """Move donor samples (largest first) that are allowed and fit; return both microbatches."""
    grown, kept = list(receiver), []
    for sample in decreasing(donor):
        if allowed(sample) and padded_tokens(grown + [sample], multiple) <= capacity:
            grown.append(sample)
        else:
            kept.append(sample)
    return tuple(sorted(grown)), tuple(sorted(kept))


def _flat(blocks: Sequence[Sequence[Microbatch]]) -> list[Microbatch]:
    return [mb for block in blocks for mb in block]


def _merge_boundary(blocks, i, global_batch_size, capacity, multiple, num_stages, state) -> bool:
    """Move samples of block i+1's last microbatch into block i's last; True if it emptied."""
    flat = _flat(blocks)
    receiver_index = state.next_index + sum(len(b) for b in blocks[: i + 1]) - 1
    last = _last_positions(flat, global_batch_size, state)

    def allowed(sample: Sample) -> bool:
        return _lemma_allows(sample, receiver_index, last, global_batch_size, num_stages)

    grown, kept = _move_into(blocks[i][-1], blocks[i + 1][-1], allowed, capacity, multiple)
    if len(grown) == len(blocks[i][-1]):
        return False
    trial = [list(b) for b in blocks]
    trial[i][-1], trial[i + 1][-1] = grown, kept
    if not kept:
        trial[i + 1].pop()
        before = len(flat) + count_noops(flat, global_batch_size, num_stages, state)
        after = len(flat) - 1 + count_noops(_flat(trial), global_batch_size, num_stages, state)
        if after > before:
            return False
    blocks[:] = [b for b in trial if b]
    return not kept


def merge_blocks(
    blocks: Sequence[Sequence[Microbatch]],
    global_batch_size: Mapping[int, int],
    capacity: int,
    padding_multiple: int,
    num_stages: int,
    state: LemmaState = LemmaState(),
) -> list[list[Microbatch]]:
    """Blocks after cross-block merging; `state` describes the microbatches already emitted.

    After a donor empties, the same receiver tries the next donor (it may still have room).
    """
    work = [list(b) for b in blocks if b]
    i = 0
    while i < len(work) - 1:
        args = (global_batch_size, capacity, padding_multiple, num_stages, state)
        if not _merge_boundary(work, i, *args):
            i += 1
    return work
