"""Greedy packers and the two-stage HiGHS MILP for one (global batch, group) block."""

import time

import pytest

from helpers_sched import assert_exact_cover, assert_fits, block_samples
from jaxlora.scheduler.training import milp
from jaxlora.scheduler.training.samples import Sample, padded_tokens
from jaxlora.scheduler.training.greedy import first_fit_decreasing, per_adapter_first_fit
from jaxlora.scheduler.training.packing import pack_block, quality

WORKLOADS = ["xsum", "cnndm", "wikisum", "mixed", "het"]


def test_padding_rounds_each_adapter_segment_up():
    mb = (Sample(0, 0, 10), Sample(0, 1, 60), Sample(1, 0, 1))
    assert padded_tokens(mb, 64) == 128 + 64
    assert padded_tokens(mb, 1) == 71


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("capacity", [4096, 8192])
def test_greedy_packers_cover_once_and_fit(workload, capacity):
    samples = block_samples(workload, 4, 12, seed=3)
    for packer in (first_fit_decreasing, per_adapter_first_fit):
        packed = packer(samples, capacity, 64)
        assert_exact_cover(packed, samples)
        assert_fits(packed, capacity, 64)
    baseline = per_adapter_first_fit(samples, capacity, 64)
    assert all(len({s.adapter_id for s in mb}) == 1 for mb in baseline)


def test_oversized_sample_is_refused():
    with pytest.raises(ValueError, match="capacity"):
        first_fit_decreasing([Sample(0, 0, 4000)], 3968, 64)


def test_milp_beats_first_fit_decreasing_where_ffd_is_suboptimal():
    # FFD packs [4,4] [3,3,3] [3]; the optimum is [4,3,3] [4,3,3].
    samples = [Sample(0, i, n) for i, n in enumerate([4, 4, 3, 3, 3, 3])]
    assert len(first_fit_decreasing(samples, 10, 1)) == 3
    result = pack_block(samples, 10, 1, time_limit_s=5.0)
    assert result.source == "milp"
    assert len(result.microbatches) == 2
    assert_exact_cover(result.microbatches, samples)
    assert_fits(result.microbatches, 10, 1)


def test_stage_two_empties_the_smallest_microbatch():
    # Three microbatches either way. FFD: [9] [6,3] [5,2] (smallest 7); best: [9] [5,3,2] [6].
    samples = [Sample(0, i, n) for i, n in enumerate([9, 6, 5, 3, 2])]
    assert quality(first_fit_decreasing(samples, 10, 1), 1) == (3, 7)
    result = pack_block(samples, 10, 1, time_limit_s=5.0)
    assert result.source == "milp"
    assert quality(result.microbatches, 1) == (3, 6)
    assert padded_tokens(result.microbatches[-1], 1) == 6  # the underfilled one is last


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("capacity", [4096, 8192])
def test_milp_result_is_never_worse_than_greedy(workload, capacity):
    samples = block_samples(workload, 2, 8, seed=11)
    result = pack_block(samples, capacity, 64, time_limit_s=0.1)
    assert quality(result.microbatches, 64) <= result.greedy_quality
    assert result.greedy_quality == quality(first_fit_decreasing(samples, capacity, 64), 64)
    assert_exact_cover(result.microbatches, samples)
    assert_fits(result.microbatches, capacity, 64)
    loads = [padded_tokens(mb, 64) for mb in result.microbatches]
    assert loads == sorted(loads, reverse=True)


def test_solver_time_limit_is_honoured():
    samples = block_samples("mixed", 2, 40, seed=5)
    start = first_fit_decreasing(samples, 4096, 64)
    limit = 0.05
    for stage in (milp.min_bins, milp.min_smallest):
        began = time.perf_counter()
        outcome = stage(samples, 4096, 64, start, limit)
        wall = time.perf_counter() - began
        assert wall < limit + 0.5, (stage.__name__, wall, outcome.status)
    began = time.perf_counter()
    pack_block(samples, 4096, 64, time_limit_s=limit)
    assert time.perf_counter() - began < 2 * limit + 1.0


def test_greedy_only_mode_skips_the_solver():
    samples = block_samples("xsum", 2, 8, seed=1)
    result = pack_block(samples, 4096, 64, use_milp=False)
    assert result.source == "greedy" and result.milp_status == ()
