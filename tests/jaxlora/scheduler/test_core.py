"""The scheduler core: work items, token capacity, the co-scheduling policy, and the serving
policy's steps described as work items."""

import pytest

from jaxlora.scheduler.core import (DECODE, IDLE, PREFILL, SERVE, TRAIN, TRAINING_ONLY, CoSchedulePolicy, ServingLoad,
                                    TokenCapacity, WorkItem)
from jaxlora.scheduler.serving import SchedulerConfig, Sequence, ServingScheduler

MICROBATCH = WorkItem(TRAIN, 0, 100)


def test_serving_first_training_on_idle_steps():
    policy = CoSchedulePolicy()
    assert policy.next_kind(IDLE, MICROBATCH) == TRAIN
    assert policy.next_kind(ServingLoad(waiting=1), MICROBATCH) == SERVE
    assert policy.next_kind(ServingLoad(running=1), MICROBATCH) == SERVE
    assert policy.next_kind(ServingLoad(running=1), None) == SERVE
    assert policy.next_kind(IDLE, None) is None
    assert TRAINING_ONLY.next_kind(IDLE, MICROBATCH) == TRAIN


def test_train_below_lets_training_run_under_light_load():
    policy = CoSchedulePolicy(train_below=2)
    assert policy.next_kind(ServingLoad(running=2), MICROBATCH) == TRAIN
    assert policy.next_kind(ServingLoad(running=3), MICROBATCH) == SERVE
    assert policy.next_kind(ServingLoad(waiting=1, running=1), MICROBATCH) == SERVE  # a waiting request goes first
    with pytest.raises(ValueError):
        CoSchedulePolicy(train_below=-1)


def test_tpot_target_keeps_training_out_of_decode_steps_it_would_push_late():
    policy = CoSchedulePolicy(train_below=4, tpot_target_s=0.05)
    assert policy.next_kind(ServingLoad(running=2, step_s=0.02), MICROBATCH, training_s=0.02) == TRAIN
    assert policy.next_kind(ServingLoad(running=2, step_s=0.02), MICROBATCH, training_s=0.04) == SERVE
    assert policy.next_kind(IDLE, MICROBATCH, training_s=10.0) == TRAIN  # idle: nothing to delay
    with pytest.raises(ValueError):
        CoSchedulePolicy(tpot_target_s=0)


def test_capacity_and_items_are_checked():
    capacity = TokenCapacity(8)
    capacity.check([WorkItem(PREFILL, None, 5), WorkItem(DECODE, "a", 3)])
    with pytest.raises(ValueError, match="9 tokens overflows its capacity of 8"):
        capacity.check([WorkItem(PREFILL, None, 5), WorkItem(DECODE, "a", 4)])
    with pytest.raises(ValueError, match="kind"):
        WorkItem("sleep", None, 1)
    with pytest.raises(ValueError):
        TokenCapacity(0)


def test_serving_steps_are_work_items_within_the_budget():
    scheduler = ServingScheduler(SchedulerConfig(num_pages=16, page_size=4, num_adapter_slots=2, max_num_seqs=4,
                                                 token_budget=8, prefill_chunk=8))
    scheduler.add(Sequence("a", list(range(1, 7)), 3, None, frozenset()))
    scheduler.add(Sequence("b", list(range(1, 4)), 3, None, frozenset()))
    first = scheduler.schedule()
    assert [(i.kind, i.tokens) for i in first.work_items()] == [(PREFILL, 6), (PREFILL, 2)]
    second = scheduler.schedule()
    kinds = [i.kind for i in second.work_items()]
    assert DECODE in kinds and sum(i.tokens for i in second.work_items()) <= 8
