"""Several engines behind one front end (serve.replicas) on a tiny random model: Punica placement,
migration of the newest request when a replica's KV runs out (every request's tokens equal an
unmigrated run, each delivered exactly once), cancellation on any replica, drain."""

import numpy as np
import pytest

from jaxlora.sampling import SamplingParams
from serve.engine import Engine, EngineConfig
from serve.replicas import ReplicaSet, server_state
from tests.jaxlora.parallel.fixtures import CONFIG, tiny_model
from tests.serve.conftest import make_adapters

# page_size 4, 8 pages: a request of 6 prompt tokens is admitted with 2 pages and needs 4 by its 10th token
SHORT_KV = dict(page_size=4, num_pages=8, max_model_len=32, max_num_seqs=8, token_budget=32, prefill_chunk=16,
                max_lora_rank=8, max_adapters_on_device=4, reserve_output_kv=False)
ROOMY_KV = dict(SHORT_KV, num_pages=64, reserve_output_kv=True)
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model():
    return tiny_model(CONFIG)


@pytest.fixture(scope="module")
def adapters():
    return make_adapters(CONFIG, 3)


def _requests(count, seed=0):
    """(prompt ids, adapter name or None, SamplingParams): greedy, and some seeded samples with
    penalties (their sampler state must follow a migrated request too)."""
    rng = np.random.default_rng(seed)
    names = ["ad0", None, "ad1", "ad2"]
    sampled = SamplingParams(MAX_TOKENS, temperature=0.8, seed=7, frequency_penalty=0.5)
    return [(rng.integers(0, CONFIG.vocab_size, 6).tolist(), names[i % 4],
             sampled if i % 3 == 2 else SamplingParams(MAX_TOKENS)) for i in range(count)]


def _serve(front, requests):
    """Every event each request's callback got, after running `front` until idle."""
    events = {i: [] for i in range(len(requests))}
    for i, (prompt, adapter, sampling) in enumerate(requests):
        front.submit(i, prompt, adapter, sampling, events[i].append)
    front.run_until_idle()
    return events


def _tokens(events):
    return [e.token for e in events if e.token is not None]


@pytest.fixture(scope="module")
def unmigrated(model, adapters):
    """Each request's tokens from one engine that never runs short of KV pages."""
    engine = Engine(model, (), EngineConfig(**ROOMY_KV), adapters)
    events = _serve(engine, _requests(6))
    return [_tokens(events[i]) for i in range(6)]


def test_placement_packs_the_busiest_replica_with_room(model, adapters):
    replicas = ReplicaSet([Engine(model, (), EngineConfig(**ROOMY_KV), adapters) for _ in range(4)])
    for i, (prompt, adapter, sampling) in enumerate(_requests(10)):
        replicas.submit(i, prompt, adapter, sampling, lambda event: None)
    assert [s.batch for s in replicas.states()] == [8, 2, 0, 0]  # 8 rows a replica: 0 fills first
    assert server_state(replicas)["replicas"][0]["batch"] == 8


def test_a_short_kv_migrates_the_newest_request_and_tokens_are_unchanged(model, adapters, unmigrated):
    replicas = ReplicaSet([Engine(model, (), EngineConfig(**SHORT_KV), adapters) for _ in range(4)])
    handed = []
    for index, engine in enumerate(replicas.engines):
        hook = engine.handoff
        engine.handoff = lambda handoff, hook=hook, index=index: (handed.append((index, handoff.request_id)),
                                                                  hook(handoff))
    requests = _requests(6)
    events = _serve(replicas, requests)
    assert replicas.migrations >= 1 and handed[0] == (0, 3)  # replica 0 took requests 0-3; 3 is its newest
    for i in range(len(requests)):  # each token exactly once, in order; the last one ends it
        assert _tokens(events[i]) == unmigrated[i], i
        assert [e.finish_reason for e in events[i]] == [None] * (MAX_TOKENS - 1) + ["length"]
    assert all(engine.free_pages == SHORT_KV["num_pages"] for engine in replicas.engines)


def test_one_engine_short_of_kv_recomputes_its_newest_request(model, adapters, unmigrated):
    engine = Engine(model, (), EngineConfig(**SHORT_KV), adapters)
    preempted = []
    schedule = engine.scheduler.schedule

    def recording():
        plan = schedule()
        preempted.extend(seq.seq_id for seq in plan.preempted)
        return plan

    engine.scheduler.schedule = recording
    events = _serve(engine, _requests(6))
    assert preempted and [_tokens(events[i]) for i in range(6)] == unmigrated
    assert engine.free_pages == SHORT_KV["num_pages"]


def test_cancelling_on_any_replica_frees_its_pages(model, adapters):
    one_row = dict(ROOMY_KV, max_num_seqs=1, max_waiting=4)
    replicas = ReplicaSet([Engine(model, (), EngineConfig(**one_row), adapters) for _ in range(4)])
    events = {i: [] for i in range(6)}
    for i, (prompt, adapter, sampling) in enumerate(_requests(6)):
        replicas.submit(i, prompt, adapter, sampling, events[i].append)
    assert [s.batch for s in replicas.states()] == [1, 1, 1, 1]  # requests 4, 5 wait for a replica
    for _ in range(2):
        for engine in replicas.engines:
            engine.step()
    assert all(engine.free_pages < one_row["num_pages"] for engine in replicas.engines)
    for i in range(6):
        replicas.abort(i)
    replicas.run_until_idle()
    assert all(engine.free_pages == one_row["num_pages"] for engine in replicas.engines)
    assert all(events[i][-1].finish_reason == "abort" for i in range(6))
    assert [s.batch for s in replicas.states()] == [0, 0, 0, 0]


