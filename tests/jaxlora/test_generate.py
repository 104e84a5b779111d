"""The generation helper: greedy answers, EOS stopping, sampling with temperature and top-p."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.generate import SamplingParams, generate, generate_text
from jaxlora.sampling import sample_rows


def test_greedy_chat_answers(smollm2):
    model, tokenizer = smollm2
    answers = generate_text(
        model, tokenizer, ["What is 2 + 3?", "What is the capital of France?"],
        SamplingParams(max_new_tokens=12), chat=True,
    )
    assert "5" in answers[0]
    assert "Paris" in answers[1]


def test_batched_greedy_equals_one_at_a_time(smollm2):
    model, tokenizer = smollm2
    prompts = [tokenizer.encode(t) for t in ["Hello, my name is", "The three primary colors are red,"]]
    params = SamplingParams(max_new_tokens=8)
    together = generate(model, prompts, params)
    alone = [generate(model, [p], params)[0] for p in prompts]
    assert together == alone


def test_stops_at_eos(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}]))
    output = generate(model, [prompt], SamplingParams(max_new_tokens=64), tokenizer.eos_token_ids)[0]
    assert output[-1] in tokenizer.eos_token_ids and len(output) < 64


def test_sampling_is_seeded_and_varies(smollm2):
    model, tokenizer = smollm2
    prompt = [tokenizer.encode("Once upon a time")]
    first = generate(model, prompt, SamplingParams(max_new_tokens=10, temperature=1.0, seed=1))
    again = generate(model, prompt, SamplingParams(max_new_tokens=10, temperature=1.0, seed=1))
    other = generate(model, prompt, SamplingParams(max_new_tokens=10, temperature=1.0, seed=2))
    assert first == again and first != other


def test_top_p_keeps_only_the_nucleus():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 400)
    drawn = np.array([int(sample_rows(logits, jnp.ones(1), jnp.full(1, 0.7), k[None])[0]) for k in keys])
    assert set(drawn) == {0, 1}  # 0.5 + 0.3 >= 0.7: tokens 2 and 3 are never drawn
    assert abs((drawn == 0).mean() - 0.5 / 0.8) < 0.08


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_structured_outputs_are_refused_not_ignored(smollm2):
    with pytest.raises(ValueError, match="structured"):  # the serving engine applies grammars (serve.structured)
        generate(smollm2[0], [[1, 2]], SamplingParams(4, structured=object()))


def test_generation_with_adapters_equals_merged_weights(smollm2):
    """Rows with different adapters in one batch decode like the adapter merged into the weights."""
    from jaxlora.lora.adapter import random_adapter
    from jaxlora.lora.adapter_config import LoraConfig
    from jaxlora.models.merge import merge_adapter
    from tests.serve.conftest import exact_weights
    from jaxlora.lora.pool import AdapterPool

    model, tokenizer = smollm2
    adapters = [random_adapter(f"a{i}", model.config, LoraConfig(r=8, lora_alpha=32, target_modules=("q_proj", "v_proj", "down_proj")),
                               seed=i, b_std=0.2) for i in range(2)]
    pool = AdapterPool(model.config, num_slots=2, max_rank=8)
    slots = [pool.load(a) for a in adapters]
    prompts = [tokenizer.encode("The weather today is")] * 3
    params = SamplingParams(max_new_tokens=6)
    together = generate(model, prompts, params, pool_arrays=pool.arrays, row_slots=[slots[0], -1, slots[1]])
    expected = []
    for adapter in (adapters[0], None, adapters[1]):
        with exact_weights(model):  # the shared model: unmerging alone leaves float rounding behind
            if adapter is not None:
                merge_adapter(model, adapter)
            expected.append(generate(model, prompts[:1], params)[0])
    assert together == expected
    assert len({tuple(e) for e in expected}) > 1  # the adapters do change the greedy output
