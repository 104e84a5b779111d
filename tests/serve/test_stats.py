"""serve.stats: host phases filed by step kind, and the slowest steps kept."""

import time

from serve.stats import EngineStats


def _iteration(stats: EngineStats, launched: str | None, finished: str | None, marks: list[tuple[str, float]]):
    """One engine iteration whose phases take the given seconds (sleeps), filed as the engine does."""
    clock = stats.phases()
    for name, seconds in marks:
        time.sleep(seconds)
        clock.mark(name)
    stats.end_iteration(clock, launched, finished)


def test_phases_are_filed_under_the_launched_and_the_finished_step_kinds():
    stats = EngineStats()
    _iteration(stats, "lora mixed", None, [("schedule", 0.02), ("dispatch", 0.01)])
    stats.record_step("lora mixed", 200, 4, 0.05)
    _iteration(stats, "lora decode", "lora mixed", [("schedule", 0.001), ("wait", 0.03), ("complete", 0.001)])
    stats.record_step("lora decode", 8, 8, 0.01)
    _iteration(stats, None, "lora decode", [("wait", 0.015)])
    by_kind = stats.phase_ms_by_kind()
    assert set(by_kind) == {"lora mixed", "lora decode"}
    assert by_kind["lora mixed"]["schedule"] >= 19 and by_kind["lora mixed"]["wait"] >= 29
    assert by_kind["lora decode"]["schedule"] < 19 and by_kind["lora decode"]["wait"] >= 14
    assert "dispatch" not in by_kind["lora decode"]
    assert list(by_kind["lora mixed"]) == [p for p in EngineStats.PHASES if p in by_kind["lora mixed"]]
    # the totals are unchanged by the filing: every phase's sum over kinds is its total
    totals = stats.phase_ms_per_step()
    for name, ms in totals.items():
        filed = sum(kind.get(name, 0.0) * stats.kind_steps[k][0] for k, kind in by_kind.items())
        assert abs(filed - ms * stats.steps) < 1e-6


def test_an_iteration_without_a_step_is_filed_under_none():
    stats = EngineStats()
    _iteration(stats, None, None, [("schedule", 0.001)])
    assert set(stats.kind_phases) == {"none"}
    assert stats.phase_ms_by_kind()["none"]["schedule"] > 0  # no step of that kind: the total ms


def test_slowest_steps_keeps_the_longest_in_order():
    stats = EngineStats()
    seconds = [0.003, 0.5, 0.001, 0.2] + [0.002] * 30 + [0.4]
    for i, s in enumerate(seconds):
        stats.record_step("lora decode" if i % 2 else "window mixed", 10 + i, 1, s)
    slowest = stats.slowest_steps()
    assert len(slowest) == EngineStats.SLOWEST
    assert [round(s["ms"]) for s in slowest[:3]] == [500, 400, 200]
    assert slowest[0] == {"step": 1, "kind": "lora decode", "tokens": 11, "ms": 500.0, "phases_ms": {}}
    assert slowest[1]["step"] == len(seconds) - 1
    assert all(a["ms"] >= b["ms"] for a, b in zip(slowest, slowest[1:]))


def test_a_slow_step_keeps_the_phases_of_the_iteration_that_finished_it():
    stats = EngineStats()
    for launch_s in (0.0, 0.04, 0.0):  # the second iteration's launch (commit) stalls
        clock = stats.phases()
        time.sleep(launch_s)
        clock.mark("commit")
        time.sleep(0.002)
        clock.mark("wait")
        stats.record_step("lora decode", 8, 8, 0.005 + launch_s)
        clock.mark("complete")
        stats.end_iteration(clock, "lora decode", "lora decode")
    slow = stats.slowest_steps()[0]
    assert slow["step"] == 1
    assert set(slow["phases_ms"]) == {"commit", "wait", "complete"}
    assert slow["phases_ms"]["commit"] >= 39 and slow["phases_ms"]["wait"] < 39
    assert all(s["phases_ms"]["commit"] < 39 for s in stats.slowest_steps()[1:])
