"""End-to-end training schedules on the synthetic workloads, for 1-8 pipeline stages."""

import dataclasses

import pytest

from helpers_sched import assert_bubble_lemma, assert_exact_cover, assert_fits
from jaxlora.scheduler.training.samples import TrainingData
from jaxlora.scheduler.training.greedy import per_adapter_first_fit
from jaxlora.scheduler.training.schedule import (
    Finalizer,
    Schedule,
    SchedulerConfig,
    adapter_groups,
    build_schedule,
    concat,
    pack_window,
    window_samples,
)
from jaxlora.scheduler.training.verify import verify_schedule
from jaxlora.scheduler.training.workloads import WORKLOADS, synthetic_data

GLOBAL_BATCH = 6


def all_samples(data: TrainingData):
    expected = [s for a in data.adapters for j in range(data.num_batches(a))
                for s in data.global_batch(a, j)]
    assert sorted(expected) == sorted(data.all_samples())
    return expected


@pytest.fixture(scope="module")
def packed():
    """Packing does not depend on the stage count: pack each (workload, capacity) once."""
    out = {}
    for workload in WORKLOADS:
        data = synthetic_data(workload, 4, 3 * GLOBAL_BATCH, GLOBAL_BATCH, seed=7)
        for capacity in (4096, 8192):
            config = SchedulerConfig(capacity=capacity, time_limit_s=0.05)
            groups = adapter_groups(data, 2)
            batches = window_samples(data, range(data.num_global_batches))
            blocks = pack_window(batches, groups, config)
            out[(workload, capacity)] = (data, config, blocks)
    return out


@pytest.mark.parametrize("stages", range(1, 9))
@pytest.mark.parametrize("workload", WORKLOADS)
def test_schedule_is_valid_for_every_stage_count(packed, workload, stages):
    for capacity in (4096, 8192):
        data, config, blocks = packed[(workload, capacity)]
        config = dataclasses.replace(config, num_stages=stages)
        finalizer = Finalizer(data.global_batch_size, config)
        schedule = concat([finalizer.push(blocks), finalizer.flush()])
        verify_schedule(schedule, all_samples(data), data.global_batch_size, capacity, 64, stages)
        assert_exact_cover([mb for mb in schedule.microbatches if mb], all_samples(data))
        assert_fits(schedule.microbatches, capacity, 64)
        assert_bubble_lemma(schedule.microbatches, data.global_batch_size, stages)
        assert set(schedule.completions) == set(data.adapters)
        assert all(len(done) == 3 for done in schedule.completions.values())


def test_merging_and_milp_never_cost_microbatches(packed):
    for (workload, capacity), (data, config, blocks) in packed.items():
        plain = Finalizer(data.global_batch_size, dataclasses.replace(config, merge=False))
        merged = Finalizer(data.global_batch_size, config)
        without = concat([plain.push(blocks), plain.flush()])
        with_merge = concat([merged.push(blocks), merged.flush()])
        assert len(with_merge.microbatches) <= len(without.microbatches)
        baseline = sum(
            len(per_adapter_first_fit(data.global_batch(a, j), capacity, 64))
            for a in data.adapters for j in range(data.num_batches(a))
        )
        assert len(with_merge.microbatches) <= baseline, (workload, capacity)


def test_build_schedule_with_uneven_adapters_and_batch_sizes():
    lengths = {0: [300] * 7, 1: [2000] * 3, 2: [50] * 10}
    data = TrainingData.from_lengths(lengths, {0: 3, 1: 1, 2: 4})
    for stages in (1, 3):
        for use_milp in (False, True):
            config = SchedulerConfig(
                capacity=4096, num_stages=stages, time_limit_s=0.05, use_milp=use_milp
            )
            schedule = build_schedule(data, config)
            verify_schedule(schedule, all_samples(data), data.global_batch_size, 4096, 64, stages)
            assert {a: len(d) for a, d in schedule.completions.items()} == {0: 3, 1: 3, 2: 3}


def test_completing_at_lists_optimizer_steps():
    schedule = Schedule(((), ()), {0: {0: 1, 1: 4}, 2: {0: 1}})
    assert schedule.completing_at(1) == ((0, 0), (2, 0))
    assert schedule.completing_at(0) == ()
    assert schedule.num_noops == 2


def test_padding_waste_counts_noops():
    data = synthetic_data("xsum", 2, 4, 4, seed=0)
    schedule = build_schedule(data, SchedulerConfig(capacity=4096, use_milp=False))
    real = sum(data.lengths[0]) + sum(data.lengths[1])
    expected = 1 - real / (len(schedule.microbatches) * 4096)
    assert schedule.padding_waste(4096) == pytest.approx(expected)


@pytest.mark.parametrize(
    "kwargs",
    [dict(capacity=32), dict(capacity=4096, num_stages=0), dict(capacity=4096, time_limit_s=0)],
)
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        SchedulerConfig(**kwargs)


def test_training_data_validation():
    with pytest.raises(ValueError):
        TrainingData.from_lengths({0: [10]}, {1: 2})
    with pytest.raises(ValueError):
        TrainingData.from_lengths({0: [0]}, 1)
    with pytest.raises(ValueError):
        TrainingData.from_lengths({0: [10]}, 0)
