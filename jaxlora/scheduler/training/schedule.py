"""Training schedules: pack, merge, verify and fix (LoRAFusion Algorithm 1, end to end).

`pack_window` is the expensive part (one two-stage MILP per (global batch, group) block) and
is what runs in worker processes. `Finalizer` is the cheap sequential part: it merges across
block boundaries, inserts no-ops, verifies, and emits `Schedule` chunks with absolute
microbatch indices. It keeps the last block back until the next blocks arrive, because that
block's underfilled microbatch may still take samples of the next global batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from jaxlora.scheduler.training.samples import (
    Microbatch, Sample, TrainingData, batch_index, real_tokens,
)
from jaxlora.scheduler.training.grouping import group_adapters
from jaxlora.scheduler.training.lemma import LemmaState, insert_noops
from jaxlora.scheduler.training.merging import merge_blocks
from jaxlora.scheduler.training.packing import PackResult, pack_block
from jaxlora.scheduler.training.verify import check_chunk


@dataclass(frozen=True)
class SchedulerConfig:
    """Token capacity, pipeline stages S, padding multiple P, MILP time limit per stage."""

    capacity: int
    num_stages: int = 1
    padding_multiple: int = 64
    time_limit_s: float = 1.0
    group_size: int = 2
    use_milp: bool = True
    merge: bool = True

    def __post_init__(self) -> None:
        if self.capacity < self.padding_multiple or self.padding_multiple < 1:
            raise ValueError("need capacity >= padding_multiple >= 1")
        if self.num_stages < 1 or self.time_limit_s <= 0:
            raise ValueError("need num_stages >= 1 and a positive time limit")


@dataclass(frozen=True)
class Schedule:
    """Microbatches (empty = no-op) from index `first_index` on, and optimizer-step points.

    completions[adapter][global_batch] is the index of the microbatch after whose backward
    that adapter's global batch is complete, i.e. when the trainer steps its optimizer.
    """

    microbatches: tuple[Microbatch, ...]
    completions: Mapping[int, Mapping[int, int]] = field(default_factory=dict)
    first_index: int = 0

    @property
    def num_noops(self) -> int:
        return sum(1 for mb in self.microbatches if not mb)

    def completing_at(self, index: int) -> tuple[tuple[int, int], ...]:
        """(adapter, global batch) pairs whose optimizer step follows microbatch `index`."""
        return tuple(
            (adapter, batch)
            for adapter, done in sorted(self.completions.items())
            for batch, at in sorted(done.items())
            if at == index
        )

    def padding_waste(self, capacity: int) -> float:
        """1 - real tokens / (microbatches * capacity), no-ops counted as microbatches."""
        if not self.microbatches:
            return 0.0
        used = sum(real_tokens(mb) for mb in self.microbatches)
        return 1.0 - used / (len(self.microbatches) * capacity)


def concat(chunks: Iterable[Schedule]) -> Schedule:
    """One schedule from consecutive chunks (as the trainer would see them)."""
    microbatches: list[Microbatch] = []
    completions: dict[int, dict[int, int]] = {}
    first = None
    for chunk in chunks:
        first = chunk.first_index if first is None else first
        microbatches.extend(chunk.microbatches)
        for adapter, done in chunk.completions.items():
            completions.setdefault(adapter, {}).update(done)
    return Schedule(tuple(microbatches), completions, first or 0)


def adapter_groups(data: TrainingData, group_size: int) -> tuple[tuple[int, ...], ...]:
    """Head-tail groups from each adapter's mean sample length over its whole dataset."""
    return group_adapters({a: data.mean_length(a) for a in data.adapters}, group_size)


def window_samples(data: TrainingData, batches: Iterable[int]) -> list[tuple[Sample, ...]]:
    """All adapters' samples of each global batch index."""
    return [sum((data.global_batch(a, j) for a in data.adapters), ()) for j in batches]


def pack_window(
    batches: Sequence[Sequence[Sample]], groups: Sequence[Sequence[int]], config: SchedulerConfig
) -> list[PackResult]:
    """Pack every (global batch, group) block in schedule order (empty blocks dropped)."""
    results = []
    for samples in batches:
        for group in groups:
            members = [s for s in samples if s.adapter_id in group]
            if members:
                results.append(pack_block(
                    members, config.capacity, config.padding_multiple,
                    config.time_limit_s, config.use_milp,
                ))
    return results


def _completions(microbatches: Sequence[Microbatch], first_index: int, gbs: Mapping[int, int]):
    done: dict[int, dict[int, int]] = {}
    for offset, mb in enumerate(microbatches):
        for sample in mb:
            done.setdefault(sample.adapter_id, {})[batch_index(sample, gbs)] = first_index + offset
    return done


class Finalizer:
    """Sequential merge + no-op insertion + verification over a stream of packed blocks."""

    def __init__(self, global_batch_size: Mapping[int, int], config: SchedulerConfig) -> None:
        self.gbs = dict(global_batch_size)
        self.config = config
        self.state = LemmaState()
        self.held: list[list[Microbatch]] = []
        self.seen: set[Sample] = set()

    def _merge(self, blocks: list[list[Microbatch]]) -> list[list[Microbatch]]:
        if not self.config.merge:
            return blocks
        cfg = self.config
        return merge_blocks(
            blocks, self.gbs, cfg.capacity, cfg.padding_multiple, cfg.num_stages, self.state
        )

    def _emit(self, blocks: Sequence[Sequence[Microbatch]]) -> Schedule:
        flat = [mb for block in blocks for mb in block]
        start = self.state
        fixed, self.state = insert_noops(flat, self.gbs, self.config.num_stages, start)
        cfg = self.config
        check_chunk(
            fixed, self.gbs, cfg.capacity, cfg.padding_multiple, cfg.num_stages, start, self.seen
        )
        completions = _completions(fixed, start.next_index, self.gbs)
        return Schedule(tuple(fixed), completions, start.next_index)

    def push(self, packed: Sequence[PackResult]) -> Schedule:
        """Add the next packed blocks; emit everything but the (new) last block."""
        blocks = self._merge(self.held + [list(p.microbatches) for p in packed])
        self.held = blocks[-1:]
        return self._emit(blocks[:-1])

    def flush(self) -> Schedule:
        """Emit the held-back block (end of training data)."""
        blocks, self.held = self.held, []
        return self._emit(blocks)


def build_schedule(data: TrainingData, config: SchedulerConfig) -> Schedule:
    """The whole training schedule, computed in this process."""
    groups = adapter_groups(data, config.group_size)
    packed = pack_window(window_samples(data, range(data.num_global_batches)), groups, config)
    finalizer = Finalizer(data.global_batch_size, config)
    return concat([finalizer.push(packed), finalizer.flush()])
