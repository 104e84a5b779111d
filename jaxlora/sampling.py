"""Choosing the next token: a request's sampling parameters and the one sampler, used by batched
generation (`jaxlora.generate`) and by the serving engine (`serve.step`).

Every function works per row, so a batch mixes rows with different parameters. The order is
vLLM's: logit bias and stop-token suppression (`bias_rows`), then the repetition, frequency and
presence penalties (`apply_penalties`), then the argmax of greedy rows, or for sampled rows
temperature, min-p, top-k and top-p (`filter_rows`) and a draw (`sample_rows`). Log-probabilities
(`token_logprobs`) are those of the model's raw logits (vLLM's default `raw_logprobs`). A row
under a grammar (structured outputs) first has the tokens its grammar forbids at -inf
(`mask_logits`, a packed bitmask per row; the serving engine's `serve.structured` makes it).

`sample_rows` takes one PRNG key per row, so a row's draw does not depend on the other rows of
its batch; `row_keys` derives them from a seed and the index of the token being drawn (the
serving engine: a seeded request gives the same tokens whatever it is batched with).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

MAX_LOGPROBS = 20  # most top log-probabilities per token (vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 100.0  # |bias| bound (OpenAI's)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """A request's sampling parameters (vLLM's meanings).

    max_new_tokens: tokens to generate at most; temperature 0 means greedy; top_p in (0, 1] keeps
    the smallest set of tokens with that probability mass; top_k > 0 keeps the k most likely
    tokens (0: all); min_p in [0, 1] keeps tokens at least min_p times as likely as the most
    likely one; seed: of the random draws.
    presence_penalty, frequency_penalty in [-2, 2]: subtracted from the logit of every token the
    output holds (once, or once per occurrence); repetition_penalty > 0: the logits of tokens in
    the prompt or the output are divided by it (positive) or multiplied by it (negative), 1: off.
    logit_bias: (token id, bias in [-100, 100]) pairs added to the logits.
    stop_token_ids: tokens that end the generation (as EOS does; the token is not in the text);
    ignore_eos: EOS does not end it; min_tokens: EOS and stop tokens cannot be drawn before this
    many output tokens.
    logprobs: None, or the number (0 .. MAX_LOGPROBS) of most likely tokens whose log-probabilities
    come with each token (the drawn token's own always does).
    prompt_logprobs: None, or as `logprobs` for each prompt token after the first (its
    log-probability given the tokens before it; evaluation harnesses' log-likelihoods).
    structured: None, or a grammar the output must follow (structured outputs: an opaque object the
    serving engine reads, `serve.structured.Constraint`); its rows get a token mask (`mask_logits`).
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: object | None = None

    def __post_init__(self):
        checks = [
            (self.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0 (0: off)"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (all(abs(b) <= MAX_LOGIT_BIAS for _, b in self.logit_bias), "logit_bias values must be in [-100, 100]"),
            (0 <= self.min_tokens <= self.max_new_tokens, "min_tokens must be in [0, max_new_tokens]"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message}, got {self}")

    def stop_ids(self, eos_ids) -> frozenset[int]:
        """The tokens that end this generation: stop_token_ids, and `eos_ids` unless ignore_eos."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_ids))

    @functools.cached_property
    def changes_logits(self) -> bool:
        """Whether a logit bias, a penalty or min_tokens changes this row's logits (the serving
        engine keeps per-row state on the device for them)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1 or self.min_tokens)

    @functools.cached_property
    def needs_state(self) -> bool:
        """Whether the serving engine samples this row with "sample_state" (logits changed, or
        log-probabilities asked for)."""
        return self.changes_logits or self.logprobs is not None


def greedy_rows(logits: jax.Array) -> jax.Array:
    """The argmax token of each row: logits [R, V] -> [R] int32."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def row_keys(seeds: jax.Array, counters: jax.Array) -> jax.Array:
    """One PRNG key per row: key(0) folded with the row's seed, then its counter. seeds, counters [R]."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.fold_in(jax.random.key(0), s), c))(seeds, counters)


def bias_rows(logits: jax.Array, bias: jax.Array, stop_mask: jax.Array, suppress_stop: jax.Array) -> jax.Array:
    """logits + bias, with the stop tokens of rows still under min_tokens at -inf.
    logits, bias [R, V] float; stop_mask [R, V] bool; suppress_stop [R] bool. Returns [R, V]."""
    return jnp.where(stop_mask & suppress_stop[:, None], -jnp.inf, logits + bias)


def apply_penalties(logits: jax.Array, prompt_seen: jax.Array, output_counts: jax.Array, presence: jax.Array,
                    frequency: jax.Array, repetition: jax.Array) -> jax.Array:
    """vLLM's penalties. logits [R, V] float; prompt_seen [R, V] bool (the token is in the prompt);
    output_counts [R, V] int (occurrences in the output); presence, frequency, repetition [R].
    Tokens seen in the prompt or output: logit / repetition if positive, else logit * repetition;
    then logit - frequency * count - presence * (count > 0). Returns [R, V]."""
    seen = prompt_seen | (output_counts > 0)
    rep = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    counts = output_counts.astype(logits.dtype)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def filter_rows(scaled: jax.Array, top_p: jax.Array, top_k: jax.Array, min_p: jax.Array) -> jax.Array:
    """The temperature-scaled logits [R, V] with -inf outside each row's kept set: min-p (tokens
    with probability >= min_p x the largest), then top-k (k > 0: logits >= the k-th largest), then
    the top-p nucleus of what is left (the smallest set, most likely first, holding top_p of its
    mass). top_p, min_p [R] float; top_k [R] int (0: off)."""
    vocab = scaled.shape[-1]
    largest = jnp.max(scaled, axis=-1, keepdims=True)
    scaled = jnp.where(scaled >= largest + jnp.log(min_p)[:, None], scaled, -jnp.inf)  # log(0) = -inf: off
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    sorted_logits = jnp.where(sorted_logits >= kth, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.where((mass_before < top_p[:, None]) & (sorted_logits > -jnp.inf), sorted_logits, jnp.inf)
    return jnp.where(scaled >= jnp.min(kept, axis=-1, keepdims=True), scaled, -jnp.inf)


def sample_rows(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, keys: jax.Array,
                top_k: jax.Array | None = None, min_p: jax.Array | None = None) -> jax.Array:
    """Next token per row. logits [R, V]; temperature, top_p [R] float; keys [R] PRNG keys; top_k
    [R] int and min_p [R] float (None: off). Rows with temperature 0 take the argmax; others draw
    from softmax(logits / temperature) restricted to `filter_rows`' set, with their own key.
    Returns [R] int32."""
    rows = logits.shape[0]
    top_k = jnp.zeros(rows, jnp.int32) if top_k is None else top_k
    min_p = jnp.zeros(rows, jnp.float32) if min_p is None else min_p
    greedy = greedy_rows(logits)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    drawn = jax.vmap(jax.random.categorical)(keys, filter_rows(scaled, top_p, top_k, min_p)).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


def mask_logits(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits [R, V] with -inf where a row's bit is clear. bitmask [R, W] int32, W >= ceil(V / 32):
    token t's bit is bit t % 32 of word t // 32 (llguidance's layout); a row of -1 words allows
    every token."""
    rows, vocab = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [R, W, 32]
    allowed = bits.reshape(rows, -1)[:, :vocab].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int = MAX_LOGPROBS):
    """Log-probabilities of the raw logits [R, V]: (of `tokens` [R] -> [R], the k largest [R, k],
    their token ids [R, k] int32), largest first."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top_values, top_ids = jax.lax.top_k(logprobs, k)
    return chosen, top_values, top_ids.astype(jnp.int32)
