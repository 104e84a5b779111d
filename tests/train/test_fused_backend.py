"""One training step of SmolLM2 with adapters: the fused-kernel backend (interpret mode on a CPU)
gives the loss and adapter gradients of the reference backend, dropout included."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.pool import AdapterPool
from jaxlora.lora.trainable import split_pool
from jaxlora.parallel.grad_step import make_grad_step
from tests.jaxlora.hf_checkpoints import relative_error
from train.data import TokenizedSample
from train.microbatch import device_batch, pack_microbatch

TEXTS = ["The capital of France is Paris.", "Two plus three is five.", "Cats chase mice at night."]


def _microbatch(tokenizer, capacity):
    entries = []
    for index, text in enumerate(TEXTS):
        tokens = np.asarray(tokenizer.encode(text), np.int32)
        sample = TokenizedSample(tokens, np.ones(len(tokens), bool), f"text{index}")
        entries.append((index % 2, sample, 1.0 / 20))
    return pack_microbatch(entries, capacity, num_slots=2)


def test_fused_training_step_matches_reference(smollm2):
    model, tokenizer = smollm2
    pool = AdapterPool(model.config, num_slots=2, max_rank=16, target_modules=("q_proj", "v_proj", "down_proj"))
    for index, rank in enumerate((8, 16)):
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=("q_proj", "v_proj", "down_proj"))
        pool.load(random_adapter(f"a{index}", model.config, config, seed=index, b_std=0.05))
    trainable, frozen = split_pool(pool.arrays)
    batch, plan = device_batch(_microbatch(tokenizer, capacity=64), num_slots=2)
    dropout, key = jnp.asarray([0.1, 0.2]), jax.random.key(7)
    results = {}
    for backend in ("gather", "fused"):
        step = make_grad_step(model, num_slots=2, lora_backend=backend)
        results[backend] = step(trainable, frozen, batch, plan, dropout, key)
    (loss_ref, grads_ref), (loss_fused, grads_fused) = results["gather"], results["fused"]
    assert relative_error(loss_fused, loss_ref) <= 1e-5
    for module in grads_ref:
        for part in ("a", "b"):
            assert np.abs(np.asarray(grads_ref[module][part])).max() > 0
            assert relative_error(grads_fused[module][part], grads_ref[module][part]) <= 1e-4, (module, part)
