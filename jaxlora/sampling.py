"""Choosing the next token: a request's sampling parameters and the one sampler, used by batched
generation (`jaxlora.generate`) and by the serving engine (`serve.step`).

`sample_rows` takes one PRNG key per row, so a row's draw does not depend on the other rows of
its batch; `row_keys` derives them from a seed and the index of the token being drawn (the
serving engine: a seeded request gives the same tokens whatever it is batched with).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """max_new_tokens: tokens to generate at most; temperature 0 means greedy; top_p in (0, 1] keeps
    the smallest set of tokens with that probability mass; seed: of the random draws."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def greedy_rows(logits: jax.Array) -> jax.Array:
    """The argmax token of each row: logits [R, V] -> [R] int32."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def row_keys(seeds: jax.Array, counters: jax.Array) -> jax.Array:
    """One PRNG key per row: key(0) folded with the row's seed, then its counter. seeds, counters [R]."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.fold_in(jax.random.key(0), s), c))(seeds, counters)


def sample_rows(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, keys: jax.Array) -> jax.Array:
    """Next token per row. logits [R, V]; temperature, top_p [R] float; keys [R] PRNG keys.
    Rows with temperature 0 take the argmax; others draw from the top-p nucleus of
    softmax(logits / temperature) with their own key. Returns [R] int32."""
    greedy = greedy_rows(logits)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.where(mass_before < top_p[:, None], sorted_logits, jnp.inf)
    scaled = jnp.where(scaled >= jnp.min(kept, axis=-1, keepdims=True), scaled, -jnp.inf)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)
