"""Single-device references (the grad step without a mesh, the plain model forward), cached per case."""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxlora.buckets import bucket
from jaxlora.lora.plan import build_plan
from jaxlora.lora.trainable import split_pool
from jaxlora.parallel.grad_step import make_grad_step
from tests.jaxlora.parallel.fixtures import NUM_SLOTS, packed_batch, random_pool, tiny_model

ADAPTERS = {"single": (2,), "multi": (0, 1, 2, 3, -1)}
NUM_SEGMENTS = bucket(NUM_SLOTS + 1, 4)


@functools.lru_cache(maxsize=None)
def case(kind: str):
    """(batch arrays, token_slot, global plan, trainable, frozen) of a batch kind."""
    batch, token_slot = packed_batch(adapters=ADAPTERS[kind])
    trainable, frozen = split_pool(random_pool())
    return batch, token_slot, build_plan(token_slot, NUM_SEGMENTS), trainable, frozen


@functools.lru_cache(maxsize=None)
def reference_grads(kind: str, backend: str = "gather", dropout: bool = False):
    batch, _, plan, trainable, frozen = case(kind)
    rate, key = (jax.numpy.full(NUM_SLOTS, 0.25), jax.random.key(7)) if dropout else (None, None)
    loss, grads = make_grad_step(tiny_model(), NUM_SLOTS, backend)(trainable, frozen, batch, plan, rate, key)
    return np.asarray(loss), jax.tree.map(np.asarray, grads)


def assert_close_tree(actual, expected, rtol=5e-5):
    """Each leaf equal to `rtol` relative to the leaf's largest magnitude (f32 sums reorder)."""
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        want = np.asarray(want)
        np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=rtol * np.abs(want).max())
