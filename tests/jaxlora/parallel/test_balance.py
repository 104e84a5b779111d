"""Layers over pipeline stages by measured cost, and the replayed bubble of the 4-stage schedule
with the stage costs derived from the 4 x H200 run (bench/NOTES_train.md)."""

import itertools

import pytest

from jaxlora.parallel import mpmd
from jaxlora.parallel.balance import StageCosts, balanced_split, costs_from_op_times, parse_split, ranges_of
from jaxlora.parallel.bubble import round_robin_schedule

# F / B seconds of one layer and of the head (the last stage's extra) for a 4096-token microbatch,
# fitted to the 4 x H200 measurement of 2026-11-26 (README; NOTES_train.md).
H200 = StageCosts({"F": 2.44e-3, "B": 7.76e-3, "U": 6e-5}, {"F": 0.0, "B": 0.0, "U": 0.0},
                  {"F": 4.03e-3, "B": 15.72e-3, "U": 0.0})


def _stage_costs(costs, sizes):
    last = len(sizes) - 1
    return [sum(costs.stage_time(k, n, s == 0, s == last) for k in "FB") for s, n in enumerate(sizes)]


def _compositions(total, parts):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


@pytest.mark.parametrize("layers,stages,first,last", [(10, 3, 0.0, 2.5), (11, 4, 1.2, 0.3), (7, 7, 0.5, 0.5),
                                                      (9, 2, 0.0, 4.0), (12, 4, 0.0, 0.0)])
def test_balanced_split_minimizes_the_slowest_stage(layers, stages, first, last):
    costs = StageCosts({"F": 1.0, "B": 2.0}, {"F": first, "B": 2 * first}, {"F": last, "B": 2 * last})
    ranges = balanced_split(layers, stages, costs)
    mpmd.check_layer_ranges(ranges, layers, stages)
    best = min(max(_stage_costs(costs, sizes)) for sizes in _compositions(layers, stages))
    assert max(_stage_costs(costs, [b - a for a, b in ranges])) == pytest.approx(best)


def test_h200_split_moves_layers_off_the_head_stage():
    assert [b - a for a, b in balanced_split(32, 4, H200)] == [9, 8, 8, 7]  # slow stages first
    assert H200.in_layers()["last"] == pytest.approx(1.94, abs=0.01)
    no_head = StageCosts(H200.per_layer, H200.first, {"F": 0.0, "B": 0.0})
    assert balanced_split(32, 4, no_head) == mpmd.split_layers(32, 4)
    with pytest.raises(ValueError):
        balanced_split(3, 4, H200)


def test_costs_from_op_times_round_trip():
    ranges = ranges_of([3, 2, 2, 3])
    costs = StageCosts({"F": 1.0, "B": 3.0, "U": 0.1}, {"F": 0.5, "B": 0.2, "U": 0.0}, {"F": 2.0, "B": 6.0, "U": 0.0})
    back = costs_from_op_times(costs.op_seconds(ranges), ranges)
    for kind in "FBU":
        assert back.per_layer[kind] == pytest.approx(costs.per_layer[kind])
    for kind in "FB":
        assert back.first[kind] == pytest.approx(costs.first[kind])
        assert back.last[kind] == pytest.approx(costs.last[kind])
    two = costs_from_op_times(costs.op_seconds(ranges_of([5, 5])), ranges_of([5, 5]))  # no middle stage
    assert two.per_layer["F"] == pytest.approx(1.1) and two.last["F"] == pytest.approx(1.5)


def test_parse_split():
    assert parse_split("9,8,8,7", 32) == [(0, 9), (9, 17), (17, 25), (25, 32)]
    for bad in ("9,8,8,8", "32,0"):
        with pytest.raises(ValueError):
            parse_split(bad, 32)
    with pytest.raises(ValueError):
        mpmd.check_layer_ranges([(0, 4), (5, 8)], 8, 2)


