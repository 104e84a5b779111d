"""Batches with different adapter mixes in the same bucket reuse one compiled step."""

import jax
import numpy as np
from flax import nnx

from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.plan import build_plan
from jaxlora.lora.pool import AdapterPool
from jaxlora.models.llama import Llama, LoraInputs
from tests.jaxlora.test_merge import CONFIG


def test_new_adapter_mix_does_not_recompile():
    model = Llama(CONFIG, rngs=nnx.Rngs(0))
    pool = AdapterPool(CONFIG, num_slots=8, max_rank=16)
    for index in range(6):
        pool.load(random_adapter(f"a{index}", CONFIG, LoraConfig(r=8 if index % 2 else 16, lora_alpha=16,
                                                                   target_modules=("q_proj", "v_proj")), seed=index))
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, tokens, positions, lora):
        return nnx.merge(graphdef, state)(tokens, positions, lora=lora)[0]

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (4, 16))
    positions = np.broadcast_to(np.arange(16), tokens.shape)
    mixes = [np.array([[0], [1], [2], [-1]]), np.array([[5], [5], [3], [4]]), np.array([[-1], [-1], [-1], [2]])]
    outputs = []
    for mix in mixes:
        token_slot = np.broadcast_to(mix, tokens.shape)
        lora = LoraInputs(pool.arrays, build_plan(token_slot, num_segments=8))
        outputs.append(step(state, tokens, positions, lora))
    assert step._cache_size() == 1
    assert not np.allclose(outputs[0], outputs[1])
