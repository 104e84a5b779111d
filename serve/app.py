"""The OpenAI-compatible HTTP API over an `Engine` (FastAPI).

Endpoints: /v1/completions, /v1/chat/completions (JSON or SSE streaming), /classify (vLLM's
classification API over adapters with task heads: `serve.classify`), /v1/models,
/v1/load_lora_adapter and /v1/unload_lora_adapter, /tokenize and /detokenize (vLLM's bodies),
/health, /metrics; with `ServerSettings.finetune`, /v1/files and /v1/fine_tuning/jobs (OpenAI's
fine-tuning API: adapters trained in the engine's idle steps, `serve.finetune`). With an API key (`ServerSettings.api_key`) every route but /health and
/metrics (those too with `metrics_require_key`) needs `Authorization: Bearer <key>`
(`serve.auth`).
`model` names the base model, a registered adapter or a folder of the engine's adapter directory
(read on first request: the handler awaits that first read, so a corrupt or mismatched adapter
fails its request with 400 and the reason, an unknown name 404). Handlers tokenize, submit one engine
sequence per (prompt, choice), and await the engine's events through an asyncio queue; a request
that ends early (client gone, stop string, error) aborts its sequences so their KV pages are freed.

The engine may be a `serve.replicas.ReplicaSet` (`jaxlora-serve --replicas N`: one engine per
device behind this one API, Punica placement and migration); `GET /state` reports each replica's
load as JSON (what `serve.router` places by) and `POST /drain` drains a replica. A request with
`return_token_ids` (vLLM's field) gets each choice's token ids (streamed: the new ones in every
chunk) and its prompt's ids (the first chunk), which a router needs to continue a stream elsewhere.

Start-up (as vLLM's): the server binds at once, and the engine compiles its step programs
(`Engine.warmup`) on a thread before its loop starts; `/health` answers 503 "warming up" until
then (requests sent meanwhile wait in the queue), so a load balancer routes no request to a
server that would still compile.

Every error is answered in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`):
also an unknown route (404) and a wrong method (405, with `Allow`), through `add_error_handlers`.
A body over the limit (`BodyLimit`) is read and discarded up to a bound before its 413, so a
client still sending receives the answer rather than a broken pipe.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import secrets
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.concurrency import run_in_threadpool

from jaxlora.lora.adapter_config import AdapterError
from jaxlora.lora.peft_io import load_peft_adapter
from jaxlora.tokenizer import TokenizerError
from jaxlora.sampling import SamplingParams
from serve.engine import Engine, EngineBusy, RequestError, UnknownAdapter
from serve.finetune import FinetuneService, FinetuneSettings, add_finetune_routes
from serve.images import check_images
from serve.vision import IMAGE_TOKEN
from serve.auth import ApiKeyAuth
from serve.body_limit import BodyLimit
from serve.classify import add_classify_route
from serve.logprobs import chat_logprobs, completion_logprobs, vllm_prompt_logprobs
from serve.metrics import Metrics
from serve.protocol import (
    ApiError, ChatRequest, CompletionRequest, DetokenizeRequest, DrainRequest, Limits, LoadAdapterRequest,
    TokenizeRequest, UnloadAdapterRequest, check_chat, check_common, check_completion, check_token_ids,
    compile_request, stop_list,
)
from serve.replicas import ReplicaSet, server_state
from serve.structured import GrammarCompiler
from serve.text import TextTracker

log = logging.getLogger("jaxlora.serve")
UPLOAD_OVERHEAD = 64 << 10  # multipart framing around an uploaded file

@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """The served base model's name, where runtime adapters may be loaded from, input limits, and
    the API key (None: no authentication; metrics_require_key: /health and /metrics need it too)."""

    model_name: str
    allowed_adapter_dirs: tuple[str, ...] = ()
    limits: Limits = Limits()
    api_key: str | None = None
    metrics_require_key: bool = False
    finetune: FinetuneSettings | None = None  # the fine-tuning API (serve.finetune); None: off


@dataclasses.dataclass
class SeqSpec:
    """One engine sequence of a request: prompt ids, adapter (None: base), sampling (incl. the token limit)."""

    prompt: list[int]
    adapter: str | None
    sampling: SamplingParams
    stops: list[str]
    prompt_only: bool = False  # max_tokens 0 (with echo): the one token generated is not returned
    images: object = None  # the prompt's images (`serve.vision.ImageInput`), None: text only


class Generation:
    """The sequences of one HTTP request; `events()` yields (choice index, text delta, finish
    reason, log-probability entries of the tokens since the last yield: (token, logprob, top))."""

    def __init__(self, engine: Engine, tokenizer, specs: list[SeqSpec]):
        self.engine, self.specs = engine, specs
        self.request_id = uuid.uuid4().hex
        self.trackers = [TextTracker(tokenizer, spec.stops, spec.sampling.stop_token_ids) for spec in specs]
        self.logprobs: list[list] = [[] for _ in specs]  # entries not yielded yet
        self.prompt_logprobs: list[list | None] = [None] * len(specs)  # the engine's, once the prompt is scored
        self.ids_taken = [0] * len(specs)  # token ids of each choice handed out by `token_fields`
        self.done = [False] * len(specs)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.first_token_at: float | None = None
        self.started = time.monotonic()

    def _id(self, index: int) -> str:
        return f"{self.request_id}-{index}"

    def submit(self) -> None:
        """Submits every sequence (engine errors raise here, before any response is sent)."""
        loop = asyncio.get_running_loop()
        for index, spec in enumerate(self.specs):
            callback = lambda event, i=index: loop.call_soon_threadsafe(self.queue.put_nowait, (i, event))
            try:
                images = {} if spec.images is None else {"images": spec.images}
                self.engine.submit(self._id(index), spec.prompt, spec.adapter, spec.sampling, callback, **images)
            except Exception:
                self.done[index:] = [True] * (len(self.specs) - index)
                self.abort()
                raise

    def abort(self) -> None:
        for index, done in enumerate(self.done):
            if not done:
                self.done[index] = True
                self.engine.abort(self._id(index))

    async def events(self):
        try:
            while not all(self.done):
                index, event = await self.queue.get()
                if self.done[index]:
                    continue
                if event.error is not None:  # "overloaded": dropped by early abort, retry later
                    status = {"overloaded": 503, "adapter_error": 400}.get(event.finish_reason, 500)
                    raise ApiError(status, event.error)
                if event.token is not None and self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                if event.prompt_logprobs is not None:
                    self.prompt_logprobs[index] = event.prompt_logprobs
                if self.specs[index].prompt_only:  # max_tokens 0: the prompt alone, finished by length
                    event = event._replace(token=None, logprobs=None, finish_reason="length")
                if event.logprobs is not None:
                    self.logprobs[index].append((event.token, *event.logprobs))
                delta, reason = self.trackers[index].add(event.token, event.finish_reason)
                if reason is not None:
                    if event.finish_reason is None:  # a stop string: end it in the engine too
                        self.engine.abort(self._id(index))
                    self.done[index] = True
                if delta or reason:
                    entries, self.logprobs[index] = self.logprobs[index], []
                    yield index, delta, reason, entries
        finally:
            self.abort()

    def token_fields(self, body, index: int, everything: bool = False) -> dict:
        """`return_token_ids` fields of choice `index`: the token ids since the last call (all with
        `everything`), and at its first call the prompt's; {} unless the body asks for them."""
        if not body.return_token_ids:
            return {}
        ids = self.trackers[index].ids
        fields = {"token_ids": list(ids if everything else ids[self.ids_taken[index]:])}
        if self.ids_taken[index] == 0 or everything:
            fields["prompt_token_ids"] = list(self.specs[index].prompt)
        self.ids_taken[index] = len(ids)
        return fields

    def usage(self) -> dict:
        prompt = sum(len(spec.prompt) for spec in self.specs)
        completion = sum(t.num_tokens for t in self.trackers)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Server:
    """State shared by the handlers: engine, tokenizer, settings, metrics."""

    def __init__(self, engine: Engine, tokenizer, settings: ServerSettings):
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.limits = settings.limits
        # image_url parts need a vision tower: an engine serving a LLaVA's language model has one (`serve.vision`)
        self.accepts_images = getattr(engine, "images", None) is not None
        self.metrics = Metrics(engine)
        self.grammars = functools.cache(lambda: GrammarCompiler(  # structured outputs, made on first use
            tokenizer, getattr(engine, "eos_ids", None) or tokenizer.eos_token_ids, engine.model_config.vocab_size))
        self.allowed = [os.path.realpath(d) for d in settings.allowed_adapter_dirs]
        self.ready = threading.Event()  # set once the engine is warmed up and started
        self.warmup_error: str | None = None
        self._closing = False
        self._start_lock = threading.Lock()

    # ---- engine life -----------------------------------------------------------------------
    def start_engine(self) -> None:
        """Warms the engine up on a thread, then starts its loop (at once if it already runs)."""
        if self.engine.alive:
            self.ready.set()
            return
        threading.Thread(target=self._warm_up_and_start, name="jaxlora-warmup", daemon=True).start()

    def _warm_up_and_start(self) -> None:
        """`Engine.warmup`, then `Engine.start` unless the app is closing. A failed warm-up is logged
        and kept for /health (503); the engine starts anyway and compiles what its steps need."""
        try:
            info = self.engine.warmup()
            log.info("compiled %d step programs in %.1f s", info["programs"], info["seconds"])
        except Exception as err:
            log.exception("engine warm-up failed")
            self.warmup_error = f"{type(err).__name__}: {err}"
        with self._start_lock:
            if not self._closing:
                self.engine.start()
        self.ready.set()

    def stop_engine(self) -> None:
        with self._start_lock:
            self._closing = True
        self.engine.stop()

    def health(self) -> tuple[int, str]:
        """(HTTP status, status text) of /health."""
        if not self.ready.is_set():
            return 503, "warming up"
        if self.warmup_error is not None:
            return 503, f"warm-up failed: {self.warmup_error}"
        if not self.engine.alive:
            return 503, "engine stopped"
        return 200, "ok"

    # ---- request -> sequences ----------------------------------------------------------------
    def resolve_model(self, model: str) -> str | None:
        """The adapter a `model` field names (None: the base model); ApiError 404 if unknown."""
        if model == self.settings.model_name:
            return None
        try:
            self.engine.resolve_adapter(model)
        except UnknownAdapter:
            raise ApiError(404, f"The model `{model}` does not exist.", "model", "not_found_error") from None
        except AdapterError as err:
            raise ApiError(400, str(err), "model") from err
        return model

    async def read_adapter(self, model: str) -> None:
        """Awaits the first read of the adapter `model` names, if it was never read (a directory
        adapter's first request; other requests go on meanwhile): ApiError 400 with the reason if
        it cannot be used, 404 if there is no such adapter."""
        if model == self.settings.model_name:
            return
        self.resolve_model(model)
        try:
            future = self.engine.adapters.ensure(model)
            if future is not None:
                await asyncio.wrap_future(future)
        except LookupError:  # unloaded meanwhile
            raise ApiError(404, f"The model `{model}` does not exist.", "model", "not_found_error") from None
        except AdapterError as err:
            raise ApiError(400, f"cannot load adapter {model!r}: {err}", "model") from err

    def max_tokens_for(self, prompt_len: int, requested: int | None, default: int) -> int:
        context = self.engine.config.max_model_len
        if prompt_len >= context:
            raise ApiError(400, f"the prompt has {prompt_len} tokens; this model's context is {context} tokens",
                           "prompt")
        if requested is None:
            return max(1, min(default, self.limits.max_tokens, context - prompt_len))
        if prompt_len + requested > context:
            raise ApiError(400, f"max_tokens ({requested}) + prompt ({prompt_len} tokens) exceeds the context "
                                f"of {context} tokens", "max_tokens")
        return requested

    async def constraint(self, body):
        """The request's structured-output grammar, compiled in a worker thread (None: none)."""
        return await run_in_threadpool(compile_request, self.grammars, body, self.limits)

    def specs(self, body, prompts: list[list[int]], default_max: int, logprobs: int | None,
              prompt_logprobs: int | None = None, structured=None) -> list[SeqSpec]:
        adapter = self.resolve_model(body.model)
        check_token_ids(body, self.engine.model_config.vocab_size)
        seed = secrets.randbits(32) if body.seed is None else body.seed
        requested = getattr(body, "max_completion_tokens", None) or body.max_tokens
        prompt_only = requested == 0  # (echo) one token is generated and dropped
        specs = []
        for prompt in prompts:
            max_tokens = self.max_tokens_for(len(prompt), 1 if prompt_only else requested, default_max)
            if body.min_tokens > max_tokens:
                raise ApiError(400, f"min_tokens ({body.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
            for choice in range(body.n):
                sampling = sampling_params(body, max_tokens, (seed + choice) % (1 << 32), logprobs, prompt_logprobs,
                                           structured)
                specs.append(SeqSpec(prompt, adapter, sampling, stop_list(body.stop), prompt_only))
        if len(specs) > self.limits.max_sequences:
            raise ApiError(400, f"prompts x n = {len(specs)} exceeds {self.limits.max_sequences}", "n")
        return specs

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts or len(prompts) > self.limits.max_prompts:
            raise ApiError(400, f"send 1 to {self.limits.max_prompts} prompts", "prompt")
        return [self.tokens_of(p) for p in prompts]

    def prompt_texts(self, body: CompletionRequest) -> list[str]:
        """The text of each prompt of a completions request (token ids decoded)."""
        prompt = body.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [self.tokenizer.decode(prompt)]
        return [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompt]

    def tokens_of(self, prompt: str | list[int]) -> list[int]:
        context = self.engine.config.max_model_len
        if isinstance(prompt, str):
            if len(prompt) > 16 * context:  # cheap bound before tokenizing
                raise ApiError(400, f"the prompt is longer than this model's context of {context} tokens", "prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.engine.model_config.vocab_size
            if any(not 0 <= i < vocab for i in ids):
                raise ApiError(400, f"token ids must be in [0, {vocab})", "prompt")
        if not ids:
            raise ApiError(400, "the prompt is empty", "prompt")
        return ids

    def chat_prompt(self, body: ChatRequest) -> tuple[list[int], object]:
        """The prompt ids of a chat request and its images (`serve.vision.ImageInput`, None: none):
        each image part is the model's `<image>` placeholder where it was, expanded to the image's
        tokens and checked against the images, which are preprocessed here; ApiError 400."""
        text, images = self.chat_inputs(body.messages)
        ids = self.tokens_of(text)
        if not self.accepts_images:
            return ids, None
        try:
            return self.engine.images.prompt(ids, images)
        except ValueError as err:  # incl. ImageError: placeholders and images do not match
            raise ApiError(400, str(err), "messages") from err

    def chat_text(self, messages: list, add_generation_prompt: bool = True) -> str:
        """The prompt text of chat `messages` (ChatMessage) by the chat template; ApiError 400."""
        return self.chat_inputs(messages, add_generation_prompt)[0]

    def chat_inputs(self, messages: list, add_generation_prompt: bool = True) -> tuple[str, list]:
        """(the prompt text of chat `messages` by the chat template, their images decoded in order);
        ApiError 400. A vision-language model's image parts are rendered as its placeholder."""
        if len(messages) > self.limits.max_messages:
            raise ApiError(400, f"at most {self.limits.max_messages} messages", "messages")
        images = check_images(messages, self.limits, self.accepts_images, self.settings.model_name)
        placeholder = IMAGE_TOKEN if self.accepts_images else None
        turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text(placeholder)}
                 for m in messages]
        try:
            return self.tokenizer.apply_chat_template(turns, add_generation_prompt), images
        except TokenizerError as err:
            raise ApiError(400, str(err), "messages") from err

    def check_adapter_path(self, path: str) -> str:
        """The real path of `path` if it lies under an allowed directory; ApiError 403 if not."""
        if not self.allowed:
            raise ApiError(403, "loading adapters at run time is disabled (start the server with "
                                "--allowed-adapter-dir)", "lora_path")
        real = os.path.realpath(path)
        for allowed in self.allowed:
            if os.path.commonpath([real, allowed]) == allowed:
                return real
        raise ApiError(403, f"{path} is not under an allowed adapter directory", "lora_path")

    # ---- running -------------------------------------------------------------------------------
    def start(self, specs: list[SeqSpec]) -> Generation:
        generation = Generation(self.engine, self.tokenizer, specs)
        try:
            generation.submit()
        except RequestError as err:
            raise ApiError(400, str(err)) from err
        except UnknownAdapter as err:
            raise ApiError(404, f"The model `{err.args[0]}` does not exist.", "model", "not_found_error") from err
        except EngineBusy as err:
            raise ApiError(429, str(err)) from err
        self.metrics.prompt_tokens.inc(sum(len(s.prompt) for s in specs))
        return generation

    def finished(self, generation: Generation, endpoint: str, status: str) -> None:
        metrics = self.metrics
        metrics.requests.labels(endpoint, status).inc()
        usage = generation.usage()
        metrics.generation_tokens.inc(usage["completion_tokens"])
        now = time.monotonic()
        metrics.e2e.observe(now - generation.started)
        if generation.first_token_at is not None:
            metrics.ttft.observe(generation.first_token_at - generation.started)
            if usage["completion_tokens"] > 1:
                metrics.tpot.observe((now - generation.first_token_at) / (usage["completion_tokens"] - 1))

    async def collect(self, generation: Generation, request: Request, endpoint: str):
        """All choices' texts and finish reasons; aborts if the client disconnects meanwhile."""
        texts = [""] * len(generation.specs)
        reasons: list[str | None] = [None] * len(generation.specs)
        logprobs: list[list] = [[] for _ in generation.specs]

        async def run():
            async for index, delta, reason, entries in generation.events():
                texts[index] += delta
                reasons[index] = reason or reasons[index]
                logprobs[index] += entries

        task = asyncio.ensure_future(run())
        status = "ok"
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    status = "disconnected"
                    break
            if status == "ok":
                task.result()
        except ApiError:
            status = "error"
            raise
        finally:
            if not task.done():
                task.cancel()
            self.finished(generation, endpoint, status)
        return texts, reasons, logprobs

    async def stream(self, generation: Generation, endpoint: str, chunk, final_chunks):
        """SSE lines: `chunk(index, delta, reason, logprob entries)` per event, then `final_chunks()`,
        then [DONE]."""
        status = "disconnected"
        try:
            async for index, delta, reason, entries in generation.events():
                yield _sse(chunk(index, delta, reason, entries))
            for extra in final_chunks():
                yield _sse(extra)
            yield "data: [DONE]\n\n"
            status = "ok"
        except ApiError as err:
            status = "error"
            yield _sse(err.body())
        finally:
            self.finished(generation, endpoint, status)


