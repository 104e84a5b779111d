"""`jaxlora-router`: one OpenAI-compatible front end over several `jaxlora-serve` processes.

Punica's placement across hosts (`jaxlora.scheduler.serving.placement.place`): for each request
the router reads every backend's `GET /state` (its replicas' batches, free KV pages, page size,
adapters on device), adds its own ledger of the requests it sent there and that are not finished
(so that requests placed in the same instant see each other), and sends the request to the
backend with the largest batch that has room; ties go to a backend holding the request's adapter
(`model` names it), then the lower index. When no backend has room the request waits (up to
`--queue-timeout` seconds, then 503). The prompt's length comes from a backend's `/tokenize`, and
requests go to backends with an explicit max_tokens (the backend's default when the client sets
none), so a request's KV need is known.

A backend that fails (connection refused or lost, e.g. its process killed) is marked unhealthy
and its in-flight requests are re-placed on the others (503 if none has room in time):
- a non-streamed request is sent again from the start (the client has seen nothing of it);
- a stream continues where it stopped: backends are asked for token ids (`return_token_ids`), and
  the continuation is a `/v1/completions` stream on another backend over the prompt's token ids
  plus the tokens already streamed, for the remaining max_tokens, with the same sampling fields;
  its chunks are re-shaped as the original endpoint's (chat chunks for a chat request), so the
  client sees each token once. Greedy outputs are unchanged; a seeded sample continues with
  another random stream, and a stop string that spans the cut is not seen. A stream of several
  choices (n > 1, several prompts) or with logprobs cannot be continued: it ends with a 503 error
  chunk.

`POST /classify` (and `/v1/classify`: task heads, `serve.classify`) is placed as a request of one
token per text and sent again from the start if its backend fails.

`POST /drain {"backend": i}` stops placing on backend i (`"undo": true` resumes); `GET /state`
lists each backend's state, whether it is draining, and idle (draining and no request left).
`GET /metrics`: requests and re-placements. Binds 127.0.0.1 by default; `--api-key` guards it as
`jaxlora-serve`'s does, `--backend-api-key` is sent to the backends.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
import time
import uuid

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import BaseModel, ConfigDict

from jaxlora.scheduler.serving import ReplicaState, place
from serve.app import add_error_handlers
from serve.body_limit import BodyLimit
from serve.auth import ApiKeyAuth
from serve.protocol import ApiError, ChatRequest, ClassifyRequest, CompletionRequest

log = logging.getLogger("jaxlora.router")

# Sampling fields a continuation stream carries over from the original request.
CARRIED = ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "top_k", "min_p", "logit_bias", "stop_token_ids", "ignore_eos", "stream_options", "user")


class BackendDrain(BaseModel):
    """POST /drain of the router: backend index; undo: place on it again."""

    model_config = ConfigDict(extra="forbid")
    backend: int
    undo: bool = False


class BackendReply(Exception):
    """A backend's own error answer (status, body), handed to the client as it is."""

    def __init__(self, status: int, body: bytes):
        super().__init__(status)
        self.status, self.body = status, body


@dataclasses.dataclass
class Backend:
    url: str
    draining: bool = False
    healthy: bool = True
    placed: dict = dataclasses.field(default_factory=dict)  # router request id -> KV pages it takes
    state: dict | None = None  # the last GET /state


@dataclasses.dataclass
class Need:
    """A request's placement needs: tokens so far, most tokens (prompt + max_tokens, summed over its
    sequences), adapter (the `model` field), and its max_tokens per sequence."""

    tokens: int
    max_len: int
    adapter: str
    max_tokens: int


