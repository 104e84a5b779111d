"""Prompt log-probabilities as evaluation harnesses ask for them (issue 36), through the official
`openai` client against the shared live server (tests/serve/conftest.py: 16-token prefill chunks,
so longer prompts are scored over several steps): `echo` + `logprobs` returns every prompt token
(the first with null) and each generated token, equal to a full forward's log-softmax (the base
model and with adapters, text and token-id prompts); `max_tokens: 0` returns
the prompt alone; vLLM's `prompt_logprobs`; streaming gives the same entries; /tokenizer_info."""

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.lora.plan import build_plan
from jaxlora.lora.pool import AdapterPool
from jaxlora.models.llama import LoraInputs

BASE = "SmolLM2-135M-Instruct"
LONG = ("Question: which planet is known as the red planet, and why does it look red from the Earth? "
        "Answer: Mars, because")


@pytest.fixture(scope="module")
def fresh_model():
    """The model as loaded (the shared one serves: the engine keeps its own serving layout of it)."""
    from jaxlora.weights import load_model

    return load_model()[0]


def _reference(model, adapters8, name, tokens):
    """log-softmax [len(tokens), V] (float64) of one full forward of the model over `tokens`, with
    the adapter `name` (unmerged LoRA; the base model for BASE)."""
    lora = None
    if name != BASE:
        pool = AdapterPool(model.config, num_slots=2, max_rank=16)
        slot = pool.load(adapters8[name])  # before reading pool.arrays
        lora = LoraInputs(pool.arrays, build_plan(np.full((1, len(tokens)), slot)))
    logits, _ = model(jnp.asarray([tokens]), jnp.arange(len(tokens))[None], lora=lora)
    logits = np.asarray(logits[0], np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


@pytest.mark.parametrize("name, as_ids", [(BASE, False), ("ad0", True), ("ad1", False)])
def test_echo_logprobs_equal_a_full_forward(client, smollm2, fresh_model, adapters8, name, as_ids):
    tokenizer = smollm2[1]
    ids = tokenizer.encode(LONG)
    assert len(ids) > 16  # scored over more than one prefill chunk
    reply = client.completions.create(model=name, prompt=ids if as_ids else LONG, max_tokens=1, temperature=0,
                                      echo=True, logprobs=2)
    choice = reply.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) + 1 and choice.text.startswith(LONG)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    reference = _reference(fresh_model, adapters8, name, ids)
    expected = [reference[i, ids[i + 1]] for i in range(len(ids) - 1)]
    np.testing.assert_allclose(logprobs.token_logprobs[1:len(ids)], expected, atol=1e-4, rtol=1e-5)
    # the generated token's entry follows at the harness's index: token_logprobs[len(context):]
    assert logprobs.token_logprobs[len(ids)] == pytest.approx(reference[-1].max(), abs=1e-4)
    for i in range(1, len(ids)):  # each prompt position's top-2 and its own token
        top = logprobs.top_logprobs[i]
        assert logprobs.tokens[i] in top and len(top) >= 2
        assert max(top.values()) == pytest.approx(reference[i - 1].max(), abs=1e-4)


def test_max_tokens_zero_returns_the_prompt_alone(client, smollm2, fresh_model, adapters8):
    tokenizer = smollm2[1]
    ids = tokenizer.encode(LONG)
    reply = client.completions.create(model=BASE, prompt=LONG, max_tokens=0, echo=True, logprobs=1)
    choice = reply.choices[0]
    assert choice.text == LONG and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids) and reply.usage.completion_tokens == 0
    reference = _reference(fresh_model, adapters8, BASE, ids)
    np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], [reference[i, ids[i + 1]]
                                                                    for i in range(len(ids) - 1)], atol=1e-4)


def test_max_tokens_zero_needs_echo(live_server):
    response = httpx.post(live_server.url + "/v1/completions", json={"model": BASE, "prompt": "Hi", "max_tokens": 0})
    assert response.status_code == 400 and "echo" in response.json()["error"]["message"]


def test_vllm_prompt_logprobs_field(client, smollm2, fresh_model, adapters8):
    tokenizer = smollm2[1]
    ids = tokenizer.encode(LONG)
    reply = client.completions.create(model="ad0", prompt=LONG, max_tokens=2, temperature=0,
                                      extra_body={"prompt_logprobs": 3})
    scored = reply.choices[0].model_extra["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    reference = _reference(fresh_model, adapters8, "ad0", ids)
    for i in range(1, len(ids)):
        entry = scored[i]
        assert entry[str(ids[i])]["logprob"] == pytest.approx(reference[i - 1, ids[i]], abs=1e-4)
        assert len(entry) >= 3  # the top 3 (and the prompt token, when it is not among them)
    assert reply.choices[0].logprobs is None  # generated tokens' logprobs were not asked for


def test_streaming_echo_logprobs_equal_the_reply(client):
    plain = client.completions.create(model="ad1", prompt=LONG, max_tokens=3, temperature=0, echo=True, logprobs=1)
    chunks = list(client.completions.create(model="ad1", prompt=LONG, max_tokens=3, temperature=0, echo=True,
                                            logprobs=1, stream=True))
    tokens, values = [], []
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
    assert tokens == plain.choices[0].logprobs.tokens
    assert values[0] is None
    np.testing.assert_allclose(values[1:], plain.choices[0].logprobs.token_logprobs[1:], atol=1e-6)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text


def test_tokenizer_info(live_server, smollm2):
    tokenizer = smollm2[1]
    info = httpx.get(live_server.url + "/tokenizer_info").json()
    assert info["chat_template"] == tokenizer.chat_template and info["chat_template"]
    assert info["eos_token_ids"] == list(tokenizer.eos_token_ids)
    assert info["eos_token"] == tokenizer.token_text(tokenizer.eos_token_ids[0])
    assert info["model_max_length"] == live_server.engine.config.max_model_len
    assert any(entry["special"] for entry in info["added_tokens_decoder"].values())