def prompt_entries(generation: Generation, index: int, k: int) -> list:
    """The engine's prompt log-probability entries of choice `index` with its first prompt token
    ahead (no log-probability: nothing precedes it), each top list cut to `k`."""
    prompt = generation.specs[index].prompt
    scored = generation.prompt_logprobs[index] or []
    return [(prompt[0], None, None)] + [(token, logprob, top[:k]) for token, logprob, top in scored]


def sampling_params(body, max_tokens: int, seed: int, logprobs: int | None,
                    prompt_logprobs: int | None = None, structured=None) -> SamplingParams:
    """The engine's SamplingParams of a checked request body (`check_common`)."""
    return SamplingParams(
        max_tokens, 1.0 if body.temperature is None else body.temperature, 1.0 if body.top_p is None else body.top_p,
        seed, top_k=max(0, body.top_k), min_p=body.min_p, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
        logit_bias=tuple((int(k), v) for k, v in sorted((body.logit_bias or {}).items())),
        stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured=structured)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def invalid_request_error(err: RequestValidationError) -> ApiError:
    """A 400 naming the fields pydantic refused (a field this server does not know: "unsupported")."""
    parts, first = [], None
    for e in err.errors()[:5]:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        message = "unsupported field (this server does not implement it)" if e.get("type") == "extra_forbidden" \
            else e.get("msg")
        parts.append(f"{where}: {message}" if where else str(message))
        first = first or where or None
    return ApiError(400, "invalid request: " + "; ".join(parts), first)