class Router:
    """Backends, their states and the router's ledger (see the module doc)."""

    def __init__(self, urls: list[str], backend_api_key: str | None = None, queue_timeout_s: float = 30.0,
                 state_timeout_s: float = 2.0):
        if not urls:
            raise ValueError("the router needs at least one backend")
        self.backends = [Backend(url.rstrip("/")) for url in urls]
        self.headers = {"Authorization": f"Bearer {backend_api_key}"} if backend_api_key else {}
        self.queue_timeout_s, self.state_timeout_s = queue_timeout_s, state_timeout_s
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=state_timeout_s))
        self.registry = CollectorRegistry()
        self.requests = Counter("jaxlora_router_requests", "Requests placed on a backend", ["backend"],
                                registry=self.registry)
        self.replacements = 0
        self.replaced = Counter("jaxlora_router_replacements", "Requests re-placed after their backend failed",
                                registry=self.registry)
        self.in_flight = Gauge("jaxlora_router_in_flight", "Requests in flight on a backend", ["backend"],
                               registry=self.registry)

    # ---- backend states ---------------------------------------------------------------------
    async def refresh(self) -> None:
        """Reads every backend's /state (a backend that does not answer is unhealthy)."""
        await asyncio.gather(*(self._refresh(backend) for backend in self.backends))

    async def _refresh(self, backend: Backend) -> None:
        try:
            reply = await backend_call(self.client.get(backend.url + "/state", headers=self.headers,
                                                       timeout=self.state_timeout_s))
            reply.raise_for_status()
            backend.state, backend.healthy = reply.json(), True
        except (httpx.HTTPError, ValueError):
            backend.state, backend.healthy = None, False

    def replica_state(self, index: int) -> ReplicaState:
        """Backend `index` as one placement unit: its replicas' batches and rows summed, the free
        pages of its roomiest replica (at most its pages not in the router's ledger), adapters."""
        backend = self.backends[index]
        if backend.state is None:
            return ReplicaState(index, 0, 0, 0, 1, healthy=False)
        replicas = backend.state["replicas"]
        roomiest = max(replicas, key=lambda r: r["free_pages"])
        batch = max(sum(r["batch"] for r in replicas) + backend.state["queued"], len(backend.placed))
        unledgered = sum(r["total_pages"] for r in replicas) - sum(backend.placed.values())
        return ReplicaState(index, batch, sum(r["max_batch"] for r in replicas),
                            min(roomiest["free_pages"], unledgered), roomiest["page_size"],
                            roomiest["reserve_output_kv"],
                            frozenset(name for r in replicas for name in r["adapters_on_device"]),
                            draining=backend.draining or all(r["draining"] for r in replicas),
                            healthy=backend.healthy)

    async def choose(self, request_id: str, need: Need, exclude: list[int]) -> int:
        """The backend for a request (`place`), entered in the ledger; waits for room up to the
        queue timeout. ApiError 503 when no backend is reachable or none had room in time."""
        deadline = time.monotonic() + self.queue_timeout_s
        while True:
            await self.refresh()
            states = [self.replica_state(i) for i in range(len(self.backends))]
            index = place(states, need.tokens, need.max_len, need.adapter, exclude)
            if index is not None:
                self.backends[index].placed[request_id] = states[index].pages_for(need.tokens, need.max_len)
                self.requests.labels(self.backends[index].url).inc()
                self.in_flight.labels(self.backends[index].url).inc()
                return index
            if not any(s.healthy for s in states if s.replica_id not in exclude):
                raise ApiError(503, "no backend is reachable; retry later")
            if time.monotonic() > deadline:
                raise ApiError(503, f"no backend has room for the request ({need.tokens} tokens, up to "
                                    f"{need.max_len}) within {self.queue_timeout_s:g} s; retry later")
            await asyncio.sleep(0.05)

    def release(self, index: int, request_id: str) -> None:
        if self.backends[index].placed.pop(request_id, None) is not None:
            self.in_flight.labels(self.backends[index].url).dec()

    def failed(self, index: int, request_id: str) -> None:
        """Backend `index` failed under a request: unhealthy until its /state answers again."""
        log.warning("backend %s failed; re-placing its request", self.backends[index].url)
        self.backends[index].healthy = False
        self.release(index, request_id)
        self.replacements += 1
        self.replaced.inc()

    # ---- what a request needs ---------------------------------------------------------------
    async def need(self, endpoint: str, body) -> Need:
        """Prompt tokens (by a backend's /tokenize) and max_tokens of `body`; the backend's default
        max_tokens when the body sets none (its /state's limits)."""
        counts, context = await self._prompt_lengths(endpoint, body)
        limits = next((b.state for b in self.backends if b.state is not None), None) or {}
        requested = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if requested is None and endpoint == "/v1/completions":
            requested = limits.get("default_max_tokens", 16)
        longest = max(counts)
        max_tokens = requested or max(1, min(limits.get("max_tokens_limit", context), context - longest))
        return Need(sum(counts) * body.n, (sum(counts) + max_tokens * len(counts)) * body.n, body.model, max_tokens)

    async def classify_need(self, body: ClassifyRequest) -> Need:
        """A /classify body's needs: its texts' tokens (a backend's /tokenize), one more each."""
        texts = [body.input] if isinstance(body.input, str) else body.input
        counts = [(await self._tokenize({"model": body.model, "prompt": t}))["count"] for t in texts[:64]] or [1]
        return Need(sum(counts), sum(counts) + len(counts), body.model, 1)

    async def _prompt_lengths(self, endpoint: str, body) -> tuple[list[int], int]:
        """Token counts of the body's prompts, and the backends' context length."""
        if endpoint == "/v1/chat/completions":
            tokenized = [await self._tokenize({"model": body.model, "messages": [
                m.model_dump(exclude_none=True) for m in body.messages]})]
        else:
            prompt = body.prompt
            prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
            tokenized = [{"count": len(p), "max_model_len": None} if isinstance(p, list) else
                         await self._tokenize({"model": body.model, "prompt": p}) for p in prompts[:64]]
        context = max([t["max_model_len"] or 0 for t in tokenized] + [
            b.state.get("max_model_len", 0) for b in self.backends if b.state is not None])
        return [t["count"] for t in tokenized] or [1], context

    async def _tokenize(self, payload: dict) -> dict:
        for backend in self.backends:
            if not backend.healthy:
                continue
            try:
                reply = await backend_call(self.client.post(backend.url + "/tokenize", json=payload,
                                                            headers=self.headers))
            except httpx.TransportError:
                backend.healthy = False
                continue
            if reply.status_code != 200:
                raise BackendReply(reply.status_code, reply.content)
            return reply.json()
        raise ApiError(503, "no backend is reachable; retry later")

    # ---- forwarding ----------------------------------------------------------------------------
    async def complete(self, endpoint: str, payload: dict, need: Need) -> Response:
        """A non-streamed request: sent again from the start to another backend if its backend fails."""
        request_id, exclude = uuid.uuid4().hex, []
        while True:
            index = await self.choose(request_id, need, exclude)
            try:
                reply = await backend_call(self.client.post(self.backends[index].url + endpoint, json=payload,
                                                            headers=self.headers))
            except httpx.TransportError:
                self.failed(index, request_id)
                exclude.append(index)
                continue
            self.release(index, request_id)
            return Response(reply.content, reply.status_code, media_type=reply.headers.get("content-type"))

    async def open_stream(self, endpoint: str, payload: dict, need: Need, relay: "StreamRelay") -> None:
        """Places a stream and opens it (re-placed while backends fail before answering);
        BackendReply if the backend refuses it."""
        while True:
            index = await self.choose(relay.request_id, need, relay.exclude)
            request = self.client.build_request("POST", self.backends[index].url + endpoint, json=payload,
                                                headers=self.headers)
            try:
                response = await backend_call(self.client.send(request, stream=True))
            except httpx.TransportError:
                self.failed(index, relay.request_id)
                relay.exclude.append(index)
                continue
            if response.status_code != 200:
                body = await response.aread()
                await response.aclose()
                self.release(index, relay.request_id)
                raise BackendReply(response.status_code, body)
            relay.response, relay.backend = response, index
            return


