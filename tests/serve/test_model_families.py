"""The serving engine on the model families' random checkpoints: chunked prefill and decode over
the paged cache, with a sliding window (8) shorter than the prompts and pages (8), Gemma's soft-caps,
norms and per-layer windows/RoPE bases, base rows and adapter rows in one batch, give the greedy
tokens of the full forward (no cache) run token by token."""

import numpy as np
import pytest

from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.plan import build_plan
from jaxlora.lora.pool import AdapterPool
from jaxlora.nn.model_config import PROJECTIONS
from jaxlora.models.llama import LoraInputs
from jaxlora.sampling import SamplingParams
from jaxlora.weights import load_llama
from serve.engine import Engine, EngineConfig
from tests.jaxlora import hf_checkpoints

NEW_TOKENS = 6
ENGINE = dict(page_size=8, num_pages=48, max_model_len=64, max_num_seqs=4, token_budget=32, prefill_chunk=16,
              max_lora_rank=8)


def full_forward_greedy(model, prompt, adapter=None):
    """Greedy continuation by re-running the whole sequence each step (no cache)."""
    pool = None
    if adapter is not None:
        pool = AdapterPool(model.config, num_slots=1, max_rank=8)
        pool.load(adapter)
    tokens = list(prompt)
    for _ in range(NEW_TOKENS):
        row = np.array([tokens])
        lora = None if pool is None else LoraInputs(pool.arrays, build_plan(np.zeros(row.shape, np.int32)))
        logits, _ = model(row, np.arange(row.shape[1])[None], lora=lora)
        tokens.append(int(np.asarray(logits)[0, -1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_engine_greedy_equals_full_forward(tmp_path, family):
    directory = hf_checkpoints.checkpoint_dir(tmp_path, family)
    hf_checkpoints.save_random_model(getattr(hf_checkpoints, f"tiny_{family}_config")(), directory)
    model = load_llama(directory)
    adapter = random_adapter("ad", model.config, LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS),
                             seed=5, b_std=0.2)
    rng = np.random.default_rng(0)
    requests = [(rng.integers(0, 320, n).tolist(), name) for n, name in ((21, None), (13, "ad"), (30, "ad"))]
    expected = [full_forward_greedy(model, prompt, adapter if name else None) for prompt, name in requests]
    engine = Engine(model, (), EngineConfig(**ENGINE), {"ad": adapter})
    got = {i: [] for i in range(len(requests))}
    for i, (prompt, name) in enumerate(requests):
        engine.submit(i, prompt, name, SamplingParams(NEW_TOKENS), lambda e, i=i: got[i].append(e))
    engine.run_until_idle()
    assert [[e.token for e in got[i] if e.token is not None] for i in range(len(requests))] == expected
