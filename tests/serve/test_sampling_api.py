"""vLLM's sampling parameters through the official `openai` client against the shared live server
(tests/serve/conftest.py): top_k=1 equals greedy, logit_bias forces a token, min_tokens holds EOS
back, stop_token_ids and ignore_eos, penalties as defined (the server's greedy tokens against the
model's logits penalised by a NumPy reference), logprobs equal log-softmax of the model's logits,
rows with different parameters batched together get what they get alone, echo, /tokenize and
/detokenize, and fields the server does not implement refused with 400 naming them."""

import concurrent.futures

import httpx
import jax.numpy as jnp
import numpy as np
import openai
import pytest

BASE = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Say hello."}]


def _complete(client, prompt=PROMPT, max_tokens=8, **kw):
    kw.setdefault("temperature", 0)
    extra = {k: kw.pop(k) for k in ("top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos",
                                     "min_tokens") if k in kw}
    return client.completions.create(model=BASE, prompt=prompt, max_tokens=max_tokens, extra_body=extra, **kw)


def _ids(tokenizer, text):
    return tokenizer.encode(text)


def _model_log_softmax(model, tokens):
    """log-softmax of the model's logits [len(tokens), V] at every position (float64 NumPy)."""
    logits, _ = model(jnp.asarray([tokens]), jnp.arange(len(tokens))[None])
    logits = np.asarray(logits[0], np.float64)
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True), logits


def _greedy_chat(client, **kw):
    response = client.chat.completions.create(model=BASE, messages=CHAT, max_tokens=48, temperature=0, **kw)
    return response.choices[0], response.usage.completion_tokens


def test_top_k_one_equals_greedy(client):
    greedy = _complete(client, max_tokens=12).choices[0].text
    assert _complete(client, max_tokens=12, temperature=1.0, top_k=1, seed=3).choices[0].text == greedy
    chat, _ = _greedy_chat(client)
    sampled = client.chat.completions.create(model=BASE, messages=CHAT, max_tokens=48, temperature=1.5, seed=9,
                                             extra_body={"top_k": 1})
    assert sampled.choices[0].message.content == chat.message.content


def test_logit_bias_forces_a_token(client, smollm2):
    _, tokenizer = smollm2
    token = _ids(tokenizer, " banana")[0]
    response = _complete(client, max_tokens=4, logit_bias={str(token): 100})
    assert response.choices[0].text == tokenizer.decode([token] * 4)
    chat = client.chat.completions.create(model=BASE, messages=CHAT, max_tokens=3, temperature=0.7,
                                          logit_bias={str(token): 100})
    assert chat.choices[0].message.content == tokenizer.decode([token] * 3)


def test_min_tokens_holds_eos_back_and_ignore_eos(client):
    choice, used = _greedy_chat(client)
    assert choice.finish_reason == "stop" and used < 40  # ends with EOS on its own
    held, held_used = _greedy_chat(client, extra_body={"min_tokens": used + 5})
    assert held_used >= used + 5
    assert held.message.content.startswith(choice.message.content)
    ignored, ignored_used = _greedy_chat(client, extra_body={"ignore_eos": True})
    assert ignored.finish_reason == "length" and ignored_used == 48


def test_stop_token_ids_stop(client, smollm2):
    _, tokenizer = smollm2
    full = _complete(client, max_tokens=12)
    ids = _ids(tokenizer, full.choices[0].text)
    stop_at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    cut = _complete(client, max_tokens=12, stop_token_ids=[ids[stop_at]])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens == stop_at + 1  # the stop token counts, its text is not sent
    assert cut.choices[0].text == tokenizer.decode(ids[:stop_at])


def _penalised(logits, prompt, output, presence, frequency, repetition):
    """NumPy reference of vLLM's penalties on one row of logits."""
    counts = np.bincount(output, minlength=len(logits)) if output else np.zeros(len(logits), int)
    seen = counts > 0
    seen[prompt] = True
    logits = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency * counts - presence * (counts > 0)


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=1.6), dict(frequency_penalty=1.5, presence_penalty=0.7)])
def test_penalties_change_the_logits_as_defined(client, smollm2, penalties):
    model, tokenizer = smollm2
    prompt = "Repeat after me: dog dog dog dog dog dog"
    plain = _complete(client, prompt, max_tokens=10)
    response = _complete(client, prompt, max_tokens=10, **penalties)
    assert response.choices[0].text != plain.choices[0].text
    prompt_ids = _ids(tokenizer, prompt)
    output = _ids(tokenizer, prompt + response.choices[0].text)[len(prompt_ids):]
    _, logits = _model_log_softmax(model, prompt_ids + output)
    args = (penalties.get("presence_penalty", 0.0), penalties.get("frequency_penalty", 0.0),
            penalties.get("repetition_penalty", 1.0))
    for i, token in enumerate(output):
        row = _penalised(logits[len(prompt_ids) + i - 1], prompt_ids, output[:i], *args)
        assert token == int(np.argmax(row)), i


