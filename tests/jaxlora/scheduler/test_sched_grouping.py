"""Head-tail adapter grouping by mean sample length."""

from jaxlora.scheduler.training.grouping import group_adapters, head_tail_order
from jaxlora.scheduler.training.schedule import adapter_groups
from jaxlora.scheduler.training.workloads import synthetic_data


def test_four_adapters_pair_longest_with_shortest():
    means = {0: 450.0, 1: 800.0, 2: 1600.0, 3: 1000.0}
    assert group_adapters(means) == ((2, 0), (3, 1))


def test_odd_count_and_larger_groups():
    means = {a: float(10 * a) for a in range(5)}  # 4 longest ... 0 shortest
    assert head_tail_order(means) == [4, 0, 3, 1, 2]
    assert group_adapters(means, 2) == ((4, 0), (3, 1), (2,))
    assert group_adapters(means, 3) == ((4, 0, 3), (1, 2))
    assert group_adapters(means, 1) == ((4,), (0,), (3,), (1,), (2,))


def test_ties_break_by_adapter_id():
    assert group_adapters({5: 1.0, 3: 1.0, 9: 1.0, 1: 1.0}) == ((1, 9), (3, 5))


def test_het_workload_pairs_wikisum_with_xsum():
    data = synthetic_data("het", 4, 64, 8, seed=0)  # adapters: xsum, cnndm, wikisum, mixed
    groups = adapter_groups(data, 2)
    assert groups[0] == (2, 0)
    assert sorted(groups[1]) == [1, 3]
