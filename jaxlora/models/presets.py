"""Named model shapes for random-weight runs (benchmarks, smoke tests): no weights, just configs."""

from __future__ import annotations

import dataclasses

from jaxlora.nn.model_config import LlamaConfig, RopeScaling

LLAMA_3_1_8B = LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
    max_position_embeddings=131072,
)
TINY = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16)


def llama8b_config(layers: int = 32, tiny: bool = False) -> LlamaConfig:
    """The Llama-3.1-8B shape with `layers` decoder layers (or the tiny CPU smoke-test shape)."""
    return dataclasses.replace(TINY if tiny else LLAMA_3_1_8B, num_layers=layers)