def _stream_bubble(costs, sizes, global_batches, transfer=0.0, hold=0.0):
    """Replayed bubble of 4 adapters' full microbatches in one 1F1B stream (lemma no-ops in)."""
    schedule, gbs = round_robin_schedule(4, global_batches, 4, 4096, len(sizes))
    slot_of = {a: a for a in gbs}
    completions = mpmd.completions_of(schedule, gbs, slot_of)
    orders = mpmd.stage_orders([range(len(schedule))], len(sizes), completions,
                               frozenset(i for i, mb in enumerate(schedule) if not mb))
    mpmd.check_update_order(orders, schedule, gbs, slot_of)
    wall, busy = mpmd.simulate(orders, costs.op_seconds(ranges_of(sizes)), transfer=transfer, hold=hold)
    return 1 - sum(busy) / (len(sizes) * wall)


def test_replayed_bubble_falls_with_balance_and_global_batches():
    even = [_stream_bubble(H200, [8, 8, 8, 8], g) for g in (1, 2, 4, 8)]
    balanced = [_stream_bubble(H200, [9, 8, 8, 7], g) for g in (1, 2, 4, 8)]
    assert all(b < e for b, e in zip(balanced, even))
    assert balanced == sorted(balanced, reverse=True) and even == sorted(even, reverse=True)
    assert balanced[2] < 0.12 < even[2]  # 4 global batches (64 microbatches): the head costs ~6 points
    # A driver that waits ~7 ms after each op that sends (the run of 2026-11-26) adds ~6 points.
    held = _stream_bubble(H200, [8, 8, 8, 8], 2, hold=7e-3)
    assert 0.04 < held - even[1] < 0.08
    # Transfer latency: the balanced split's lighter late stages absorb it.
    assert _stream_bubble(H200, [9, 8, 8, 7], 4, transfer=3e-3) - balanced[2] < 0.01


def test_simulate_hold_and_transfer():
    orders = mpmd.stage_orders([range(4)], 2, {})
    times = {"F": [1.0, 1.0], "B": [2.0, 2.0], "U": [0.0, 0.0]}
    base, busy = mpmd.simulate(orders, times)
    assert base == (4 + 1) * 3 and busy == [12.0, 12.0]
    assert mpmd.simulate(orders, times, transfer=0.5)[0] > base
    assert mpmd.simulate(orders, times, hold=0.5)[0] > base


def test_stage_orders_forward_before_backward_and_steps_after_completion():
    """Every stage runs each microbatch's forward before its backward, an adapter's optimizer step
    right after the backward completing its global batch, no forward of its next global batch
    before that step (the lemma), and the stages' orders can be issued without a deadlock."""
    schedule, gbs = round_robin_schedule(3, 3, 2, 64, 4)
    slot_of = {a: a for a in gbs}
    completions = mpmd.completions_of(schedule, gbs, slot_of)
    empty = frozenset(i for i, mb in enumerate(schedule) if not mb)
    orders = mpmd.stage_orders([range(len(schedule))], 4, completions, empty)
    mpmd.check_update_order(orders, schedule, gbs, slot_of)
    real = [i for i in range(len(schedule)) if i not in empty]
    for ops in orders:
        position = {(op.kind, op.index): n for n, op in enumerate(ops) if op.kind != "U"}
        assert sorted(i for k, i in position if k == "F") == real == sorted(i for k, i in position if k == "B")
        assert all(position[("F", i)] < position[("B", i)] for i in real)
        for n, op in enumerate(ops):
            if op.kind == "U":
                previous = next(o for o in reversed(ops[:n]) if o.kind == "B")
                assert op.index in completions[previous.index]
    issued = mpmd.dispatch_order(orders)
    done = set()
    for stage, op in issued:
        if op.kind == "F" and stage > 0:
            assert ("F", op.index, stage - 1) in done
        if op.kind == "B" and stage < 3:
            assert ("B", op.index, stage + 1) in done
        done.add((op.kind, op.index, stage))
    assert len(issued) == sum(len(ops) for ops in orders)