def test_draining_a_replica_migrates_its_work_and_reports_it_idle(model, adapters, unmigrated):
    replicas = ReplicaSet([Engine(model, (), EngineConfig(**ROOMY_KV), adapters) for _ in range(2)])
    events = {i: [] for i in range(6)}
    requests = _requests(6)
    for i, (prompt, adapter, sampling) in enumerate(requests[:4]):
        replicas.submit(i, prompt, adapter, sampling, events[i].append)
    for _ in range(3):
        replicas.engines[0].step()
    assert replicas.states()[0].batch == 4
    load = replicas.drain(0, migrate=True)
    assert load["draining"] and not load["idle"]
    for i in (4, 5):
        replicas.submit(i, *requests[i], events[i].append)
    replicas.run_until_idle()
    assert replicas.migrations == 4 and replicas.load()[0]["idle"]
    assert [_tokens(events[i]) for i in range(6)] == unmigrated
    with pytest.raises(ValueError, match=r"replica must be in \[0, 2\)"):
        replicas.drain(2)
    assert not replicas.drain(0, undo=True)["draining"]


def test_an_abort_catches_a_request_between_replicas(model, adapters):
    replicas = ReplicaSet([Engine(model, (), EngineConfig(**ROOMY_KV), adapters) for _ in range(2)])
    events = []
    prompt, adapter, sampling = _requests(1)[0]
    replicas.submit("r", prompt, adapter, sampling, events.append)
    replicas.engines[0].step()
    replicas.engines[0].migrate("r")  # handed off at replica 0's next step ...
    replicas.abort("r")  # ... and aborted before that: the hand-off finds it aborted
    replicas.run_until_idle()
    assert [e.finish_reason for e in events if e.token is None] == ["abort"] and replicas.migrations == 0
    assert [s.batch for s in replicas.states()] == [0, 0]
    assert all(engine.free_pages == ROOMY_KV["num_pages"] for engine in replicas.engines)


def test_requests_wait_for_a_replica_with_room_in_arrival_order(model, adapters, unmigrated):
    one_row = dict(ROOMY_KV, max_num_seqs=1)
    replicas = ReplicaSet([Engine(model, (), EngineConfig(**one_row), adapters) for _ in range(2)])
    finished = []
    events = {i: [] for i in range(6)}
    for i, (prompt, adapter, sampling) in enumerate(_requests(6)):
        replicas.submit(i, prompt, adapter, sampling,
                        lambda e, i=i: (events[i].append(e), e.finish_reason and finished.append(i)))
    assert server_state(replicas)["queued"] == 4
    replicas.run_until_idle()
    assert [_tokens(events[i]) for i in range(6)] == unmigrated
    assert sorted(finished[:2]) == [0, 1] and sorted(finished[2:4]) == [2, 3]  # FCFS: two replicas, one row each


def test_summed_stats_add_counters_dicts_and_lists_and_take_the_largest_maximum():
    import types

    from serve.replicas import _SummedStats

    a = types.SimpleNamespace(steps=3, adapter_load_max_s=0.5, phase_seconds={"schedule": 1.0},
                              kind_steps={"lora decode": [2, 0.5, 64]})
    b = types.SimpleNamespace(steps=4, adapter_load_max_s=0.2, phase_seconds={"schedule": 2.0, "dispatch": 1.5},
                              kind_steps={"lora decode": [1, 0.25, 32], "base mixed": [1, 1.0, 256]})
    summed = _SummedStats([types.SimpleNamespace(stats=a), types.SimpleNamespace(stats=b)])
    assert (summed.steps, summed.adapter_load_max_s) == (7, 0.5)
    assert summed.phase_seconds == {"schedule": 3.0, "dispatch": 1.5}
    assert summed.kind_steps == {"lora decode": [3, 0.75, 96], "base mixed": [1, 1.0, 256]}


def test_the_sets_queue_follows_the_engines_schedule_policy(model, adapters):
    """lof: requests that wait for a replica are placed by the output they have left, longest first
    (fcfs: by arrival, the test above); every request still gets its max_tokens."""
    one_row = dict(ROOMY_KV, max_num_seqs=1, schedule_policy="lof")
    replicas = ReplicaSet([Engine(model, (), EngineConfig(**one_row), adapters) for _ in range(2)])
    placed = []
    submit_to = replicas._submit_to
    replicas._submit_to = lambda replica, p: (placed.append(p.request_id), submit_to(replica, p))
    lengths = [4, 4, 2, 9, 5, 7]
    events = {i: [] for i in range(6)}
    for i, (prompt, adapter, _) in enumerate(_requests(6)):
        replicas.submit(i, prompt, adapter, SamplingParams(lengths[i]), events[i].append)
    replicas.run_until_idle()
    assert placed == [0, 1, 3, 5, 4, 2]
    assert [len(_tokens(events[i])) for i in range(6)] == lengths
