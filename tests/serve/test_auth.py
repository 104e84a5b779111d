"""--api-key: a live server with a key answers 401 in OpenAI's error shape without it or with a
wrong one (through the official `openai` client and raw HTTP), serves the right key, and leaves
/health and /metrics open; with metrics_require_key those need the key too; the CLI takes the key
from JAXLORA_API_KEY."""

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from serve.auth import ApiKeyAuth
from serve.cli import build_parser
from tests.serve.conftest import SMALL_ENGINE, LiveServer

BASE = "SmolLM2-135M-Instruct"
KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def keyed_server(smollm2):
    """A server with an API key over an engine started beforehand (the app then skips the warm-up:
    the few requests here compile only the programs they use)."""
    from serve.app import ServerSettings, create_app
    from serve.engine import Engine, EngineConfig
    from serve.protocol import Limits

    model, tokenizer = smollm2
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(max_adapters_on_device=2, **SMALL_ENGINE))
    settings = ServerSettings(BASE, limits=Limits(max_tokens=64), api_key=KEY)
    engine.start()
    with LiveServer(create_app(engine, tokenizer, settings), engine) as server:
        server.wait_ready()
        yield server


def _client(server, key):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def _is_openai_401(response):
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"


def test_missing_or_wrong_key_is_401(keyed_server):
    with pytest.raises(openai.AuthenticationError) as err:
        _client(keyed_server, "sk-wrong").completions.create(model=BASE, prompt="Hi", max_tokens=2)
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    for path, body in [("/v1/completions", {"model": BASE, "prompt": "Hi"}), ("/tokenize", {"prompt": "Hi"})]:
        _is_openai_401(httpx.post(keyed_server.url + path, json=body))
        _is_openai_401(httpx.post(keyed_server.url + path, json=body, headers={"Authorization": KEY}))  # no Bearer
    _is_openai_401(httpx.get(keyed_server.url + "/v1/models"))


def test_the_right_key_works_and_health_metrics_stay_open(keyed_server):
    client = _client(keyed_server, KEY)
    assert client.completions.create(model=BASE, prompt="Hi", max_tokens=2, temperature=0).choices[0].text
    assert [m.id for m in client.models.list().data] == [BASE]
    assert httpx.get(keyed_server.url + "/health").status_code == 200
    assert httpx.get(keyed_server.url + "/metrics").status_code == 200


def test_metrics_require_key():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    for open_paths, status in [(("/health", "/metrics"), 200), ((), 401)]:
        client = TestClient(ApiKeyAuth(app, KEY, open_paths))
        assert client.get("/metrics").status_code == status
        assert client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_cli_takes_the_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("JAXLORA_API_KEY", "from-env")
    assert build_parser().parse_args([]).api_key == "from-env"
    assert build_parser().parse_args(["--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("JAXLORA_API_KEY")
    args = build_parser().parse_args(["--metrics-require-key"])
    assert args.api_key is None and args.metrics_require_key
