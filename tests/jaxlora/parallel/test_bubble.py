"""Bubble ratios of a 4-stage pipeline: (a) the multi-adapter schedule (4 adapters) vs (b) 1F1B with one adapter."""

import pytest

from jaxlora.parallel.bubble import (compare_bubbles, multi_adapter_run, round_robin_schedule, simulate_1f1b,
                                     stage_order)
from jaxlora.scheduler.training.samples import Sample


def test_1f1b_order_and_textbook_bubble():
    assert stage_order(0, 4, 5) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1),
                                    ("B", 2), ("B", 3), ("B", 4)]
    assert stage_order(3, 4, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    run = simulate_1f1b([[1.0] * 4] * 4, [[2.0] * 4] * 4)
    assert run.makespan == pytest.approx((4 + 3) * 3.0)  # (M + S - 1) (t_f + t_b)
    assert run.bubble_ratio == pytest.approx(3 / 7)  # (S - 1) / (M + S - 1)


def test_four_adapters_vs_one_adapter_1f1b():
    ratios = compare_bubbles([1.0, 1.0, 1.0, 1.0])  # 4 global batches x 4 microbatches per adapter
    assert ratios["single_adapter_1f1b"] == pytest.approx(3 / 7)  # drains every global batch
    assert ratios["multi_adapter"] == pytest.approx(3 / 67)  # one fill/drain for 64 microbatches
    assert ratios["multi_adapter_noops"] == 0
    uneven = compare_bubbles([1.0, 1.3, 0.8, 1.1])
    assert uneven["multi_adapter"] < uneven["single_adapter_1f1b"]


def test_one_adapter_with_lemma_noops_equals_drained_1f1b():
    """The lemma's no-ops in a one-adapter stream cost exactly the drain of plain 1F1B."""
    ratios = compare_bubbles([1.0] * 4, num_adapters=1)
    assert ratios["multi_adapter"] == pytest.approx(ratios["single_adapter_1f1b"])
    assert ratios["multi_adapter_noops"] == 3 * 3


def test_early_global_batch_is_rejected():
    stream = [(Sample(0, 0, 64),), (Sample(0, 1, 64),)]  # batch 1 right after batch 0, no no-ops
    with pytest.raises(ValueError, match="enters before"):
        multi_adapter_run(stream, {0: 1}, [1.0] * 4, [2.0] * 4, 64)
    fixed, sizes = round_robin_schedule(1, 2, 1, 64, 4)
    assert len(fixed) == 5 and multi_adapter_run(fixed, sizes, [1.0] * 4, [2.0] * 4, 64).bubble_ratio > 0
