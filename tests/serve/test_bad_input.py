"""Bad input answered with the right status and a message, and the server keeps serving:
unknown model 404, malformed JSON/fields 400, prompt over the context 400, out-of-range
max_tokens/temperature/n 400, adapter path outside the allowed directories 403, corrupt adapter
400, body too large 413, a request dropped by early abort (TTFT objective) 503, and a client that
disconnects mid-stream frees its KV pages."""

import json
import time

import httpx
import openai
import pytest

from tests.serve.conftest import BODY_LIMIT

BASE = "SmolLM2-135M-Instruct"


def _post(server, path, body, **kw):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers={"Content-Type": "application/json"}, timeout=60, **kw)


def _error(response, status):
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    assert message
    return message


def test_unknown_model_is_404(client, live_server):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt="Hi", max_tokens=2)
    assert "does not exist" in _error(_post(live_server, "/v1/chat/completions",
                                            {"model": "nope", "messages": [{"role": "user", "content": "Hi"}]}), 404)


@pytest.mark.parametrize("body", ['{"model": "x", "prompt": ', "[1, 2]", "not json at all"])
def test_malformed_json_is_400(live_server, body):
    _error(_post(live_server, "/v1/completions", body), 400)


@pytest.mark.parametrize("body", [
    {"model": BASE},                                          # no prompt
    {"model": BASE, "prompt": {"text": "hi"}},                # wrong type
    {"model": BASE, "prompt": "hi", "max_tokens": "many"},
    {"model": BASE, "messages": "hi"},
])
def test_malformed_fields_are_400(live_server, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    _error(_post(live_server, path, body), 400)


def test_chat_with_bad_messages_is_400(live_server):
    for messages in ([], [{"role": "wizard", "content": "hi"}], [{"content": "hi"}]):
        _error(_post(live_server, "/v1/chat/completions", {"model": BASE, "messages": messages}), 400)


def test_prompt_longer_than_the_context_is_400(client, live_server):
    context = live_server.engine.config.max_model_len
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=BASE, prompt="hello " * (context + 10), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=BASE, prompt=[1] * context, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="context"):  # fits alone, not with max_tokens
        client.completions.create(model=BASE, prompt=[1] * (context - 10), max_tokens=20)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", 10**6), ("max_tokens", -3), ("temperature", -0.5), ("temperature", 7.0),
    ("n", 0), ("n", 1000), ("top_p", 0.0), ("top_p", 1.5),
])
def test_out_of_range_values_are_400(client, field, value):
    with pytest.raises(openai.BadRequestError, match=field):
        client.completions.create(model=BASE, prompt="Hi", **{"max_tokens": 2, field: value})


def test_out_of_range_in_chat_is_400(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "Hi"}], temperature=3)


def test_token_ids_outside_the_vocabulary_are_400(client):
    with pytest.raises(openai.BadRequestError, match="token ids"):
        client.completions.create(model=BASE, prompt=[10**9], max_tokens=2)


def test_body_too_large_is_413(live_server):
    body = {"model": BASE, "prompt": "x" * (BODY_LIMIT + 10)}
    _error(_post(live_server, "/v1/completions", body), 413)


def test_adapter_path_outside_the_allowed_dirs_is_403(live_server, adapters8, allowed_dir, tmp_path):
    from jaxlora.lora.peft_io import save_peft_adapter

    save_peft_adapter(adapters8["ad2"], str(tmp_path / "outside"))
    message = _error(_post(live_server, "/v1/load_lora_adapter",
                           {"lora_name": "outside", "lora_path": str(tmp_path / "outside")}), 403)
    assert "allowed" in message
    _error(_post(live_server, "/v1/load_lora_adapter",  # ".." does not escape either
                 {"lora_name": "sneaky", "lora_path": f"{allowed_dir}/../{tmp_path.name}/outside"}), 403)


def test_corrupt_adapter_is_400_and_the_server_keeps_serving(client, live_server, adapters8, allowed_dir):
    from jaxlora.lora.peft_io import save_peft_adapter

    path = allowed_dir / "corrupt"
    save_peft_adapter(adapters8["ad3"], str(path))
    weights = path / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: 200])  # truncated
    message = _error(_post(live_server, "/v1/load_lora_adapter", {"lora_name": "corrupt", "lora_path": str(path)}), 400)
    assert "corrupt" in message
    (path / "adapter_config.json").write_text("{ not json")
    _error(_post(live_server, "/v1/load_lora_adapter", {"lora_name": "corrupt", "lora_path": str(path)}), 400)
    _error(_post(live_server, "/v1/load_lora_adapter",
                 {"lora_name": "missing", "lora_path": str(allowed_dir / "missing")}), 400)
    assert "corrupt" not in [m.id for m in client.models.list().data]
    assert client.completions.create(model="ad0", prompt="Hi", max_tokens=2, temperature=0).choices[0].text


def test_request_that_cannot_meet_the_ttft_objective_is_503_and_the_server_keeps_serving(client, live_server):
    import dataclasses

    engine = live_server.engine
    config = engine.config
    engine.config = dataclasses.replace(config, ttft_slo_s=1e-6)  # no queued request can meet it
    try:
        response = _post(live_server, "/v1/completions", {"model": BASE, "prompt": "Hello", "max_tokens": 4})
        assert "time-to-first-token" in _error(response, 503)
        assert response.json()["error"]["type"] == "server_error"
    finally:
        engine.config = config
    assert b"jaxlora_requests_dropped_overloaded 1.0" in httpx.get(live_server.url + "/metrics").content
    assert client.completions.create(model=BASE, prompt="Hi", max_tokens=2, temperature=0).choices[0].text


def test_disconnect_mid_stream_frees_kv_pages(live_server):
    engine = live_server.engine
    initial = engine.config.num_pages
    _wait_for(lambda: engine.free_pages == initial)
    before = _disconnected(live_server)
    body = {"model": "ad1", "prompt": "Count to one hundred: 1, 2, 3,", "max_tokens": 60, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", live_server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        chunks = [next(lines) for _ in range(3)]
        assert any(c.startswith("data: ") for c in chunks)
        assert engine.free_pages < initial  # the request holds pages while it streams
    _wait_for(lambda: engine.free_pages == initial and not engine.scheduler.has_work())
    _wait_for(lambda: _disconnected(live_server) == before + 1)


def _wait_for(condition, timeout=60.0):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_disconnect_while_waiting_for_a_non_streaming_answer_frees_kv_pages(live_server):
    engine = live_server.engine
    initial = engine.config.num_pages
    _wait_for(lambda: engine.free_pages == initial)
    before = _disconnected(live_server)
    body = {"model": BASE, "prompt": "List the numbers: 1, 2, 3,", "max_tokens": 60, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live_server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    _wait_for(lambda: engine.free_pages == initial and not engine.scheduler.has_work())
    _wait_for(lambda: _disconnected(live_server) == before + 1)


def _disconnected(server) -> float:
    """The server's count of completions requests whose client went away."""
    key = 'jaxlora_requests_total{endpoint="completions",status="disconnected"} '
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(key):
            return float(line[len(key):])
    return 0.0
