"""A live server driven by the official `openai` client: completions, chat, streaming, concurrent
clients, adapters loaded and unloaded at run time, /v1/models, /health, /metrics."""

import concurrent.futures

import httpx
import openai
import pytest

from jaxlora.generate import SamplingParams, generate
from jaxlora.lora.peft_io import save_peft_adapter

BASE = "SmolLM2-135M-Instruct"


def _complete(client, model, prompt, max_tokens=8, **kw):
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)


def test_models_lists_base_and_adapters(client):
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == BASE and {"ad0", "ad1"} <= set(ids)


def test_base_completion_equals_generate(client, smollm2):
    model, tokenizer = smollm2
    prompt = "The capital of France is"
    expected = generate(model, [tokenizer.encode(prompt)], SamplingParams(max_new_tokens=8), tokenizer.eos_token_ids)[0]
    response = _complete(client, BASE, prompt)
    assert response.choices[0].text == tokenizer.decode(expected)
    assert response.usage.completion_tokens == len(expected)
    assert response.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert response.choices[0].finish_reason in ("stop", "length")


def test_adapter_changes_the_completion(client):
    texts = {m: _complete(client, m, "My favourite food is").choices[0].text for m in (BASE, "ad0", "ad1")}
    assert len(set(texts.values())) == 3


def test_chat_and_streaming_match_non_streaming(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client.chat.completions.create(model=BASE, messages=messages, max_tokens=10, temperature=0)
    assert "Paris" in plain.choices[0].message.content
    stream = client.chat.completions.create(model=BASE, messages=messages, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens

    plain = _complete(client, "ad1", "Once upon a time")
    streamed = "".join(c.choices[0].text for c in _complete(client, "ad1", "Once upon a time", stream=True))
    assert streamed == plain.choices[0].text


def test_n_choices_and_stop_strings(client):
    response = client.completions.create(model=BASE, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0.9,
                                         n=3, seed=5)
    assert [c.index for c in response.choices] == [0, 1, 2]
    again = client.completions.create(model=BASE, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0.9,
                                      n=3, seed=5)
    assert [c.text for c in again.choices] == [c.text for c in response.choices]
    full = _complete(client, BASE, "Count: 1, 2, 3,", max_tokens=12).choices[0].text
    stop = full.strip()[:2]
    cut = _complete(client, BASE, "Count: 1, 2, 3,", max_tokens=12, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]


def test_concurrent_clients_get_their_own_answers(client):
    jobs = [(m, p) for m in (BASE, "ad0", "ad1") for p in ("Water boils at", "The quick brown fox")]
    alone = [_complete(client, m, p).choices[0].text for m, p in jobs]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: _complete(client, *job).choices[0].text, jobs))
    assert together == alone


def test_load_and_unload_adapter_at_run_time(client, live_server, adapters8, allowed_dir):
    path = allowed_dir / "late"
    save_peft_adapter(adapters8["ad5"], str(path))
    url = live_server.url
    response = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(path)})
    assert response.status_code == 200, response.text
    assert "late" in [m.id for m in client.models.list().data]
    first = _complete(client, "late", "In 1492,").choices[0].text
    assert first != _complete(client, BASE, "In 1492,").choices[0].text
    # three adapters now share two device slots: using them all evicts and reloads "late"
    for name in ("ad0", "ad1"):
        _complete(client, name, "In 1492,")
    assert _complete(client, "late", "In 1492,").choices[0].text == first
    assert httpx.post(f"{url}/v1/load_lora_adapter",
                      json={"lora_name": "late", "lora_path": str(path)}).status_code == 400  # already loaded
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "late", "In 1492,")
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404


def test_health_and_metrics(live_server, client):
    assert httpx.get(live_server.url + "/health").json() == {"status": "ok"}
    _complete(client, BASE, "Hello")
    text = httpx.get(live_server.url + "/metrics").text
    for name in ("jaxlora_requests_running", "jaxlora_requests_waiting", "jaxlora_adapters_on_device",
                 "jaxlora_generation_tokens_per_second", "jaxlora_time_to_first_token_seconds_bucket",
                 "jaxlora_request_latency_seconds_count", "jaxlora_kv_pages_free"):
        assert name in text
    assert 'jaxlora_requests_total{endpoint="completions",status="ok"}' in text
    # the engine's steps per kind and host seconds per phase, as its stats count them
    steps = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
             if line.startswith("jaxlora_engine_steps{")}
    assert steps and all(count >= 1 for count in steps.values()) and not any(" " in kind for kind in steps)
    assert all(len(line.split(" ")) == 2 for line in text.splitlines() if line and not line.startswith("#"))
    assert any(line.startswith('jaxlora_engine_step_seconds_sum{kind="') for line in text.splitlines())
    phases = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("jaxlora_engine_step_phase_seconds_sum{")}
    assert {"schedule", "dispatch"} <= set(phases) and all(seconds >= 0 for seconds in phases.values())
    assert sum(steps.values()) <= live_server.engine.stats.steps  # read before the later steps