class StreamRelay:
    """One client stream: relays the backend's chunks, keeps the prompt's and the streamed token
    ids, and continues on another backend when its backend fails (see the module doc)."""

    def __init__(self, router: Router, endpoint: str, body, need: Need):
        self.router, self.endpoint, self.body, self.need = router, endpoint, body, need
        self.request_id = uuid.uuid4().hex
        self.exclude: list[int] = []
        self.response: httpx.Response | None = None
        self.backend = -1
        self.prompt_ids: list[int] | None = None
        self.generated: list[int] = []
        self.finished = False
        self.first: dict | None = None  # id, created, model of the first chunk
        self.continued = False

    @property
    def resumable(self) -> bool:
        body = self.body
        single = self.endpoint == "/v1/chat/completions" or isinstance(body.prompt, str) or (
            body.prompt and isinstance(body.prompt[0], int))
        return body.n == 1 and single and not body.logprobs

    async def lines(self):
        """SSE lines for the client."""
        try:
            while True:
                try:
                    async for line in backend_lines(self.response):
                        if line.startswith("data: "):
                            out = self._relay(line[len("data: "):])
                            if out is not None:
                                yield out
                            if out == "data: [DONE]\n\n":
                                return
                    raise httpx.RemoteProtocolError("the stream ended without [DONE]")
                except httpx.TransportError:
                    await self._close()
                    self.router.failed(self.backend, self.request_id)
                    self.exclude.append(self.backend)
                    if self.finished:
                        yield "data: [DONE]\n\n"
                        return
                    try:
                        await self._continue()
                    except (ApiError, BackendReply) as err:
                        yield _sse(err.body() if isinstance(err, ApiError) else _reply_error(err))
                        yield "data: [DONE]\n\n"
                        return
        finally:
            await self._close()
            self.router.release(self.backend, self.request_id)

    async def _close(self) -> None:
        if self.response is not None:
            try:
                await backend_call(self.response.aclose())
            except httpx.TransportError:
                pass  # the backend is gone: nothing left to close

    def _relay(self, data: str) -> str | None:
        """The client's SSE line for one backend line (None: nothing to send)."""
        if data == "[DONE]":
            return "data: [DONE]\n\n"
        chunk = json.loads(data)
        if "error" in chunk:
            return _sse(chunk)
        if self.first is None:
            self.first = {key: chunk.get(key) for key in ("id", "created", "model")}
        for choice in chunk.get("choices", ()):
            if self.prompt_ids is None and "prompt_token_ids" in choice:
                self.prompt_ids = choice["prompt_token_ids"]
            self.generated += choice.get("token_ids") or []
            self.finished = self.finished or choice.get("finish_reason") is not None
        if self.continued:
            chunk = self._reshape(chunk)
        if not self.body.return_token_ids:
            for choice in chunk.get("choices", ()):
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
        return _sse(chunk)

    async def _continue(self) -> None:
        """Re-places the stream: from the start if nothing came yet, else as a continuation."""
        if self.prompt_ids is None:
            await self.router.open_stream(self.endpoint, forwarded(self.body, self.need), self.need, self)
            return
        if not self.resumable:
            raise ApiError(503, "the backend serving this stream failed; a stream of several choices or with "
                                "logprobs cannot be continued elsewhere: retry the request")
        remaining = self.need.max_tokens - len(self.generated)
        payload = {key: value for key, value in self.body.model_dump(exclude_unset=True).items() if key in CARRIED}
        payload.update(model=self.body.model, prompt=self.prompt_ids + self.generated, max_tokens=remaining,
                       stream=True, return_token_ids=True,
                       min_tokens=max(0, self.body.min_tokens - len(self.generated)))
        need = Need(len(payload["prompt"]), len(payload["prompt"]) + remaining, self.body.model, remaining)
        self.continued = True
        await self.router.open_stream("/v1/completions", payload, need, self)

    def _reshape(self, chunk: dict) -> dict:
        """A continuation's completion chunk as the original request's chunk (ids, usage, chat shape)."""
        chunk = {**chunk, **(self.first or {})}
        if chunk.get("usage"):
            prompt = len(self.prompt_ids)
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": len(self.generated),
                              "total_tokens": prompt + len(self.generated)}
        if self.endpoint != "/v1/chat/completions":
            return chunk
        choices = []
        for choice in chunk.get("choices", ()):
            text, reason = choice.get("text", ""), choice.get("finish_reason")
            choices.append({"index": choice.get("index", 0), "delta": {"content": text} if text or reason is None
                            else {}, "logprobs": None, "finish_reason": reason,
                            **{k: choice[k] for k in ("token_ids",) if k in choice}})
        return {**chunk, "object": "chat.completion.chunk", "choices": choices}


