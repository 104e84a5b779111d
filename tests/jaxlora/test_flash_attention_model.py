"""The model's flash attention path (packed segments, Pallas kernel in interpret mode on CPU) gives
the masked path's logits, and a training step's loss and adapter gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.pool import AdapterPool
from jaxlora.lora.trainable import split_pool
from jaxlora.nn.model_config import PROJECTIONS, LlamaConfig
from jaxlora.nn.layers import PackedSegments, packed_attention
from jaxlora.models.llama import Llama
from jaxlora.parallel.grad_step import make_grad_step
from tests.pallas_kernels.cases import rel_err
from train.data import TokenizedSample
from train.microbatch import device_batch, pack_microbatch

CONFIG = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=32)
LORA = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=PROJECTIONS)
CAPACITY = 128  # a multiple of the kernel's tiles


def microbatch(num_slots: int):
    rng = np.random.default_rng(3)
    entries = []
    for index, length in enumerate([37, 1, 50, 21]):
        tokens = rng.integers(0, CONFIG.vocab_size, length, dtype=np.int32)
        entries.append((index % num_slots, TokenizedSample(tokens, np.ones(length, bool), "t"), 1.0 / length))
    return device_batch(pack_microbatch(entries, CAPACITY, num_slots), num_slots)


def test_auto_is_masked_on_cpu_and_flash_is_segments():
    ids = jnp.zeros((1, CAPACITY), jnp.int32)
    assert packed_attention(ids, CONFIG.head_dim, "auto").shape == (1, CAPACITY, CAPACITY)
    assert isinstance(packed_attention(ids, CONFIG.head_dim, "flash"), PackedSegments)
    with pytest.raises(ValueError, match="attention impl"):
        packed_attention(ids, CONFIG.head_dim, "fast")


def test_flash_logits_equal_masked():
    model = Llama(CONFIG, rngs=nnx.Rngs(0))
    batch, _ = microbatch(2)
    args = (batch["tokens"], batch["positions"])
    masked, _ = model(*args, segment_ids=batch["segment_ids"], attention="masked")
    flash, _ = model(*args, segment_ids=batch["segment_ids"], attention="flash")
    assert rel_err(flash, masked) <= 1e-5


def test_flash_with_sliding_window_layers_equals_masked():
    """Gemma-style alternating layers (window 16, then full): each layer's traced window goes into
    the GPU kernel (interpret mode); a soft-capped model is refused by the flash path."""
    import dataclasses

    config = dataclasses.replace(CONFIG, sliding_window=16, layer_types=("sliding_attention", "full_attention"),
                                 query_scale=0.2)
    model = Llama(config, rngs=nnx.Rngs(0))
    batch, _ = microbatch(2)
    args = (batch["tokens"], batch["positions"])
    masked, _ = model(*args, segment_ids=batch["segment_ids"], attention="masked")
    flash, _ = model(*args, segment_ids=batch["segment_ids"], attention="flash")
    full_config = dataclasses.replace(config, sliding_window=None, layer_types=None)
    unwindowed, _ = Llama(full_config, rngs=nnx.Rngs(0))(*args, segment_ids=batch["segment_ids"], attention="masked")
    assert rel_err(flash, masked) <= 1e-5 and rel_err(masked, unwindowed) > 1e-3
    capped = Llama(dataclasses.replace(config, attn_logit_softcap=20.0), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="soft-cap"):
        capped(*args, segment_ids=batch["segment_ids"], attention="flash")


def test_flash_training_step_equals_masked():
    model = Llama(CONFIG, rngs=nnx.Rngs(0))
    pool = AdapterPool(CONFIG, num_slots=3, max_rank=LORA.r)
    for slot in range(3):
        pool.load(random_adapter(f"a{slot}", CONFIG, LORA, seed=slot))
    trainable, frozen = split_pool(pool.arrays)
    batch, plan = microbatch(3)
    args = (trainable, frozen, batch, plan, jnp.zeros(3, jnp.float32), jax.random.key(0))
    masked_loss, masked_grads = make_grad_step(model, 3, "gather", attention="masked")(*args)
    flash_loss, flash_grads = make_grad_step(model, 3, "gather", attention="flash")(*args)
    assert rel_err(flash_loss, masked_loss) <= 1e-5
    for got, want in zip(jax.tree.leaves(flash_grads), jax.tree.leaves(masked_grads)):
        assert rel_err(got, want) <= 1e-5