def add_error_handlers(app: FastAPI) -> None:
    """Answers ApiError, pydantic's refusals (400) and Starlette's HTTP errors (unknown route 404,
    wrong method 405, ...) in OpenAI's error shape."""

    @app.exception_handler(ApiError)
    async def api_error(request, err: ApiError):
        return JSONResponse(err.body(), err.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, err: RequestValidationError):
        return JSONResponse(invalid_request_error(err).body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, err: StarletteHTTPException):
        api = http_api_error(request, err)
        return JSONResponse(api.body(), api.status, headers=err.headers)


def http_api_error(request, err: StarletteHTTPException) -> ApiError:
    """The ApiError of a Starlette HTTP error: 404 and 405 name the method and path (405 the allowed
    methods too); FastAPI's 400 for a body it could not read is the ApiError that stopped the read
    (413 from `BodyLimit`); others keep their detail."""
    if isinstance(err.__cause__, ApiError):
        return err.__cause__
    where = f"{request.method} {request.url.path}"
    allowed = {k.lower(): v for k, v in (err.headers or {}).items()}.get("allow")
    if err.status_code == 404 and err.detail == "Not Found":
        return ApiError(404, f"no route {where} (see /docs for this server's routes)")
    if err.status_code == 405 and err.detail == "Method Not Allowed":
        return ApiError(405, f"method not allowed: {where}" + (f" (allowed: {allowed})" if allowed else ""))
    return ApiError(err.status_code, str(err.detail))


