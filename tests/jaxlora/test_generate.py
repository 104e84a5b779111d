"""The generation helper: greedy answers, EOS stopping, sampling with temperature and top-p."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.generate import SamplingParams, generate, generate_text, sample_next


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
    drawn = np.array([int(sample_next(logits, k, 1.0, 0.7)[0]) for k in keys])
    assert set(drawn) == {0, 1}  # 0.5 + 0.3 >= 0.7: tokens 2 and 3 are never drawn
    assert abs((drawn == 0).mean() - 0.5 / 0.8) < 0.08


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
