"""Synthetic training workloads: lognormal sample lengths, no downloads (docs/architecture.md,
"Benchmark workloads").

Lengths are document+summary tokens, clipped to [min_tokens, 4096]. "mixed" draws each sample
from one of the three datasets at random; "het" gives adapter i the i-th of
(xsum, cnndm, wikisum, mixed), as in LoRAFusion's heterogeneous setting.
"""

from __future__ import annotations

import numpy as np

from jaxlora.scheduler.training.samples import TrainingData

DATASETS: dict[str, tuple[float, float]] = {
    "xsum": (450.0, 0.55),
    "cnndm": (800.0, 0.50),
    "wikisum": (1600.0, 0.60),
}
WORKLOADS = ("xsum", "cnndm", "wikisum", "mixed", "het")
HET_ORDER = ("xsum", "cnndm", "wikisum", "mixed")
MAX_TOKENS = 4096


def dataset_lengths(
    rng: np.random.Generator, dataset: str, count: int, min_tokens: int = 16
) -> np.ndarray:
    """`count` lengths of one dataset ("mixed" picks a dataset per sample)."""
    if dataset == "mixed":
        names = rng.choice(sorted(DATASETS), size=count)
        medians = np.array([DATASETS[n][0] for n in names])
        sigmas = np.array([DATASETS[n][1] for n in names])
    else:
        median, sigma = DATASETS[dataset]
        medians, sigmas = np.full(count, median), np.full(count, sigma)
    raw = rng.lognormal(np.log(medians), sigmas)
    return np.clip(np.rint(raw), min_tokens, MAX_TOKENS).astype(np.int64)


def adapter_datasets(workload: str, num_adapters: int) -> tuple[str, ...]:
    """Which dataset each adapter trains on."""
    if workload == "het":
        return tuple(HET_ORDER[i % len(HET_ORDER)] for i in range(num_adapters))
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {WORKLOADS}")
    return (workload,) * num_adapters


def synthetic_data(
    workload: str,
    num_adapters: int,
    samples_per_adapter: int,
    global_batch_size: int,
    seed: int = 0,
) -> TrainingData:
    """A `TrainingData` of the named workload, reproducible from the seed."""
    rng = np.random.default_rng(seed)
    lengths = {
        adapter: dataset_lengths(rng, name, samples_per_adapter).tolist()
        for adapter, name in enumerate(adapter_datasets(workload, num_adapters))
    }
    return TrainingData.from_lengths(lengths, global_batch_size)
