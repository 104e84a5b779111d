"""The serving policy alone (no model): token budget, page admission, grouping, LRU adapter slots."""

import pytest

from jaxlora.scheduler.serving import AdapterSlots, PageAllocator, SchedulerConfig, Sequence, ServingScheduler, Status


def _scheduler(**kw):
    config = dict(num_pages=8, page_size=4, num_adapter_slots=2, max_num_seqs=4, token_budget=16, prefill_chunk=8)
    config.update(kw)
    return ServingScheduler(SchedulerConfig(**config))


def _run_step(scheduler, token=1):
    plan = scheduler.schedule()
    sampled = {row.seq.seq_id: token for row in plan.rows if row.sample}
    return plan, scheduler.complete(plan, sampled)


def test_prefill_is_chunked_and_decode_rows_come_first():
    s = _scheduler()
    s.add(Sequence("long", list(range(1, 13)), max_tokens=4))
    plan, _ = _run_step(s)
    assert [(r.start, r.count, r.sample) for r in plan.rows] == [(0, 8, False)]
    plan, events = _run_step(s)
    assert [(r.start, r.count, r.sample) for r in plan.rows] == [(8, 4, True)] and events[0][1] == 1
    s.add(Sequence("new", [5, 6, 7], max_tokens=2))
    plan, _ = _run_step(s)
    assert [(r.seq.seq_id, r.count) for r in plan.rows] == [("long", 1), ("new", 3)]


def test_token_budget_bounds_each_step():
    s = _scheduler(num_pages=64, token_budget=10, max_num_seqs=8)
    for i in range(5):
        s.add(Sequence(i, [1] * 6, max_tokens=3))
    while s.has_work():
        plan, _ = _run_step(s)
        assert 0 < plan.num_tokens <= 10


def test_admission_waits_for_pages_and_pages_come_back():
    s = _scheduler(num_pages=4, page_size=4)
    s.add(Sequence("a", [1] * 8, max_tokens=4))  # 12 tokens: 3 pages
    s.add(Sequence("b", [1] * 4, max_tokens=4))  # 2 pages: must wait
    _run_step(s)
    assert [q.seq_id for q in s.running] == ["a"] and [q.seq_id for q in s.waiting] == ["b"]
    assert s.pages.num_free == 1
    s.finish(s.running[0], "abort")
    assert s.pages.num_free == 4
    _run_step(s)
    assert [q.seq_id for q in s.running] == ["b"]


def test_sequences_finish_on_eos_or_length():
    s = _scheduler()
    s.add(Sequence("eos", [1, 2], max_tokens=5, eos_ids=frozenset({7})))
    s.add(Sequence("len", [1, 2], max_tokens=2))
    reasons = {}
    for _ in range(4):
        _, events = _run_step(s, token=7)
        reasons.update({seq.seq_id: reason for seq, _, reason in events if reason})
    assert reasons == {"eos": "stop", "len": "length"} and not s.has_work() and s.pages.num_free == 8


def test_rows_are_grouped_by_adapter_slot_base_last():
    s = _scheduler(num_pages=64, max_num_seqs=8, token_budget=64)
    for i, adapter in enumerate(["x", None, "y", "x", None, "y"]):
        s.add(Sequence(i, [1, 2], max_tokens=2, adapter=adapter))
    plan = s.schedule()
    slots = [row.slot for row in plan.rows]
    assert slots == sorted(slots, key=lambda v: (v < 0, v)) and slots.count(-1) == 2
    assert sorted(key for _, key in plan.loads) == ["x", "y"]


def test_lru_never_evicts_pinned_adapters_and_queue_skips_ahead():
    s = _scheduler(num_pages=64, num_adapter_slots=1, max_num_seqs=8)
    s.add(Sequence("a1", [1, 2], max_tokens=3, adapter="a"))
    s.add(Sequence("b1", [1, 2], max_tokens=3, adapter="b"))  # its adapter cannot get the only slot yet
    s.add(Sequence("a2", [1, 2], max_tokens=3, adapter="a"))  # may pass b1: "a" is on the device
    plan = s.schedule()
    assert [r.seq.seq_id for r in plan.rows] == ["a1", "a2"] and plan.loads == [(0, "a")]
    assert s.prefetch() == []  # "a" is pinned: nothing to evict
    while s.running:
        _run_step(s)
    assert s.prefetch() == [(0, "b")]  # queued b1's adapter goes in once "a" is unpinned