def test_logprobs_are_log_softmax_of_the_model_logits(client, smollm2):
    model, tokenizer = smollm2
    response = _complete(client, max_tokens=6, logprobs=5)
    logprobs = response.choices[0].logprobs
    prompt_ids = _ids(tokenizer, PROMPT)
    output = _ids(tokenizer, PROMPT + response.choices[0].text)[len(prompt_ids):]
    assert "".join(logprobs.tokens) == response.choices[0].text and len(logprobs.tokens) == len(output)
    reference, _ = _model_log_softmax(model, prompt_ids + output)
    rows = reference[len(prompt_ids) - 1: -1]
    want = rows[np.arange(len(output)), output]
    got = np.array(logprobs.token_logprobs)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-4
    for row, top, offset, text in zip(rows, logprobs.top_logprobs, logprobs.text_offset, logprobs.tokens):
        best = np.argsort(-row)[:5]
        assert set(top) >= {tokenizer.decode([int(i)], skip_special_tokens=False) for i in best}
        assert max(abs(top[tokenizer.decode([int(i)], skip_special_tokens=False)] - row[i]) for i in best) <= 1e-4
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[-1] == len(response.choices[0].text) - len(text)

    chat = client.chat.completions.create(model=BASE, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[2].logprob
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)  # greedy: the most likely
    streamed = client.chat.completions.create(model=BASE, messages=CHAT, max_tokens=4, temperature=0,
                                              logprobs=True, top_logprobs=3, stream=True)
    entries = [c for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
               for c in chunk.choices[0].logprobs.content]
    assert [c.token for c in entries] == [c.token for c in content]


def test_rows_with_different_parameters_batched_get_what_they_get_alone(client, smollm2):
    _, tokenizer = smollm2
    token = str(_ids(tokenizer, " Paris")[0])
    jobs = [dict(), dict(top_k=1, temperature=1.0, seed=1), dict(temperature=0.9, seed=5, top_k=20, min_p=0.05),
            dict(repetition_penalty=1.5), dict(frequency_penalty=1.0, presence_penalty=1.0, temperature=0.8, seed=2),
            dict(logit_bias={token: 8}), dict(min_tokens=10, temperature=0.7, top_p=0.8, seed=4), dict(logprobs=2)]
    prompts = ["Once upon a time", "Water boils at", "My favourite food is", "The quick brown fox"]

    def run(i):
        response = _complete(client, prompts[i % 4], max_tokens=10, **jobs[i])
        logprobs = response.choices[0].logprobs
        return response.choices[0].text, logprobs and logprobs.token_logprobs

    alone = [run(i) for i in range(len(jobs))]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(run, range(len(jobs))))
    assert [t for t, _ in together] == [t for t, _ in alone]
    np.testing.assert_allclose(together[-1][1], alone[-1][1], rtol=1e-4)  # f32 GEMMs of other shapes
    assert len({t for t, _ in alone}) > 4


def test_echo_prepends_the_prompt(client):
    plain = _complete(client, max_tokens=4).choices[0].text
    assert _complete(client, max_tokens=4, echo=True).choices[0].text == PROMPT + plain
    streamed = "".join(c.choices[0].text for c in _complete(client, max_tokens=4, echo=True, stream=True))
    assert streamed == PROMPT + plain


@pytest.mark.parametrize("extra,field", [
    ({"frobnicate": 1}, "frobnicate"), ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"best_of": 3}, "best_of"), ({"top_k": -2}, "top_k"), ({"min_p": 2.0}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logprobs": 50}, "logprobs"), ({"min_tokens": 9}, "min_tokens"),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "continuous_usage_stats"),
])
def test_unsupported_or_out_of_range_fields_are_400_naming_them(client, extra, field):
    with pytest.raises(openai.BadRequestError, match=field) as err:
        client.completions.create(model=BASE, prompt="Hi", max_tokens=4, extra_body=extra)
    assert err.value.body["param"].endswith(field) or field in err.value.body["message"]


@pytest.mark.parametrize("extra,field", [({"tool_choice": "auto"}, "tool_choice"), ({"top_logprobs": 2}, "top_logprobs"),
                                         ({"messages": [{"role": "user", "content": "Hi", "nick": "x"}]}, "nick")])
def test_unsupported_chat_fields_are_400_naming_them(client, extra, field):
    with pytest.raises(openai.BadRequestError, match=field):
        client.chat.completions.create(model=BASE, messages=CHAT, max_tokens=2, extra_body=extra)


def test_tokenize_and_detokenize(live_server, smollm2):
    _, tokenizer = smollm2
    text = "Hello, tokenizer world!"
    body = httpx.post(live_server.url + "/tokenize", json={"model": BASE, "prompt": text,
                                                           "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == live_server.engine.config.max_model_len and len(body["token_strs"]) == body["count"]
    chat = httpx.post(live_server.url + "/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(CHAT))
    back = httpx.post(live_server.url + "/detokenize", json={"model": BASE, "tokens": body["tokens"]}).json()
    assert back == {"prompt": text}
    bad = httpx.post(live_server.url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(live_server.url + "/tokenize", json={"prompt": "x", "extra": 1}).status_code == 400