async def backend_call(call):
    """Awaits an httpx call to a backend; any error of the transport is an `httpx.TransportError`
    (a backend killed mid-connection can surface from httpcore as another exception)."""
    try:
        return await call
    except httpx.HTTPError:
        raise
    except Exception as err:
        raise httpx.TransportError(f"the backend connection failed: {err!r}") from err


async def backend_lines(response: httpx.Response):
    """The lines of a backend's streamed response, errors as in `backend_call`."""
    lines = response.aiter_lines()
    while True:
        try:
            line = await lines.__anext__()
        except StopAsyncIteration:
            return
        except httpx.HTTPError:
            raise
        except Exception as err:
            raise httpx.TransportError(f"reading from the backend failed: {err!r}") from err
        yield line


def forwarded(body, need: Need) -> dict:
    """The body a backend gets: the client's fields, an explicit max_tokens, and token ids asked
    for when streaming (a stream's continuation needs them)."""
    payload = body.model_dump(exclude_unset=True)
    if getattr(body, "max_completion_tokens", None) is None:
        payload["max_tokens"] = need.max_tokens
    if body.stream:
        payload["return_token_ids"] = True
    return payload


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _reply_error(reply: BackendReply) -> dict:
    try:
        return json.loads(reply.body)
    except ValueError:
        return ApiError(reply.status, reply.body.decode(errors="replace")[:500]).body()