def test_prefetch_looks_only_as_far_as_the_next_steps_can_start():
    def queued(**kw):
        s = _scheduler(num_pages=64, num_adapter_slots=16, max_num_seqs=8, token_budget=8, **kw)
        for i in range(10):
            s.add(Sequence(i, [1] * 6, max_tokens=2, adapter=f"a{i}"))
        return s

    # two budgets of 8 tokens: requests starting at tokens 0, 6 and 12 (< 16); the fourth starts at 18
    assert [key for _, key in queued(prefetch_steps=2).prefetch()] == ["a0", "a1", "a2"]
    assert [key for _, key in queued(prefetch_steps=1).prefetch()] == ["a0", "a1"]
    assert len(queued().prefetch()) == 10  # the default: the whole queue
    s = queued(prefetch_steps=2)
    s.is_ready = lambda key: key not in ("a0", "a1")  # still being read: passed over, not counted
    assert [key for _, key in s.prefetch()] == ["a2", "a3", "a4"]
    with pytest.raises(ValueError, match="prefetch_steps"):
        _scheduler(prefetch_steps=-1)


def test_adapter_slots_lru_order():
    slots = AdapterSlots(2)
    assert slots.place("a") == (0, True) and slots.place("b") == (1, True)
    slots.touch("a")
    assert slots.place("c") == (1, True)  # "b" was least recently used
    slots.pin("a")
    assert slots.place("d") == (1, True)  # "a" is pinned
    with pytest.raises(ValueError):
        slots.drop("a")


def test_page_allocator_all_or_nothing():
    pages = PageAllocator(3, 16)
    taken = pages.allocate(2)
    with pytest.raises(ValueError):
        pages.allocate(2)
    assert pages.num_free == 1
    pages.free(taken)
    assert pages.num_free == 3
    with pytest.raises(ValueError):
        pages.free(taken)


def test_requests_that_can_never_fit_are_refused():
    s = _scheduler(num_pages=2, page_size=4)
    with pytest.raises(ValueError):
        s.add(Sequence("big", [1] * 6, max_tokens=4))
    seq = Sequence("ok", [1] * 4, max_tokens=4)
    s.add(seq)
    s.finish(seq, "abort")
    assert seq.status is Status.FINISHED and not s.has_work()


def test_early_abort_drops_only_waiting_requests_that_cannot_meet_the_slo():
    s = _scheduler(num_pages=4, page_size=4)
    for seq_id, arrival in (("a", 0.0), ("b", 0.0), ("c", 0.9)):
        s.add(Sequence(seq_id, [1] * 8, max_tokens=4, arrival=arrival))  # 3 pages each: one runs at a time
    _run_step(s)
    assert [q.seq_id for q in s.running] == ["a"]
    assert s.expire(now=0.5, ttft_slo_s=1.0, next_step_s=0.1) == []  # b could still start in time
    late = s.expire(now=0.95, ttft_slo_s=1.0, next_step_s=0.1)  # b: 0.95 + 0.1 > 1.0; c: 0.05 + 0.1 is fine
    assert [q.seq_id for q in late] == ["b"] and late[0].status is Status.FINISHED
    assert late[0].finish_reason == "overloaded"
    assert [q.seq_id for q in s.running] == ["a"] and [q.seq_id for q in s.waiting] == ["c"]
    c = s.waiting[0]
    assert s.expire(now=100.0, ttft_slo_s=1.0) == [c] and s.running  # running: never dropped
    assert s.pages.num_free == 1  # only a's pages are held


