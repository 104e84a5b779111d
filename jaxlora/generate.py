"""Batched text generation with a KV cache: greedy or sampled (temperature, top-p), stops on EOS."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlora.lora.plan import build_plan
from jaxlora.models.llama import KVCache, Llama, LoraInputs


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_p in (0, 1] keeps the smallest set of tokens with that mass."""

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


def bucket(n: int, minimum: int = 16) -> int:
    """The power of two >= n (and >= minimum): padded lengths that bound recompilation."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def sample_next(logits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """logits [B, V] -> next token ids [B] (argmax when temperature == 0)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        kept = jnp.where(mass_before < top_p, sorted_logits, jnp.inf)
        threshold = jnp.min(kept, axis=-1, keepdims=True)
        logits = jnp.where(logits >= threshold, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 7), donate_argnums=(4,))
def _forward_step(graphdef, state, tokens, positions, cache, logit_indices, lora, lora_backend):
    model = nnx.merge(graphdef, state)
    return model(tokens, positions, cache=cache, logit_indices=logit_indices, lora=lora,
                 lora_backend=lora_backend)


def _lora_for(pool_arrays, row_slots, shape):
    """LoraInputs for a [B, T] step where row b uses adapter slot row_slots[b] (-1: base)."""
    if pool_arrays is None:
        return None
    token_slot = np.broadcast_to(np.asarray(row_slots, np.int32)[:, None], shape)
    return LoraInputs(pool_arrays, build_plan(token_slot, num_segments=bucket(len(row_slots) + 1, 4)))


def generate(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams = SamplingParams(),
    eos_token_ids: Sequence[int] = (),
    pool_arrays: dict | None = None,
    row_slots: Sequence[int] | None = None,
    lora_backend: str = "gather",
) -> list[list[int]]:
    """Generates a continuation of each prompt (a list of token ids); returns the new ids only.

    With `pool_arrays` (an `AdapterPool`'s arrays), prompt b runs with adapter slot row_slots[b]
    (-1: the base model), all in one batch. A sequence stops after an EOS token (kept in its
    output) or `max_new_tokens` tokens."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    graphdef, state = nnx.split(model)
    batch = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    prompt_len = bucket(int(lengths.max()))
    cache_len = bucket(prompt_len + params.max_new_tokens)
    tokens = np.zeros((batch, prompt_len), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    positions = np.broadcast_to(np.arange(prompt_len, dtype=np.int32), tokens.shape)
    cache = KVCache.zeros(model.config, batch, cache_len, model.dtype)
    if pool_arrays is not None and (row_slots is None or len(row_slots) != batch):
        raise ValueError("row_slots must give one adapter slot per prompt")
    logits, cache = _forward_step(graphdef, state, tokens, positions, cache, jnp.asarray(lengths - 1),
                                  _lora_for(pool_arrays, row_slots, tokens.shape), lora_backend)
    decode_lora = _lora_for(pool_arrays, row_slots, (batch, 1))
    key = jax.random.key(params.seed)
    eos = np.asarray(list(eos_token_ids), np.int32)
    outputs: list[list[int]] = [[] for _ in range(batch)]
    done = np.zeros(batch, bool)
    for step in range(params.max_new_tokens):
        key, step_key = jax.random.split(key)
        next_ids = np.asarray(sample_next(logits, step_key, params.temperature, params.top_p))
        for row in np.flatnonzero(~done):
            outputs[row].append(int(next_ids[row]))
        done |= np.isin(next_ids, eos)
        if done.all() or step == params.max_new_tokens - 1:
            break
        step_positions = jnp.asarray(lengths + step)[:, None]
        logits, cache = _forward_step(
            graphdef, state, jnp.asarray(next_ids)[:, None], step_positions, cache,
            jnp.zeros(batch, jnp.int32), decode_lora, lora_backend,
        )
    return outputs


def generate_text(model: Llama, tokenizer, prompts: Sequence[str], params: SamplingParams = SamplingParams(),
                  chat: bool = False) -> list[str]:
    """String in, string out; `chat=True` wraps each prompt as a user message in the chat template."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) if chat else p for p in prompts]
    ids = [tokenizer.encode(text) for text in texts]
    outputs = generate(model, ids, params, tokenizer.eos_token_ids)
    return [tokenizer.decode(out) for out in outputs]
