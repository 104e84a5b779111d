"""Shared helpers of the scheduler tests: synthetic blocks and independent invariant checks."""

from collections import Counter

import numpy as np

from jaxlora.scheduler.training.samples import Sample, padded_tokens
from jaxlora.scheduler.training.workloads import adapter_datasets, dataset_lengths


def block_samples(workload: str, num_adapters: int, per_adapter: int, seed: int) -> list[Sample]:
    """One (global batch, group)-like block of lognormal samples."""
    rng = np.random.default_rng(seed)
    names = adapter_datasets(workload, num_adapters)
    return [
        Sample(a, i, int(n))
        for a, name in enumerate(names)
        for i, n in enumerate(dataset_lengths(rng, name, per_adapter))
    ]


def assert_exact_cover(microbatches, samples) -> None:
    counts = Counter(s for mb in microbatches for s in mb)
    assert set(counts) == set(samples)
    assert all(n == 1 for n in counts.values())


def assert_fits(microbatches, capacity: int, multiple: int) -> None:
    assert all(padded_tokens(mb, multiple) <= capacity for mb in microbatches)


def assert_bubble_lemma(microbatches, global_batch_size, num_stages: int) -> None:
    """Written from the paper's statement, independently of jaxlora's lemma module."""
    first, last = {}, {}
    for index, mb in enumerate(microbatches):
        for s in mb:
            key = (s.adapter_id, s.sample_index // global_batch_size[s.adapter_id])
            first.setdefault(key, index)
            last[key] = index
    for (adapter, batch), start in first.items():
        if (adapter, batch - 1) in last:
            assert start >= last[(adapter, batch - 1)] + num_stages, (adapter, batch)
