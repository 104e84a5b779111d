"""Bubble lemma checks, no-op insertion, cross-block merging and schedule verification."""

import pytest

from helpers_sched import assert_bubble_lemma
from jaxlora.scheduler.training.samples import Sample
from jaxlora.scheduler.training.lemma import (
    LemmaState,
    ScheduleError,
    count_noops,
    insert_noops,
    lemma_violations,
)
from jaxlora.scheduler.training.merging import merge_blocks
from jaxlora.scheduler.training.schedule import Schedule
from jaxlora.scheduler.training.verify import verify_schedule

GBS = {0: 2, 1: 2}  # samples 0,1 are batch 0; 2,3 batch 1


def s(adapter, index, tokens=100):
    return Sample(adapter, index, tokens)


@pytest.mark.parametrize("stages", range(1, 9))
def test_noops_make_room_between_global_batches(stages):
    mbs = [(s(0, 0), s(0, 1)), (s(0, 2),), (s(0, 3),)]
    fixed, state = insert_noops(mbs, GBS, stages)
    assert len(fixed) == 3 + (stages - 1)
    assert fixed[1 : stages] == [()] * (stages - 1)
    assert lemma_violations(fixed, GBS, stages) == []
    assert_bubble_lemma(fixed, GBS, stages)
    assert state.next_index == len(fixed) and state.last_seen[0] == (1, len(fixed) - 1)


def test_other_adapters_fill_the_gap_without_noops():
    mbs = [(s(0, 0),), (s(1, 0),), (s(1, 1),), (s(0, 2),)]
    assert count_noops(mbs, GBS, 4) == 1
    assert count_noops(mbs, GBS, 3) == 0
    assert lemma_violations(mbs, GBS, 4) == ["microbatch 3: enters before 4 (bubble lemma)"]


def test_state_carries_positions_across_chunks():
    state = LemmaState(next_index=10, last_seen={0: (0, 9)})
    fixed, new_state = insert_noops([(s(0, 2),)], GBS, 3, state)
    assert fixed == [(), (), (s(0, 2),)]
    assert new_state == LemmaState(13, {0: (1, 12)})


def test_unfixable_orders_raise():
    with pytest.raises(ScheduleError, match="one microbatch"):
        insert_noops([(s(0, 0), s(0, 2))], GBS, 1)
    with pytest.raises(ScheduleError, match="after batch"):
        insert_noops([(s(0, 2),), (s(0, 0),)], GBS, 1)
    assert len(lemma_violations([(s(0, 2),), (s(0, 0),)], GBS, 1)) == 1


def test_merge_moves_the_next_blocks_remainder_into_the_underfilled_microbatch():
    blocks = [[(s(0, 0, 900),), (s(0, 1, 100),)], [(s(1, 0, 900),), (s(1, 1, 100),)]]
    merged = merge_blocks(blocks, GBS, 1000, 1, num_stages=1)
    assert merged == [[(s(0, 0, 900),), (s(0, 1, 100), s(1, 1, 100))], [(s(1, 0, 900),)]]


def test_merge_respects_capacity_and_moves_what_fits():
    blocks = [[(s(0, 0, 700),)], [(s(1, 0, 200), s(1, 1, 200))]]
    merged = merge_blocks(blocks, GBS, 1000, 1, num_stages=1)
    assert merged == [[(s(0, 0, 700), s(1, 0, 200))], [(s(1, 1, 200),)]]


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_merge_never_pulls_a_next_batch_too_close(stages):
    # Adapter 0 batch 0 ends in microbatch 1; its batch 1 may enter at 1 + stages at the earliest.
    blocks = [[(s(0, 0, 500),), (s(0, 1, 100),)], [(s(1, 0, 100),)], [(s(0, 2, 100),)]]
    merged = merge_blocks(blocks, GBS, 1000, 1, num_stages=stages)
    flat = [mb for block in merged for mb in block]
    fixed, _ = insert_noops(flat, GBS, stages)
    assert_bubble_lemma(fixed, GBS, stages)
    assert all(not (s(0, 1, 100) in mb and s(0, 2, 100) in mb) for mb in flat)
    assert len(fixed) <= 4 + stages  # merging never costs extra slots


def test_verify_schedule_reports_every_kind_of_problem():
    good = Schedule(((s(0, 0), s(0, 1)), (s(0, 2), s(0, 3))), {0: {0: 0, 1: 1}})
    expected = [s(0, i) for i in range(4)]
    verify_schedule(good, expected, GBS, 1000, 1, num_stages=1)
    with pytest.raises(ScheduleError, match="bubble lemma"):
        verify_schedule(good, expected, GBS, 1000, 1, num_stages=2)
    with pytest.raises(ScheduleError, match="missing"):
        verify_schedule(good, expected + [s(1, 0)], GBS, 1000, 1, num_stages=1)
    twice = Schedule(((s(0, 0), s(0, 1)), (s(0, 2), s(0, 3), s(0, 3))), {0: {0: 0, 1: 1}})
    with pytest.raises(ScheduleError, match="2 times"):
        verify_schedule(twice, expected, GBS, 1000, 1, num_stages=1)
    with pytest.raises(ScheduleError, match="padded tokens"):
        verify_schedule(good, expected, GBS, 150, 1, num_stages=1)
    wrong_step = Schedule(good.microbatches, {0: {0: 1, 1: 1}})
    with pytest.raises(ScheduleError, match="completion"):
        verify_schedule(wrong_step, expected, GBS, 1000, 1, num_stages=1)
