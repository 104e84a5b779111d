"""A batch mixing base rows and rows of 3 adapters (ranks 8, 16, 64) equals each adapter run alone."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxlora.lora import backends
from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.plan import build_plan
from jaxlora.lora.pool import AdapterPool
from jaxlora.models.llama import LoraInputs
from jaxlora.nn.model_config import PROJECTIONS
from tests.jaxlora.hf_checkpoints import relative_error

# Every backend: the XLA references, both SGMV kernel styles and both fused-kernel styles (kernels
# in interpret mode on a CPU); "pallas" is "pallas_gpu" off a GPU/TPU.
TESTED_BACKENDS = [b for b in backends.names() if b != "pallas"]
RANKS = (8, 16, 64)
ROW_ADAPTER = [1, -1, 2, 0, 1]  # adapter index of each batch row (-1: base model), deliberately unsorted
SEQ_LEN = 12
LAYERS = 4  # of SmolLM2's 30: the property does not depend on depth, and the TPU-style kernels'
# interpreter took 89 s (fused_tpu) and 59 s (pallas_tpu) over all 30 on 2 CPU cores


def first_layers(model, layers: int):
    """The model cut to its first `layers` decoder layers (their real weights; embedding, final norm
    and head as they are): a smaller model of the same kind for tests."""
    config = dataclasses.replace(model.config, num_layers=layers)
    weights = {name: (param[...][:layers] if name.startswith("layers.") else param[...])
               for name, param in model.weights.items()}
    return type(model)(config, weights=weights, dtype=model.dtype)


@pytest.fixture(scope="module")
def setup(smollm2):
    return make_setup(first_layers(smollm2[0], LAYERS))


def make_setup(model):
    """(model, 3 adapters, a pool holding them, their slots, random tokens [5, SEQ_LEN])."""
    adapters = [
        random_adapter(f"rank{r}", model.config,
                       LoraConfig(r=r, lora_alpha=2.0 * r, target_modules=PROJECTIONS, use_rslora=(r == 64)),
                       seed=r, b_std=0.05)
        for r in RANKS
    ]
    pool = AdapterPool(model.config, num_slots=4, max_rank=64)
    slots = [pool.load(adapter) for adapter in adapters]
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (len(ROW_ADAPTER), SEQ_LEN))
    return model, adapters, pool, slots, tokens


def _forward(model, tokens, pool_arrays, token_slot, backend):
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    plan = build_plan(token_slot)
    run = jax.jit(lambda t, p, lora: model(t, p, lora=lora, lora_backend=backend)[0])
    return np.asarray(run(tokens, positions, LoraInputs(pool_arrays, plan)))


def _alone(model, adapters, row_tokens, adapter_index):
    """The row run by itself: base model, or a pool holding only its adapter."""
    positions = np.arange(row_tokens.shape[0])[None]
    if adapter_index < 0:
        return np.asarray(model(row_tokens[None], positions)[0][0])
    pool = AdapterPool(model.config, num_slots=1, max_rank=adapters[adapter_index].max_rank)
    pool.load(adapters[adapter_index])
    lora = LoraInputs(pool.arrays, build_plan(np.zeros((1, row_tokens.shape[0]))))
    return np.asarray(model(row_tokens[None], positions, lora=lora, lora_backend="loop")[0][0])


@pytest.fixture(scope="module")
def alone_logits(setup):
    model, adapters, _, _, tokens = setup
    return [_alone(model, adapters, tokens[row], index) for row, index in enumerate(ROW_ADAPTER)]


@pytest.mark.parametrize("backend", TESTED_BACKENDS)
def test_mixed_batch_equals_each_adapter_alone(setup, alone_logits, backend):
    model, _, pool, slots, tokens = setup
    token_slot = np.array([[slots[i] if i >= 0 else -1] * SEQ_LEN for i in ROW_ADAPTER])
    mixed = _forward(model, tokens, pool.arrays, token_slot, backend)
    for row, expected in enumerate(alone_logits):
        assert relative_error(mixed[row], expected) <= 1e-5, f"row {row} (adapter {ROW_ADAPTER[row]})"


def test_adapters_change_the_output(setup, alone_logits):
    """Guards the test above: each adapter's rows differ clearly from the base model's."""
    model, _, _, _, tokens = setup
    for row, index in enumerate(ROW_ADAPTER):
        if index >= 0:
            base = np.asarray(model(tokens[row][None], np.arange(SEQ_LEN)[None])[0][0])
            assert relative_error(alone_logits[row], base) > 1e-2


def test_tokens_of_one_row_may_use_different_adapters(setup):
    """Packed rows hold samples of different adapters: slots can change inside a row."""
    model, _, pool, slots, tokens = setup
    token_slot = np.full(tokens.shape, -1)
    token_slot[0, 6:] = slots[2]
    token_slot[2, :4] = slots[0]
    gather = _forward(model, tokens, pool.arrays, token_slot, "gather")
    for backend in ("loop", "ragged_dot", "onehot"):
        assert relative_error(_forward(model, tokens, pool.arrays, token_slot, backend), gather) <= 1e-5
