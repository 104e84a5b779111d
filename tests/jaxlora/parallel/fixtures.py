"""A tiny random Llama, a random adapter pool and packed multi-adapter microbatches for the
parallelism tests (shapes divide by 4 tensor shards, 2 or 4 data shards, 2 stages)."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlora.lora.pool import empty_pool_arrays
from jaxlora.nn.model_config import PROJECTIONS, LlamaConfig
from jaxlora.models.llama import Llama

CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=4, head_dim=16, attention_bias=True)
NUM_SLOTS, MAX_RANK = 4, 8


def tiny_model(config: LlamaConfig = CONFIG) -> Llama:
    model = Llama(config, rngs=nnx.Rngs(0))
    # Non-zero biases, so that the row/column split of biases is checked too.
    for name in model.weights:
        if name.endswith(".bias"):
            key = jax.random.key(zlib.crc32(name.encode()))
            model.weights[name].set_value(0.1 * jax.random.normal(key, model.weights[name].shape))
    return model


def random_pool(config: LlamaConfig = CONFIG, seed: int = 1) -> dict:
    """Every slot filled with random A/B (ranks 8, 4, 8, 2), scale alpha/r with alpha = 16."""
    arrays = empty_pool_arrays(config, NUM_SLOTS, MAX_RANK, PROJECTIONS, jnp.float32)
    rng = np.random.default_rng(seed)
    ranks = np.array([8, 4, 8, 2])
    mask = (np.arange(MAX_RANK)[None, :] < ranks[:, None]).astype(np.float32)  # [slots, r]
    pool = {}
    for module, entry in arrays.items():
        layers, slots, fan_in, rank = entry["a"].shape
        fan_out = entry["b"].shape[-1]
        a = rng.normal(size=(layers, slots, fan_in, rank)) * fan_in**-0.5 * mask[None, :, None, :]
        b = rng.normal(size=(layers, slots, rank, fan_out)) * 0.5 * mask[None, :, :, None]
        pool[module] = {"a": jnp.asarray(a, jnp.float32), "b": jnp.asarray(b, jnp.float32),
                        "scale": jnp.asarray(np.broadcast_to(16.0 / ranks, (layers, slots)), jnp.float32),
                        "rank": jnp.asarray(np.broadcast_to(ranks, (layers, slots)), jnp.int32)}
    return pool


def packed_batch(batch: int = 4, length: int = 16, adapters=(0, 1, 2, 3), seed: int = 2):
    """(batch arrays [batch, length], token_slot [batch, length]): each row packs 2 samples, each
    sample of an adapter drawn from `adapters` (-1 = base model), the row's tail unused."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CONFIG.vocab_size, size=(batch, length)).astype(np.int32)
    positions = np.zeros_like(tokens)
    segment_ids = np.zeros_like(tokens)
    token_slot = np.full_like(tokens, -1)
    weights = np.zeros(tokens.shape, np.float32)
    for row in range(batch):
        first = int(rng.integers(3, length - 5))
        second = int(rng.integers(first + 2, length))
        for segment, (start, stop) in enumerate(((0, first), (first, second)), start=1):
            positions[row, start:stop] = np.arange(stop - start)
            segment_ids[row, start:stop] = segment
            token_slot[row, start:stop] = adapters[int(rng.integers(len(adapters)))]
            weights[row, start:stop - 1] = 1.0 / length
    targets = np.roll(tokens, -1, axis=1)
    batch_arrays = {"tokens": tokens, "positions": positions, "segment_ids": segment_ids,
                    "targets": targets, "weights": weights}
    return batch_arrays, token_slot

