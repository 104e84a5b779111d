"""Data model of the training scheduler: samples, microbatches, per-adapter datasets.

A sample is (adapter_id, sample_index, num_tokens); sample_index is its position in the
adapter's dataset. Global batch j of adapter a is samples j*G_a .. (j+1)*G_a - 1 with
G_a = global_batch_size[a] (the last one may be shorter). A microbatch is a tuple of samples
whose **padded** size fits the token capacity: each adapter's tokens in a microbatch are
rounded up to a multiple P (the row tile of the fused multi-LoRA kernel), because every
adapter segment starts on a fresh tile. An empty microbatch is a pipeline no-op.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Sample:
    """One training sample of one adapter."""

    adapter_id: int
    sample_index: int
    num_tokens: int


Microbatch = tuple[Sample, ...]


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= value."""
    return -(-value // multiple) * multiple


def adapter_tokens(samples: Iterable[Sample]) -> dict[int, int]:
    """Real tokens per adapter."""
    totals: dict[int, int] = defaultdict(int)
    for sample in samples:
        totals[sample.adapter_id] += sample.num_tokens
    return dict(totals)


def padded_tokens(samples: Iterable[Sample], padding_multiple: int) -> int:
    """Tokens the microbatch occupies: each adapter's tokens rounded up to the multiple."""
    return sum(round_up(t, padding_multiple) for t in adapter_tokens(samples).values())


def real_tokens(samples: Iterable[Sample]) -> int:
    """Sum of the samples' tokens (no padding)."""
    return sum(sample.num_tokens for sample in samples)


def batch_index(sample: Sample, global_batch_size: Mapping[int, int]) -> int:
    """Global batch index of a sample."""
    return sample.sample_index // global_batch_size[sample.adapter_id]


@dataclass(frozen=True)
class TrainingData:
    """Sample lengths of every adapter's dataset (in training order) and its global batch size."""

    lengths: Mapping[int, tuple[int, ...]]
    global_batch_size: Mapping[int, int]

    def __post_init__(self) -> None:
        if set(self.lengths) != set(self.global_batch_size):
            raise ValueError("lengths and global_batch_size must name the same adapters")
        for adapter, size in self.global_batch_size.items():
            if size < 1:
                raise ValueError(f"adapter {adapter}: global batch size must be >= 1")
        for adapter, lengths in self.lengths.items():
            if any(n < 1 for n in lengths):
                raise ValueError(f"adapter {adapter}: every sample needs >= 1 token")

    @classmethod
    def from_lengths(
        cls, lengths: Mapping[int, Sequence[int]], global_batch_size: Mapping[int, int] | int
    ) -> TrainingData:
        """Build from any int sequences; an int batch size applies to every adapter."""
        sizes = global_batch_size
        if isinstance(sizes, int):
            sizes = {adapter: sizes for adapter in lengths}
        frozen = {a: tuple(int(n) for n in seq) for a, seq in sorted(lengths.items())}
        return cls(frozen, dict(sizes))

    @property
    def adapters(self) -> tuple[int, ...]:
        return tuple(sorted(self.lengths))

    def num_batches(self, adapter: int) -> int:
        return math.ceil(len(self.lengths[adapter]) / self.global_batch_size[adapter])

    @property
    def num_global_batches(self) -> int:
        """Global batch indices in use (adapters with less data drop out of later ones)."""
        return max((self.num_batches(a) for a in self.adapters), default=0)

    def mean_length(self, adapter: int) -> float:
        lengths = self.lengths[adapter]
        return sum(lengths) / len(lengths) if lengths else 0.0

    def global_batch(self, adapter: int, batch: int) -> tuple[Sample, ...]:
        """Samples of one adapter's global batch (empty past the end of its data)."""
        size = self.global_batch_size[adapter]
        lengths = self.lengths[adapter]
        stop = min((batch + 1) * size, len(lengths))
        return tuple(Sample(adapter, i, lengths[i]) for i in range(batch * size, stop))

    def all_samples(self) -> tuple[Sample, ...]:
        """Every sample of every adapter (what a schedule must contain exactly once)."""
        return tuple(
            Sample(adapter, i, n) for adapter in self.adapters
            for i, n in enumerate(self.lengths[adapter])
        )

    def batch_of(self, sample: Sample) -> int:
        """Global batch index of a sample."""
        return batch_index(sample, self.global_batch_size)
