"""The inference-mode policy (jaxlora/scheduler/serving/mode_choice.py, V-LoRA Alg. 1) on scripted
workloads: one dominant adapter -> merged; a dominant adapter with 2 starving others -> mixed;
starving beyond half the batch or many adapters -> unmerged; and the fixed modes' targets."""

import pytest

from jaxlora.scheduler.serving.mode_choice import Mode, ModePolicy, Pending, choose_mode, fixed_mode, runs_in

POLICY = ModePolicy(merge_share=0.6, starve_s=0.5, theta=1, max_batch=8)


def workload(*groups):
    """Pending requests from (adapter, count, waited seconds) groups, in arrival order."""
    requests = []
    for adapter, count, waited in groups:
        requests += [Pending(adapter, waited, len(requests) + i) for i in range(count)]
    return requests


def test_one_dominant_adapter_runs_merged():
    assert choose_mode(workload(("a", 10, 0.0)), Mode(), 0.02, 0.005, POLICY) == Mode("merged", "a")
    # others present but not starving yet: they wait while the dominant adapter runs merged
    requests = workload(("a", 8, 0.1), ("b", 1, 0.1), (None, 1, 0.2))
    assert choose_mode(requests, Mode(), 0.02, 0.005, POLICY) == Mode("merged", "a")


def test_a_dominant_adapter_with_two_starving_others_runs_mixed():
    requests = workload(("a", 8, 0.0), ("b", 1, 0.9), (None, 1, 0.6))
    assert choose_mode(requests, Mode("merged", "a"), 0.02, 0.005, POLICY) == Mode("mixed", "a")
    # one starving request is within the tolerance theta = 1
    assert choose_mode(requests[:9], Mode("merged", "a"), 0.02, 0.005, POLICY) == Mode("merged", "a")


def test_credit_counts_the_step_and_switch_time():
    requests = workload(("a", 8, 0.0), ("b", 2, 0.45))
    assert choose_mode(requests, Mode(), 0.01, 0.0, POLICY).name == "merged"
    assert choose_mode(requests, Mode(), 0.03, 0.03, POLICY) == Mode("mixed", "a")  # 0.45 + 0.06 > 0.5


def test_starving_beyond_half_the_batch_runs_unmerged():
    requests = workload(("a", 20, 0.0), ("b", 3, 1.0), ("c", 2, 1.0))  # 5 starving > 8 / 2
    assert choose_mode(requests, Mode("mixed", "a"), 0.02, 0.005, POLICY) == Mode("unmerged")


def test_many_adapters_run_unmerged():
    requests = workload(*[(f"ad{i}", 2, 0.0) for i in range(8)])
    assert choose_mode(requests, Mode("merged", "ad0"), 0.02, 0.005, POLICY) == Mode("unmerged")
    # base-model requests count against the dominant adapter's share
    assert choose_mode(workload(("a", 5, 0.0), (None, 5, 0.0)), Mode(), 0.02, 0.0, POLICY) == Mode("unmerged")
    assert choose_mode([], Mode("mixed", "a"), 0.02, 0.0, POLICY) == Mode("mixed", "a")


def test_ties_keep_the_merged_adapter():
    requests = workload(("b", 4, 0.0), ("a", 4, 0.0))
    policy = ModePolicy(merge_share=0.5, starve_s=10, theta=1, max_batch=8)
    assert choose_mode(requests, Mode("merged", "a"), 0.0, 0.0, policy) == Mode("merged", "a")
    assert choose_mode(requests, Mode(), 0.0, 0.0, policy) == Mode("merged", "b")  # else the oldest


def test_fixed_modes():
    requests = workload((None, 1, 0.0), ("a", 3, 0.0), ("b", 1, 0.0))
    assert fixed_mode(requests, Mode(), "merged") == Mode("merged", None)  # the oldest request's target
    assert fixed_mode(requests, Mode("merged", "b"), "merged") == Mode("merged", "b")  # kept while it has requests
    assert fixed_mode(requests[:4], Mode("merged", "b"), "merged") == Mode("merged", None)
    running = [Pending("b", 0.0, 9, running=True)]  # a running request holds pages: it goes first
    assert fixed_mode(requests + running, Mode(), "merged") == Mode("merged", "b")
    # the current target's requests all wait (for pages b holds): b runs, nothing waits forever
    assert fixed_mode(requests + running, Mode("merged", "a"), "merged") == Mode("merged", "b")
    assert fixed_mode(requests, Mode(), "mixed") == Mode("mixed", "a")
    assert fixed_mode(requests, Mode(), "unmerged") == Mode("unmerged")
    assert runs_in(Mode("merged", "a"), "a") and not runs_in(Mode("merged", "a"), None)
    assert runs_in(Mode("mixed", "a"), "b") and runs_in(Mode(), None)


def test_bad_thresholds_are_refused():
    for bad in (dict(merge_share=0), dict(starve_s=-1), dict(theta=-1), dict(max_batch=0)):
        with pytest.raises(ValueError):
            ModePolicy(**bad)