def test_prompt_chunks_of_at_most_max_prefill_adapters_per_step():
    """With `max_prefill_adapters` a step holds prompt chunks of at most that many adapters: a
    request of a further adapter waits (later ones of the step's adapters and of the base model
    pass it); decode rows of any adapter are not bounded; every request completes."""
    s = _scheduler(num_pages=64, num_adapter_slots=6, max_num_seqs=8, token_budget=64, max_prefill_adapters=2)
    for i, adapter in enumerate(["a", "b", "c", "a", None, "d"]):
        s.add(Sequence(i, [1] * 5, max_tokens=3, adapter=adapter))
    plan, _ = _run_step(s)
    assert sorted(r.seq.seq_id for r in plan.rows) == [0, 1, 3, 4]  # "c" and "d" wait; "a" again and base pass
    steps = 1
    while s.has_work():
        plan, _ = _run_step(s)
        steps += 1
        chunked = {r.seq.adapter for r in plan.rows if r.count > 1 and r.seq.adapter is not None}
        assert len(chunked) <= 2
    assert steps <= 6
    with pytest.raises(ValueError, match="max_prefill_adapters"):
        SchedulerConfig(num_pages=8, page_size=4, num_adapter_slots=2, max_prefill_adapters=-1)


def _steps_to_drain(scheduler):
    steps = 0
    while scheduler.has_work():
        _run_step(scheduler)
        steps += 1
    return steps


def test_lof_admits_the_longest_remaining_output_first_ties_in_arrival_order():
    fcfs, lof = _scheduler(max_num_seqs=2, num_pages=64), _scheduler(max_num_seqs=2, num_pages=64,
                                                                      schedule_policy="lof")
    for s in (fcfs, lof):
        for seq_id, max_tokens in (("short", 2), ("long", 9), ("mid", 5), ("long2", 9)):
            s.add(Sequence(seq_id, [1, 2], max_tokens=max_tokens))
    assert [q.seq_id for q in lof.waiting] == ["long", "long2", "mid", "short"]
    assert [q.seq_id for q in fcfs.waiting] == ["short", "long", "mid", "long2"]
    _run_step(lof)
    _run_step(fcfs)
    assert [q.seq_id for q in lof.running] == ["long", "long2"]
    assert [q.seq_id for q in fcfs.running] == ["short", "long"]


def test_lof_shortens_the_tail_when_requests_wait_for_adapter_slots():
    """More distinct adapters than slots, all queued at once (the 100-request distinct trace in
    small): fcfs starts a long request late and its tail runs alone; lof starts the long ones first."""
    lengths = [3, 4, 20, 5, 3, 18, 4, 6]
    steps = {}
    for policy in ("fcfs", "lof"):
        s = _scheduler(num_adapter_slots=4, max_num_seqs=8, num_pages=256, token_budget=64, schedule_policy=policy)
        for i, n in enumerate(lengths):
            s.add(Sequence(i, [1, 2], max_tokens=n, adapter=f"adapter{i}"))
        steps[policy] = _steps_to_drain(s)
    assert steps["lof"] == max(lengths) < steps["fcfs"], steps


def test_preempted_requests_requeue_by_the_output_they_have_left():
    """Pages grow (no reservation) and run out: the newest running request is preempted with tokens
    generated, and the queue stays ordered by the output each request has left."""
    s = _scheduler(schedule_policy="lof", reserve_output=False, num_pages=6, page_size=2, max_num_seqs=3)
    for i, n in enumerate((9, 8, 7, 3)):
        s.add(Sequence(i, [1, 2], max_tokens=n))
    preempted = []
    while s.has_work():
        plan, _ = _run_step(s)
        preempted += [q for q in plan.preempted if q.output]
        keys = [(-(q.max_tokens - len(q.output)), q.order) for q in s.waiting]
        assert keys == sorted(keys)
    assert preempted, "the scenario must preempt a request that has generated tokens"


def test_unknown_schedule_policy_is_refused():
    with pytest.raises(ValueError, match="schedule_policy"):
        _scheduler(schedule_policy="sjf")
