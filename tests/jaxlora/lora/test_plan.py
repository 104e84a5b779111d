"""The batch plan groups rows by adapter slot with static padded shapes."""

import numpy as np
import pytest

from jaxlora.lora.plan import build_plan


@pytest.mark.parametrize("seed", range(5))
def test_plan_groups_rows_by_slot(seed):
    rng = np.random.default_rng(seed)
    token_slot = rng.integers(-1, 6, size=rng.integers(1, 200))
    plan = build_plan(token_slot)
    grouped = token_slot[plan.perm]
    assert np.array_equal(plan.perm[plan.inv_perm], np.arange(token_slot.size))
    num_segments = len(plan.seg_slot)
    assert plan.seg_starts[0] == 0 and plan.seg_starts[-1] == token_slot.size
    assert np.all(np.diff(plan.seg_starts) >= 0)
    for segment in range(num_segments):
        rows = grouped[plan.seg_starts[segment]: plan.seg_starts[segment + 1]]
        assert np.all(rows == plan.seg_slot[segment])
    used = [s for s in plan.seg_slot if s >= 0]
    assert used == sorted(set(token_slot[token_slot >= 0]))  # slots ascending, one segment each
    assert num_segments & (num_segments - 1) == 0  # padded to a power-of-two bucket


def test_plan_padding_and_limits():
    plan = build_plan(np.array([3, 3, -1, 0]), num_segments=8)
    assert list(plan.seg_slot) == [0, 3, -1, -1, -1, -1, -1, -1]
    assert list(plan.seg_starts) == [0, 1, 3, 4, 4, 4, 4, 4, 4]
    with pytest.raises(ValueError, match="do not fit"):
        build_plan(np.arange(5), num_segments=4)
