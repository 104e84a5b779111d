"""Punica placement on scripted replica states (largest batch with room wins, full/draining
replicas skipped, adapter affinity breaks ties, then the replica id), and the scheduler's
growing-KV mode that preempts the newest running request when the page pool runs out."""

import pytest

from jaxlora.scheduler.serving import (
    PENDING, ReplicaState, RoundRobin, SchedulerConfig, Sequence, ServingScheduler, Status, place,
)


def _state(replica_id, batch, free_pages=100, max_batch=8, adapters=(), **kw):
    return ReplicaState(replica_id, batch, max_batch, free_pages, page_size=4, adapters=frozenset(adapters), **kw)


def test_the_largest_batch_with_room_wins():
    states = [_state(0, 2), _state(1, 5), _state(2, 3), _state(3, 0)]
    assert place(states, tokens=10, max_len=20) == 1
    assert place(states, 10, 20, exclude=[1]) == 2  # migration: never back to its source


def test_full_replicas_are_skipped():
    states = [_state(0, 8), _state(1, 7, free_pages=4), _state(2, 3, free_pages=5), _state(3, 1)]
    # replica 0: batch at its maximum; replica 1: 20 tokens need 5 pages, 4 free
    assert place(states, tokens=10, max_len=20) == 2
    assert place([_state(0, 8), _state(1, 2, free_pages=1)], 10, 20) is None
    growing = _state(1, 7, free_pages=3, reserve_output=False)  # admission takes prompt + 1 only: 3 pages
    assert place([growing, _state(2, 3)], 10, 20) == 1


def test_draining_and_unhealthy_replicas_get_nothing():
    states = [_state(0, 6, draining=True), _state(1, 5, healthy=False), _state(2, 1)]
    assert place(states, 4, 8) == 2


def test_adapter_affinity_breaks_ties_then_the_replica_id():
    states = [_state(0, 3), _state(1, 3, adapters={"b"}), _state(2, 3, adapters={"a"}), _state(3, 2, adapters={"a"})]
    assert place(states, 4, 8, adapter="a") == 2
    assert place(states, 4, 8, adapter="b") == 1
    assert place(states, 4, 8, adapter="c") == 0 and place(states, 4, 8) == 0
    assert place([_state(1, 1, adapters={"a"}), _state(0, 2)], 4, 8, adapter="a") == 0  # batch first


def test_round_robin_takes_turns_among_replicas_with_room():
    states = [_state(0, 8), _state(1, 0), _state(2, 0), _state(3, 0)]
    policy = RoundRobin()
    assert [policy(states, 4, 8) for _ in range(5)] == [1, 2, 3, 1, 2]  # replica 0 is full
    assert policy(states, 4, 8, exclude=[3]) == 1


def _scheduler(num_pages, reserve_output=False):
    return ServingScheduler(SchedulerConfig(num_pages=num_pages, page_size=4, num_adapter_slots=2, max_num_seqs=4,
                                            token_budget=32, prefill_chunk=16, reserve_output=reserve_output))


def _step(scheduler, token=3):
    plan = scheduler.schedule()
    scheduler.complete(plan, {row.seq.seq_id: token for row in plan.rows if row.sample})
    return plan


def test_growing_kv_preempts_the_newest_request_and_recomputes_it():
    s = _scheduler(num_pages=4)
    old, new = Sequence("old", [1] * 7, max_tokens=6), Sequence("new", [2] * 6, max_tokens=6)
    s.add(old)
    s.add(new)
    _step(s)  # both admitted with the pages of prompt + 1: 2 pages each
    assert s.pages.num_free == 0 and [q.seq_id for q in s.running] == ["old", "new"]
    assert _step(s).preempted == []  # positions 7 and 6: still in their second pages
    plan = s.schedule()  # old writes position 8: a third page; none free -> the newest goes
    assert [q.seq_id for q in plan.preempted] == ["new"] and new.status is Status.WAITING
    assert new.pages == [] and new.num_computed == 0 and new.output == [3, 3] and PENDING not in new.output
    s.complete(plan, {"old": 3})
    assert [r.seq.seq_id for r in plan.rows] == ["old"] and len(old.pages) == 3
    while old.status is not Status.FINISHED:
        _step(s)
    plan = _step(s)  # re-admitted: one prefill row over prompt + the output it has
    assert [(r.seq.seq_id, r.start, r.count, r.sample) for r in plan.rows] == [("new", 0, 8, True)]
    while s.has_work():
        _step(s)
    assert new.output == [3] * 6 and s.pages.num_free == 4


def test_the_newest_request_short_of_a_page_preempts_itself():
    s = _scheduler(num_pages=3)
    a, b = Sequence("a", [1] * 4, max_tokens=8), Sequence("b", [1] * 3, max_tokens=8)  # 2 and 1 pages
    s.add(a)
    s.add(b)
    _step(s)
    _step(s)
    plan = _step(s)  # b writes position 4: a second page; it is the newest itself
    assert [q.seq_id for q in plan.preempted] == ["b"] and [r.seq.seq_id for r in plan.rows] == ["a"]
    assert s.waiting == [b] and s.pages.num_free == 1


def test_reserving_admission_never_preempts():
    s = _scheduler(num_pages=4, reserve_output=True)
    s.add(Sequence("a", [1] * 7, max_tokens=6))
    s.add(Sequence("b", [1] * 6, max_tokens=6))  # 12 tokens: 3 pages; only 1 left after a's 4
    while s.has_work():
        assert _step(s).preempted == []
    assert s.pages.num_free == 4


@pytest.mark.parametrize("reserve_output", [True, False])
def test_early_abort_spares_preempted_requests_with_output(reserve_output):
    s = _scheduler(num_pages=4, reserve_output=reserve_output)
    started = Sequence("started", [1] * 3, max_tokens=4, output=[5])
    fresh = Sequence("fresh", [1] * 3, max_tokens=4)
    s.add(started)
    s.add(fresh)
    assert s.expire(now=100.0, ttft_slo_s=1.0) == [fresh] and s.waiting == [started]
