"""Packed sequences equal separate sequences; cached decoding equals full recomputation."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.models.llama import KVCache
from tests.jaxlora.hf_checkpoints import jax_logits, relative_error

TEXTS = ["The capital of France is Paris, and", "Once upon a time", "1, 2, 3, 4, 5, 6, 7, 8,"]


def test_packed_batch_equals_each_sequence_alone(smollm2):
    model, tokenizer = smollm2
    samples = [tokenizer.encode(text) for text in TEXTS]
    total = sum(map(len, samples))
    tokens = np.zeros((1, total + 5), np.int32)  # 5 padding tokens at the end (segment 0)
    positions = np.zeros_like(tokens)
    segment_ids = np.zeros_like(tokens)
    offset = 0
    for index, sample in enumerate(samples):
        span = slice(offset, offset + len(sample))
        tokens[0, span], positions[0, span], segment_ids[0, span] = sample, np.arange(len(sample)), index + 1
        offset += len(sample)
    packed, _ = model(tokens, positions, segment_ids=segment_ids)
    offset = 0
    for sample in samples:
        alone = jax_logits(model, np.array([sample]))
        assert relative_error(packed[0, offset: offset + len(sample)], alone[0]) <= 1e-5
        offset += len(sample)


def test_cached_decoding_equals_full_recompute(smollm2):
    model, tokenizer = smollm2
    prompts = [tokenizer.encode("The capital of France is"), tokenizer.encode("Write a poem about the sea:")]
    steps = 16
    batch, cache_len = len(prompts), 64
    lengths = np.array([len(p) for p in prompts])
    tokens = np.zeros((batch, lengths.max()), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    cache = KVCache.zeros(model.config, batch, cache_len)
    logits, cache = model(tokens, positions, cache=cache, logit_indices=jnp.asarray(lengths - 1))
    sequences = [list(p) for p in prompts]
    step_fn = jax.jit(lambda t, p, c: model(t, p, cache=c, logit_indices=jnp.zeros(batch, jnp.int32)))
    for step in range(steps):
        for row in range(batch):  # full recomputation of each sequence so far, for its last token
            full = jax_logits(model, np.array([sequences[row]]))[0, -1]
            assert relative_error(logits[row], full) <= 1e-5, f"step {step}, row {row}"
        next_ids = np.asarray(jnp.argmax(logits, -1))
        for row in range(batch):
            sequences[row].append(int(next_ids[row]))
        logits, cache = step_fn(next_ids[:, None], (lengths + step)[:, None], cache)
