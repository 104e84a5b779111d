"""Errors answered before any handler runs, in OpenAI's error shape: an unknown route 404, a wrong
method 405 (with `Allow`), and a body over --max-body-bytes 413, which a urllib client still sending
its body receives (the server reads and discards the body up to a bound first) rather than a
broken pipe; chunked bodies too; a body past the bound is not read and its connection closes.

The server is `create_app` under uvicorn with a stand-in engine that is already "running": none of
these requests reaches the engine, so no model is loaded or compiled."""

import asyncio
import json
import types
import urllib.error
import urllib.request

import httpx
import pytest
from starlette.testclient import TestClient

from serve.app import ServerSettings, create_app
from serve.body_limit import BodyLimit
from serve.protocol import Limits
from serve.router import Router, create_router_app
from tests.serve.conftest import LiveServer

LIMIT = 1 << 20


@pytest.fixture(scope="module")
def server():
    engine = types.SimpleNamespace(alive=True, stop=lambda: None)  # start_engine: ready at once
    app = create_app(engine, None, ServerSettings("base", limits=Limits(max_body_bytes=LIMIT)))
    with LiveServer(app, engine) as live:
        yield live


def _openai_error(status: int, body: bytes) -> dict:
    """The error object of an OpenAI-shaped error body with `status`."""
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, error
    assert error["message"] and error["type"]
    return error


@pytest.mark.parametrize("method,path", [("GET", "/nope"), ("POST", "/v1/nope"), ("GET", "/v1/completions/x")])
def test_unknown_route_is_an_openai_404(server, method, path):
    response = httpx.request(method, server.url + path)
    assert response.status_code == 404
    error = _openai_error(404, response.content)
    assert error["type"] == "not_found_error" and path in error["message"]
    assert "detail" not in response.json()


@pytest.mark.parametrize("method,path,allowed", [("GET", "/v1/completions", "POST"),
                                                 ("DELETE", "/v1/chat/completions", "POST"),
                                                 ("POST", "/v1/models", "GET")])
def test_wrong_method_is_an_openai_405(server, method, path, allowed):
    response = httpx.request(method, server.url + path)
    assert response.status_code == 405
    error = _openai_error(405, response.content)
    assert error["type"] == "invalid_request_error" and f"{method} {path}" in error["message"]
    assert response.headers["allow"] == allowed and allowed in error["message"]


def _urllib_post(url: str, size: int) -> tuple[int, bytes]:
    """(status, body) of a urllib POST of `size` bytes; a connection error fails the test."""
    request = urllib.request.Request(url, data=b"x" * size, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@pytest.mark.parametrize("size", [1_200_000, 2_000_000])
def test_over_limit_body_413_reaches_a_urllib_client(server, size):
    for _ in range(20):
        status, body = _urllib_post(server.url + "/v1/completions", size)
        assert status == 413
        assert str(LIMIT) in _openai_error(413, body)["message"]


def test_chunked_over_limit_body_is_413(server):
    def chunks():
        for _ in range(40):
            yield b"x" * 65536

    response = httpx.post(server.url + "/v1/chat/completions", content=chunks(),
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    _openai_error(413, response.content)


def _run_body_limit(length: int, messages: list[bytes]) -> tuple[int, dict, int]:
    """Runs BodyLimit (limit 100) over a request declaring `length` bytes whose body arrives as
    `messages`; (status sent, headers sent, messages read)."""
    sent, read = [], 0

    async def receive():
        nonlocal read
        read += 1
        return {"type": "http.request", "body": messages[read - 1], "more_body": read < len(messages)}

    async def send(message):
        sent.append(message)

    async def inner(scope, receive, send):
        raise AssertionError("the app must not see an over-limit body")

    scope = {"type": "http", "path": "/v1/completions", "headers": [(b"content-length", str(length).encode())]}
    asyncio.run(BodyLimit(inner, max_bytes=100)(scope, receive, send))
    headers = {k.decode().lower(): v.decode() for k, v in sent[0]["headers"]}
    return sent[0]["status"], headers, read


def test_body_limit_drains_up_to_its_bound_then_closes():
    assert BodyLimit.drain_bound(100) == 800 and BodyLimit.drain_bound(1 << 30) == 64 << 20
    status, headers, read = _run_body_limit(300, [b"x" * 100] * 3)
    assert (status, read) == (413, 3) and "connection" not in headers  # read to its end: kept open
    status, headers, read = _run_body_limit(801, [b"x" * 100] * 9)
    assert (status, read, headers["connection"]) == (413, 0, "close")  # past the bound: not read


def test_router_answers_openai_errors():
    app = create_router_app(Router(["http://127.0.0.1:9"]), max_body_bytes=1000)
    with TestClient(app) as client:
        response = client.get("/nope")
        assert response.status_code == 404 and _openai_error(404, response.content)["type"] == "not_found_error"
        response = client.get("/v1/completions")
        assert response.status_code == 405 and response.headers["allow"] == "POST"
        _openai_error(405, response.content)
        response = client.post("/v1/completions", content=b"x" * 2000)
        assert response.status_code == 413
        _openai_error(413, response.content)
