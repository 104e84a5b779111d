"""The paged-KV forward on a tiny random model: chunked prefill into scattered pages, then
one-token (decode-shaped) steps, gives the logits of the contiguous-cache forward (`Llama.__call__`)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlora.nn.model_config import LlamaConfig
from jaxlora.models.llama import KVCache, Llama, SplitLayersLlama, split_layers
from jaxlora.models.paged import PagedBatch, PagedKVCache, paged_forward

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8, max_position_embeddings=64)


@pytest.mark.parametrize("split", [False, True], ids=["stacked", "split_layers"])
def test_paged_steps_equal_contiguous_forward(split):
    """Also with the layers' weights one array a layer (`split_layers`: a Python loop over them)."""
    stacked = Llama(CONFIG, rngs=nnx.Rngs(3))
    model = split_layers(Llama(CONFIG, rngs=nnx.Rngs(3))) if split else stacked
    if split:  # the class survives nnx's split and merge (what a jitted engine step does)
        assert isinstance(nnx.merge(*nnx.split(model)), SplitLayersLlama)
        assert len(model.layer_weights()) == CONFIG.num_layers
        assert not any(name.startswith("layers.") for name in model.weights)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, 11), rng.integers(0, 64, 6)]
    # contiguous reference: full-prompt logits at every position
    reference = []
    for prompt in prompts:
        logits, _ = stacked(jnp.asarray(prompt)[None], jnp.arange(len(prompt))[None],
                          cache=KVCache.zeros(CONFIG, 1, 16))
        reference.append(np.asarray(logits[0]))
    page_size, tables = 4, np.array([[7, 2, 5, 0], [3, 6, 1, 0]], np.int32)  # scattered pages
    cache = PagedKVCache.zeros(CONFIG, num_pages=8, page_size=page_size)
    done = [0, 0]
    for chunk in (4, 4, 1, 1, 1):  # both rows in one flat token list; 1-token steps are decode-shaped
        tokens, positions, rows, last, active = [], [], [], [], []
        for r, prompt in enumerate(prompts):
            take = list(range(done[r], min(done[r] + chunk, len(prompt))))
            tokens += [int(prompt[i]) for i in take]
            positions += take
            rows += [r] * len(take)
            last.append(len(tokens) - 1)
            if take:
                active.append(r)
            done[r] += len(take)
        pad = 12 - len(tokens)
        batch = PagedBatch(jnp.asarray(tokens + [0] * pad), jnp.asarray(positions + [0] * pad),
                           jnp.asarray(rows + [-1] * pad), jnp.asarray(tables), jnp.asarray(last))
        logits, cache = paged_forward(model, batch, cache)
        assert active
        for r in active:
            np.testing.assert_allclose(np.asarray(logits[r]), reference[r][done[r] - 1], rtol=2e-4, atol=2e-4)
