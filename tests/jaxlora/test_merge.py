"""Merged weights give the unmerged LoRA forward; unmerging restores the base model."""

import numpy as np
from flax import nnx

from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.models.merge import merge_adapter, unmerge_adapter
from jaxlora.lora.plan import build_plan
from jaxlora.lora.pool import AdapterPool
from jaxlora.nn.model_config import LlamaConfig
from jaxlora.nn.model_config import PROJECTIONS
from jaxlora.models.llama import Llama, LoraInputs
from tests.jaxlora.hf_checkpoints import relative_error

CONFIG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=16, tie_word_embeddings=True)


def test_merge_and_unmerge():
    model = Llama(CONFIG, rngs=nnx.Rngs(0))
    adapter = random_adapter("a", CONFIG, LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS), b_std=0.1)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 24))
    positions = np.broadcast_to(np.arange(24), tokens.shape)
    base = np.asarray(model(tokens, positions)[0])
    pool = AdapterPool(CONFIG, num_slots=1, max_rank=8)
    pool.load(adapter)
    unmerged = np.asarray(model(tokens, positions, lora=LoraInputs(pool.arrays, build_plan(np.zeros(tokens.shape))))[0])
    assert relative_error(unmerged, base) > 1e-2
    merge_adapter(model, adapter)
    assert relative_error(np.asarray(model(tokens, positions)[0]), unmerged) <= 1e-5
    unmerge_adapter(model, adapter)
    assert relative_error(np.asarray(model(tokens, positions)[0]), base) <= 1e-6
