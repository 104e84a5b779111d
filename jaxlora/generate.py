"""Batched text generation with a KV cache: greedy or sampled (temperature, top-p; the sampler of
`jaxlora.sampling`), stops on EOS."""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlora.buckets import bucket
from jaxlora.lora import backends
from jaxlora.lora.backends import LoraBackend
from jaxlora.lora.plan import build_plan
from jaxlora.models.llama import KVCache, Llama, LoraInputs
from jaxlora.sampling import SamplingParams, greedy_rows, sample_rows


def _next_tokens(logits: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
    """logits [B, V] -> next token ids [B]: argmax when greedy, else each row drawn with its own
    key split from `key` (`jaxlora.sampling.sample_rows`)."""
    if params.temperature == 0:
        return greedy_rows(logits)
    rows = logits.shape[0]
    return sample_rows(logits, jnp.full(rows, params.temperature), jnp.full(rows, params.top_p),
                       jax.random.split(key, rows))


@functools.partial(jax.jit, static_argnums=(0, 7), donate_argnums=(4,))
def _forward_step(graphdef, state, tokens, positions, cache, logit_indices, lora, backend: LoraBackend, embeds=None):
    model = nnx.merge(graphdef, state)
    return model(tokens, positions, cache=cache, logit_indices=logit_indices, lora=lora, lora_backend=backend,
                 embeds=embeds)


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
    lora_backend: LoraBackend | str = backends.DEFAULT,
    embed_prompts: Callable[[np.ndarray], jax.Array] | None = None,
) -> list[list[int]]:
    """Generates a continuation of each prompt (a list of token ids); returns the new ids only.

    `embed_prompts(tokens [B, T] padded prompt ids) -> [B, T, d]` gives the prefill's input
    embeddings instead of the token table's (a vision-language model's, images written in:
    `jaxlora.vision.generate`).

    With `pool_arrays` (an `AdapterPool`'s arrays), prompt b runs with adapter slot row_slots[b]
    (-1: the base model), all in one batch, its LoRA computed by `lora_backend` (a `LoraBackend`
    of `jaxlora.lora.backends` or its name, resolved here). A sequence stops after an EOS token
    (kept in its output) or `max_new_tokens` tokens."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if params.structured is not None:
        raise ValueError("structured outputs (SamplingParams.structured) are served by serve.engine, not generate")
    backend = backends.get(lora_backend)
    graphdef, state = nnx.split(model)
    batch = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    prompt_len = bucket(int(lengths.max()), 16)
    cache_len = bucket(prompt_len + params.max_new_tokens, 16)
    tokens = np.zeros((batch, prompt_len), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    positions = np.broadcast_to(np.arange(prompt_len, dtype=np.int32), tokens.shape)
    cache = KVCache.zeros(model.config, batch, cache_len, model.dtype)
    if pool_arrays is not None and (row_slots is None or len(row_slots) != batch):
        raise ValueError("row_slots must give one adapter slot per prompt")
    logits, cache = _forward_step(graphdef, state, tokens, positions, cache, jnp.asarray(lengths - 1),
                                  _lora_for(pool_arrays, row_slots, tokens.shape), backend,
                                  None if embed_prompts is None else embed_prompts(tokens))
    decode_lora = _lora_for(pool_arrays, row_slots, (batch, 1))
    key = jax.random.key(params.seed)
    eos = np.asarray(list(eos_token_ids), np.int32)
    outputs: list[list[int]] = [[] for _ in range(batch)]
    done = np.zeros(batch, bool)
    for step in range(params.max_new_tokens):
        key, step_key = jax.random.split(key)
        next_ids = np.asarray(_next_tokens(logits, step_key, params))
        for row in np.flatnonzero(~done):
            outputs[row].append(int(next_ids[row]))
        done |= np.isin(next_ids, eos)
        if done.all() or step == params.max_new_tokens - 1:
            break
        step_positions = jnp.asarray(lengths + step)[:, None]
        logits, cache = _forward_step(
            graphdef, state, jnp.asarray(next_ids)[:, None], step_positions, cache,
            jnp.zeros(batch, jnp.int32), decode_lora, backend,
        )
    return outputs


def generate_text(model: Llama, tokenizer, prompts: Sequence[str], params: SamplingParams = SamplingParams(),
                  chat: bool = False) -> list[str]:
    """String in, string out; `chat=True` wraps each prompt as a user message in the chat template."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) if chat else p for p in prompts]
    ids = [tokenizer.encode(text) for text in texts]
    outputs = generate(model, ids, params, tokenizer.eos_token_ids)
    return [tokenizer.decode(out) for out in outputs]
