"""Greedy packers: first-fit decreasing (the MILP's fallback) and the per-adapter baseline.

Both respect the padded capacity: an adapter's tokens inside one microbatch are rounded up
to the padding multiple P, so adding a sample costs round_up(old + n) - round_up(old).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxlora.scheduler.training.samples import Microbatch, Sample, round_up


class _OpenBin:
    """A microbatch being filled: its samples, per-adapter tokens and padded load."""

    def __init__(self, capacity: int, padding_multiple: int) -> None:
        self.capacity = capacity
        self.multiple = padding_multiple
        self.samples: list[Sample] = []
        self.tokens: dict[int, int] = {}
        self.load = 0

    def cost(self, sample: Sample) -> int:
        old = self.tokens.get(sample.adapter_id, 0)
        return round_up(old + sample.num_tokens, self.multiple) - round_up(old, self.multiple)

    def fits(self, sample: Sample) -> bool:
        return self.load + self.cost(sample) <= self.capacity

    def add(self, sample: Sample) -> None:
        self.load += self.cost(sample)
        self.tokens[sample.adapter_id] = self.tokens.get(sample.adapter_id, 0) + sample.num_tokens
        self.samples.append(sample)


def check_fits_alone(samples: Sequence[Sample], capacity: int, padding_multiple: int) -> None:
    """Raise if some sample cannot fit an empty microbatch."""
    for sample in samples:
        if round_up(sample.num_tokens, padding_multiple) > capacity:
            raise ValueError(
                f"sample {sample} needs {round_up(sample.num_tokens, padding_multiple)} "
                f"padded tokens, more than the capacity {capacity}"
            )


def first_fit(
    samples: Sequence[Sample], capacity: int, padding_multiple: int
) -> list[Microbatch]:
    """Put each sample, in the given order, into the first microbatch it fits."""
    check_fits_alone(samples, capacity, padding_multiple)
    bins: list[_OpenBin] = []
    for sample in samples:
        target = next((b for b in bins if b.fits(sample)), None)
        if target is None:
            target = _OpenBin(capacity, padding_multiple)
            bins.append(target)
        target.add(sample)
    return [tuple(b.samples) for b in bins]


def decreasing(samples: Sequence[Sample]) -> list[Sample]:
    """Samples longest first (ties by adapter and index, for determinism)."""
    return sorted(samples, key=lambda s: (-s.num_tokens, s.adapter_id, s.sample_index))


def first_fit_decreasing(
    samples: Sequence[Sample], capacity: int, padding_multiple: int
) -> list[Microbatch]:
    """First-fit decreasing over all samples of all adapters (mixing adapters freely)."""
    return first_fit(decreasing(samples), capacity, padding_multiple)


def per_adapter_first_fit(
    samples: Sequence[Sample], capacity: int, padding_multiple: int
) -> list[Microbatch]:
    """Baseline: one adapter at a time, its samples in data order, first-fit; no mixing."""
    adapters = sorted({s.adapter_id for s in samples})
    packed: list[Microbatch] = []
    for adapter in adapters:
        own = [s for s in samples if s.adapter_id == adapter]
        packed.extend(first_fit(own, capacity, padding_multiple))
    return packed
