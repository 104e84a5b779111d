"""The sampler's per-row pieces against NumPy references on fresh random inputs (odd sizes): logit
bias and stop-token suppression, the penalties, min-p / top-k / top-p filtering, top-k = 1 equals
greedy, log-probabilities; and SamplingParams' checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.sampling import (
    SamplingParams, apply_penalties, bias_rows, filter_rows, greedy_rows, row_keys, sample_rows, token_logprobs,
)

ROWS, VOCAB = 5, 37


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.fixture
def rng():
    return np.random.default_rng(np.random.randint(1 << 30))


def _penalties_ref(logits, seen, counts, presence, frequency, repetition):
    out = logits.copy()
    for r in range(len(out)):
        hit = seen[r] | (counts[r] > 0)
        out[r, hit] = np.where(out[r, hit] > 0, out[r, hit] / repetition[r], out[r, hit] * repetition[r])
        out[r] -= frequency[r] * counts[r] + presence[r] * (counts[r] > 0)
    return out


def test_penalties_match_the_reference(rng):
    logits = rng.normal(size=(ROWS, VOCAB)).astype(np.float32) * 3
    seen = rng.random((ROWS, VOCAB)) < 0.2
    counts = rng.integers(0, 3, (ROWS, VOCAB)) * (rng.random((ROWS, VOCAB)) < 0.3)
    presence, frequency = rng.uniform(-2, 2, ROWS).astype(np.float32), rng.uniform(-2, 2, ROWS).astype(np.float32)
    repetition = rng.uniform(0.5, 2, ROWS).astype(np.float32)
    got = apply_penalties(jnp.asarray(logits), jnp.asarray(seen), jnp.asarray(counts, jnp.int32),
                          jnp.asarray(presence), jnp.asarray(frequency), jnp.asarray(repetition))
    want = _penalties_ref(logits, seen, counts, presence, frequency, repetition)
    assert _rel(got, want) <= 1e-5
    assert _rel(got, logits) > 1e-2  # they do change the logits
    neutral = apply_penalties(jnp.asarray(logits), jnp.asarray(seen), jnp.asarray(counts, jnp.int32),
                              jnp.zeros(ROWS), jnp.zeros(ROWS), jnp.ones(ROWS))
    np.testing.assert_array_equal(neutral, logits)


def test_bias_and_stop_suppression(rng):
    logits = rng.normal(size=(ROWS, VOCAB)).astype(np.float32)
    bias = (rng.uniform(-100, 100, (ROWS, VOCAB)) * (rng.random((ROWS, VOCAB)) < 0.1)).astype(np.float32)
    stop = rng.random((ROWS, VOCAB)) < 0.1
    suppress = np.array([True, False, True, False, True])
    got = np.asarray(bias_rows(jnp.asarray(logits), jnp.asarray(bias), jnp.asarray(stop), jnp.asarray(suppress)))
    want = np.where(stop & suppress[:, None], -np.inf, logits + bias)
    np.testing.assert_array_equal(got, want)


def _filter_ref(scaled, top_p, top_k, min_p):
    """NumPy: which tokens each row keeps (bool [R, V])."""
    keep = np.zeros(scaled.shape, bool)
    for r, row in enumerate(scaled):
        probs = np.exp(row - row.max())
        probs /= probs.sum()
        ok = probs >= min_p[r] * probs.max()
        if top_k[r] > 0:
            ok &= row >= np.sort(row)[::-1][min(top_k[r], len(row)) - 1]
        masked = np.where(ok, row, -np.inf)
        p = np.exp(masked - masked.max())
        p /= p.sum()
        order = np.argsort(-masked, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        nucleus = order[(before < top_p[r]) & ok[order]]
        keep[r, nucleus] = True  # random floats: no ties
    return keep


def test_filters_match_the_reference(rng):
    scaled = rng.normal(size=(ROWS, VOCAB)).astype(np.float32) * 2
    top_p = np.array([1.0, 0.5, 0.9, 0.3, 1.0], np.float32)
    top_k = np.array([0, 3, 10, 0, 1], np.int32)
    min_p = np.array([0.0, 0.0, 0.05, 0.2, 0.0], np.float32)
    got = np.asarray(filter_rows(jnp.asarray(scaled), jnp.asarray(top_p), jnp.asarray(top_k), jnp.asarray(min_p)))
    np.testing.assert_array_equal(got > -np.inf, _filter_ref(scaled, top_p, top_k, min_p))
    np.testing.assert_array_equal(got[got > -np.inf], scaled[got > -np.inf])


def test_top_k_one_equals_greedy_and_draws_stay_in_the_kept_set(rng):
    logits = jnp.asarray(rng.normal(size=(ROWS, VOCAB)).astype(np.float32))
    keys = row_keys(jnp.arange(ROWS, dtype=jnp.uint32), jnp.zeros(ROWS, jnp.int32))
    ones = jnp.ones(ROWS)
    drawn = sample_rows(logits, ones, ones, keys, jnp.ones(ROWS, jnp.int32), jnp.zeros(ROWS))
    np.testing.assert_array_equal(drawn, greedy_rows(logits))
    top_k = jnp.full(ROWS, 4, jnp.int32)
    for seed in range(20):
        keys = row_keys(jnp.full(ROWS, seed, jnp.uint32), jnp.arange(ROWS))
        drawn = np.asarray(sample_rows(logits, ones, ones, keys, top_k, jnp.zeros(ROWS)))
        top4 = np.argsort(-np.asarray(logits), axis=-1)[:, :4]
        assert all(drawn[r] in top4[r] for r in range(ROWS))


def test_token_logprobs_are_log_softmax(rng):
    logits = rng.normal(size=(ROWS, VOCAB)).astype(np.float32) * 4
    tokens = rng.integers(0, VOCAB, ROWS).astype(np.int32)
    chosen, top_values, top_ids = token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), 6)
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    assert _rel(chosen, ref[np.arange(ROWS), tokens]) <= 1e-5
    np.testing.assert_array_equal(top_ids, np.argsort(-ref, axis=-1, kind="stable")[:, :6])
    assert _rel(top_values, np.sort(ref, axis=-1)[:, ::-1][:, :6]) <= 1e-5


@pytest.mark.parametrize("bad", [dict(top_k=-1), dict(min_p=1.5), dict(presence_penalty=3.0),
                                 dict(frequency_penalty=-2.5), dict(repetition_penalty=0.0),
                                 dict(logit_bias=((3, 200.0),)), dict(min_tokens=40), dict(logprobs=21)])
def test_bad_sampling_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=32, **bad)


def test_stop_ids():
    assert SamplingParams(stop_token_ids=(5,)).stop_ids({2}) == {2, 5}
    assert SamplingParams(stop_token_ids=(5,), ignore_eos=True).stop_ids({2}) == {5}