def create_app(engine: Engine, tokenizer, settings: ServerSettings) -> FastAPI:
    """The FastAPI app; the engine warms up and starts with the app and stops with it."""
    server = Server(engine, tokenizer, settings)

    async def lifespan(app):
        server.start_engine()
        yield
        server.stop_engine()

    app = FastAPI(title="jaxlora-serve", lifespan=lifespan)
    app.state.server = server
    service = None if settings.finetune is None else FinetuneService(settings.finetune, engine, tokenizer,
                                                                      settings.model_name)
    uploads = {} if service is None else {"/v1/files": settings.finetune.max_file_bytes + UPLOAD_OVERHEAD}
    app.add_middleware(BodyLimit, max_bytes=settings.limits.max_body_bytes, paths=uploads)
    if settings.api_key:  # added last: runs first, before the body is read
        open_paths = () if settings.metrics_require_key else ("/health", "/metrics")
        app.add_middleware(ApiKeyAuth, api_key=settings.api_key, open_paths=open_paths)

    add_error_handlers(app)
    _add_generation_routes(app, server)
    add_classify_route(app, server)
    _add_tokenizer_routes(app, server)
    _add_admin_routes(app, server)
    if service is not None:
        add_finetune_routes(app, service)
    return app


def _add_generation_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_common(body, server.limits)
        check_completion(body)
        prompts = server.completion_prompts(body)
        await server.read_adapter(body.model)
        echo_scores = body.echo and body.logprobs is not None  # the prompt's tokens in `logprobs` too
        wanted = [k for k in (body.logprobs if echo_scores else None, body.prompt_logprobs) if k is not None]
        generation = server.start(server.specs(body, prompts, server.limits.default_max_tokens, body.logprobs,
                                               max(wanted) if wanted else None, await server.constraint(body)))
        cid, created = f"cmpl-{generation.request_id}", int(time.time())
        echoes = [text if body.echo else "" for text in server.prompt_texts(body) for _ in range(body.n)]
        offsets = [0 if echo_scores else len(echo) for echo in echoes]  # text offset of each choice's next token
        prompt_done, prompt_sent = [False] * len(echoes), [False] * len(echoes)

        def logprobs_of(index, entries):
            if body.logprobs is None:
                return None
            if echo_scores and not prompt_done[index]:  # the prompt's entries first, its first token's null
                prompt_done[index] = True
                entries = prompt_entries(generation, index, body.logprobs) + entries
            result = completion_logprobs(server.tokenizer, entries, offsets[index])
            offsets[index] += sum(len(t) for t in result["tokens"])
            return result

        def prompt_fields(index):  # vLLM's prompt_logprobs, once per choice
            if body.prompt_logprobs is None or prompt_sent[index]:
                return {}
            prompt_sent[index] = True
            return {"prompt_logprobs": vllm_prompt_logprobs(server.tokenizer, prompt_entries(
                generation, index, body.prompt_logprobs))}

        if body.stream:
            def chunk(index, delta, reason, entries):
                text, echoes[index] = echoes[index] + delta, ""
                return {"id": cid, "object": "text_completion", "created": created, "model": body.model,
                        "choices": [{"index": index, "text": text, **prompt_fields(index),
                                     "logprobs": logprobs_of(index, entries), "finish_reason": reason,
                                     **generation.token_fields(body, index)}]}

            final = _usage_chunks(body, generation, cid, created, "text_completion")
            return _streaming(server.stream(generation, "completions", chunk, final))
        texts, reasons, logprobs = await server.collect(generation, request, "completions")
        choices = [{"index": i, "text": echoes[i] + t, **prompt_fields(i), "logprobs": logprobs_of(i, logprobs[i]),
                    "finish_reason": r, **generation.token_fields(body, i, everything=True)}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
        return {"id": cid, "object": "text_completion", "created": created, "model": body.model,
                "choices": choices, "usage": generation.usage()}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_common(body, server.limits)
        check_chat(body, server.limits)
        prompt, images = server.chat_prompt(body)
        await server.read_adapter(body.model)
        top = (body.top_logprobs or 0) if body.logprobs else None
        specs = server.specs(body, [prompt], server.limits.max_tokens, top, None, await server.constraint(body))
        for spec in specs:
            spec.images = images
        generation = server.start(specs)

        def logprobs_of(entries):
            return chat_logprobs(server.tokenizer, entries) if body.logprobs else None

        cid, created = f"chatcmpl-{generation.request_id}", int(time.time())
        if body.stream:
            chunk = _chat_chunker(body, cid, created, generation, logprobs_of)
            final = _usage_chunks(body, generation, cid, created, "chat.completion.chunk")
            return _streaming(server.stream(generation, "chat", chunk, final))
        texts, reasons, logprobs = await server.collect(generation, request, "chat")
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": logprobs_of(logprobs[i]),
                    "finish_reason": r, **generation.token_fields(body, i, everything=True)}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
        return {"id": cid, "object": "chat.completion", "created": created, "model": body.model,
                "choices": choices, "usage": generation.usage()}