def create_router_app(router: Router, api_key: str | None = None, max_body_bytes: int = 1 << 20) -> FastAPI:
    """The router's FastAPI app (see the module doc)."""
    async def lifespan(app):
        yield
        await router.client.aclose()

    app = FastAPI(title="jaxlora-router", lifespan=lifespan)
    app.state.router = router
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key, open_paths=("/health", "/metrics"))

    add_error_handlers(app)

    @app.exception_handler(BackendReply)
    async def backend_reply(request, err: BackendReply):
        return Response(err.body, err.status, media_type="application/json")

    async def generate(endpoint: str, body):
        need = await router.need(endpoint, body)
        payload = forwarded(body, need)
        if not body.stream:
            return await router.complete(endpoint, payload, need)
        relay = StreamRelay(router, endpoint, body, need)
        await router.open_stream(endpoint, payload, need, relay)
        return StreamingResponse(relay.lines(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await generate("/v1/completions", body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        return await generate("/v1/chat/completions", body)

    async def classify(body: ClassifyRequest):
        return await router.complete("/classify", body.model_dump(exclude_unset=True), await router.classify_need(body))

    app.post("/classify")(classify)
    app.post("/v1/classify")(classify)

    _add_admin_routes(app, router)
    return app


def _add_admin_routes(app: FastAPI, router: Router) -> None:
    @app.get("/v1/models")
    async def models():
        for backend in router.backends:
            try:
                reply = await backend_call(router.client.get(backend.url + "/v1/models", headers=router.headers))
            except httpx.TransportError:
                continue
            return Response(reply.content, reply.status_code, media_type="application/json")
        raise ApiError(503, "no backend is reachable")

    @app.get("/health")
    async def health():
        await router.refresh()
        healthy = sum(b.healthy for b in router.backends)
        return JSONResponse({"status": "ok" if healthy else "no backend reachable", "backends_healthy": healthy},
                            200 if healthy else 503)

    @app.get("/state")
    async def state():
        await router.refresh()
        return {"backends": [backend_entry(router, i) for i in range(len(router.backends))],
                "replacements": router.replacements}

    @app.post("/drain")
    async def drain(body: BackendDrain):
        if not 0 <= body.backend < len(router.backends):
            raise ApiError(400, f"backend must be in [0, {len(router.backends)}), got {body.backend}", "backend")
        router.backends[body.backend].draining = not body.undo
        await router.refresh()
        return backend_entry(router, body.backend)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.registry), media_type="text/plain; version=0.0.4; charset=utf-8")


def backend_entry(router: Router, index: int) -> dict:
    """Backend `index` in the router's /state: url, health, draining, idle, its own /state."""
    backend = router.backends[index]
    state = backend.state
    busy = len(backend.placed) + (0 if state is None else state["queued"] + sum(
        r["running"] + r["waiting"] for r in state["replicas"]))
    return {"backend": index, "url": backend.url, "healthy": backend.healthy, "draining": backend.draining,
            "idle": backend.draining and busy == 0, "in_flight": len(backend.placed), "state": state}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxlora-router",
                                description="One OpenAI-compatible front end over several jaxlora-serve processes "
                                            "(Punica placement; re-placement when a backend fails).")
    p.add_argument("--backend", action="append", required=True, metavar="URL",
                   help="a jaxlora-serve base URL, e.g. http://10.0.0.2:8000 (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--queue-timeout", type=float, default=30.0, metavar="S",
                   help="how long a request waits for a backend with room before 503")
    p.add_argument("--api-key", default=os.environ.get("JAXLORA_ROUTER_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and /metrics")
    p.add_argument("--backend-api-key", default=os.environ.get("JAXLORA_API_KEY") or None,
                   help="the key the backends require (default: $JAXLORA_API_KEY)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = build_parser().parse_args(argv)
    if not args.queue_timeout > 0:
        raise SystemExit(f"jaxlora-router: --queue-timeout must be > 0, got {args.queue_timeout}")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    router = Router(args.backend, args.backend_api_key, args.queue_timeout)
    app = create_router_app(router, args.api_key, args.max_body_bytes)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=30)


if __name__ == "__main__":
    main()
