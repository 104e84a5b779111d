"""Token capacity from a throughput profile (synthetic saturating curves)."""

import pytest

from jaxlora.scheduler.capacity import (
    choose_capacity,
    power_of_two_candidates,
    profile_token_capacity,
)


def saturating(tokens: int, peak: float = 1e5, half: float = 200.0) -> float:
    """Throughput that approaches `peak` as tokens grow (Michaelis-Menten shape)."""
    return peak * tokens / (tokens + half)


def test_choose_capacity_is_smallest_size_within_fraction_of_best():
    tokens = [512, 1024, 2048, 4096, 8192, 16384]
    rates = [saturating(t) for t in tokens]
    # 95% of the best (16384) is reached first at 4096: 4096/4296 = 0.953 * ...
    best = max(rates)
    expected = min(t for t, r in zip(tokens, rates) if r >= 0.95 * best)
    assert choose_capacity(tokens, rates) == expected == 4096


def test_choose_capacity_ignores_input_order_and_a_drop_after_the_peak():
    tokens = [8192, 1024, 4096, 2048]
    rates = [70.0, 50.0, 100.0, 96.0]  # out of memory pressure at 8192
    assert choose_capacity(tokens, rates) == 2048
    assert choose_capacity(tokens, rates, fraction=1.0) == 4096


def test_profile_calls_the_measurement_and_takes_the_median():
    calls = []
    noise = iter([0.5, 1.0, 1.5] * 10)

    def measure(tokens: int) -> float:
        calls.append(tokens)
        return saturating(tokens) * next(noise)

    profile = profile_token_capacity(measure, [4096, 1024, 2048], repeats=3)
    assert profile.tokens == (1024, 2048, 4096)
    assert sorted(calls) == sorted([1024, 2048, 4096] * 3)
    assert profile.throughput == tuple(saturating(t) for t in profile.tokens)
    assert profile.capacity == choose_capacity(profile.tokens, profile.throughput)


def test_default_candidates_are_powers_of_two():
    assert power_of_two_candidates(512, 4096) == (512, 1024, 2048, 4096)
    profile = profile_token_capacity(saturating)
    assert profile.tokens[0] == 512 and profile.tokens[-1] == 16384


@pytest.mark.parametrize(
    "tokens, rates, fraction",
    [([], [], 0.95), ([1], [1.0, 2.0], 0.95), ([1024], [0.0], 0.95), ([1024], [1.0], 1.5)],
)
def test_choose_capacity_rejects_bad_input(tokens, rates, fraction):
    with pytest.raises(ValueError):
        choose_capacity(tokens, rates, fraction)