def _chat_chunker(body: ChatRequest, cid: str, created: int, generation: Generation, logprobs_of):
    """Chat chunks: the first chunk of each choice carries the assistant role."""
    started = [False] * len(generation.specs)

    def chunk(index, delta, reason, entries):
        content = {"content": delta} if delta or reason is None else {}
        if not started[index]:
            started[index] = True
            content = {"role": "assistant", **content}
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                "choices": [{"index": index, "delta": content, "logprobs": logprobs_of(entries),
                             "finish_reason": reason, **generation.token_fields(body, index)}]}

    return chunk


def _usage_chunks(body, generation: Generation, cid: str, created: int, kind: str):
    def final():
        if body.stream_options is not None and body.stream_options.include_usage:
            yield {"id": cid, "object": kind, "created": created, "model": body.model, "choices": [],
                   "usage": generation.usage()}

    return final


def _streaming(lines) -> StreamingResponse:
    return StreamingResponse(lines, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _add_tokenizer_routes(app: FastAPI, server: Server) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "send either prompt or messages", "prompt")
        if body.model is not None:
            server.resolve_model(body.model)
        text = body.prompt if body.messages is None else server.chat_text(body.messages, body.add_generation_prompt)
        context = server.engine.config.max_model_len
        if len(text) > 16 * context:
            raise ApiError(400, f"the text is longer than this model's context of {context} tokens", "prompt")
        tokens = server.tokenizer.encode(text, add_bos=None if body.add_special_tokens else False)
        strs = [server.tokenizer.token_text(t) for t in tokens] if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": context, "tokens": tokens, "token_strs": strs}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's /tokenizer_info: what a client needs to rebuild the tokenizer's text handling (the
        chat template, the special tokens, the added tokens)."""
        tok = server.tokenizer
        text = lambda i: None if i is None else tok.token_text(i)
        eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
        added = tok.backend.get_added_tokens_decoder()
        return {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tok.chat_template,
                "bos_token": text(tok.bos_token_id), "eos_token": text(eos), "pad_token": text(tok.pad_token_id),
                "bos_token_id": tok.bos_token_id, "eos_token_ids": list(tok.eos_token_ids),
                "pad_token_id": tok.pad_token_id, "add_bos_token": tok.add_bos, "vocab_size": tok.vocab_size,
                "model_max_length": server.engine.config.max_model_len,
                "added_tokens_decoder": {str(i): {"content": t.content, "special": t.special}
                                         for i, t in sorted(added.items())}}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if body.model is not None:
            server.resolve_model(body.model)
        vocab = server.engine.model_config.vocab_size
        if len(body.tokens) > server.engine.config.max_model_len or any(not 0 <= t < vocab for t in body.tokens):
            raise ApiError(400, f"send at most {server.engine.config.max_model_len} token ids in [0, {vocab})",
                           "tokens")
        return {"prompt": server.tokenizer.decode(body.tokens)}


def _add_admin_routes(app: FastAPI, server: Server) -> None:
    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        base = server.settings.model_name
        data = [{"id": base, "object": "model", "created": created, "owned_by": "jaxlora", "root": base,
                 "parent": None}]
        data += [{"id": name, "object": "model", "created": created, "owned_by": "jaxlora", "root": name,
                  "parent": base} for name in server.engine.adapter_names()]
        return {"object": "list", "data": data}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadAdapterRequest):
        name = body.lora_name
        if name == server.settings.model_name or name in server.engine.adapter_names():
            raise ApiError(400, f"the adapter {name!r} is already loaded", "lora_name")
        path = server.check_adapter_path(body.lora_path)
        try:
            reader = server.engine.residency.load_adapter if server.accepts_images else (
                lambda path, name: load_peft_adapter(path, server.engine.model_config, name, True))
            adapter = await run_in_threadpool(reader, path, name)
            server.engine.add_adapter(name, adapter, path)
        except (AdapterError, ValueError) as err:
            raise ApiError(400, f"cannot load adapter {name!r}: {err}", "lora_path") from err
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadAdapterRequest):
        try:
            server.engine.remove_adapter(body.lora_name)
        except UnknownAdapter:
            raise ApiError(404, f"the adapter {body.lora_name!r} is not loaded", "lora_name", "not_found_error")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/health")
    async def health():
        status, text = server.health()
        return JSONResponse({"status": text}, status)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/state")
    async def state():
        limits = server.limits
        return {**server_state(server.engine), "max_model_len": server.engine.config.max_model_len,
                "max_tokens_limit": limits.max_tokens, "default_max_tokens": limits.default_max_tokens}

    @app.post("/drain")
    async def drain(body: DrainRequest):
        if not isinstance(server.engine, ReplicaSet):
            raise ApiError(400, "this server runs one engine (start it with --replicas N to drain replicas; a "
                                "jaxlora-router drains whole servers)", "replica")
        try:
            return server.engine.drain(body.replica, body.migrate, body.undo)
        except ValueError as err:
            raise ApiError(400, str(err), "replica") from err
