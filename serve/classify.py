"""POST /classify (vLLM's classification API) over adapters with task heads (`jaxlora.lora.head`).

Body `{"model": adapter, "input": str | [str]}` -> `{"id", "object": "list", "created", "model",
"data": [{"index", "label", "probs", "num_classes"}], "usage"}`, as vLLM answers. Each text is one
engine sequence (`Engine.classify`): a prefill in the engine's normal batches, beside the rows of
generation requests, whose last token's features go through the adapter's head; no token is
decoded. Errors: an unknown adapter 404; the base model, an adapter without a head, a malformed
head, an empty or too long text, too many texts 400; a queue that is full 429."""

from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from jaxlora.lora.adapter_config import AdapterError
from serve.engine import EngineBusy, NoTaskHead, RequestError, UnknownAdapter
from serve.protocol import ApiError, ClassifyRequest

ENDPOINT = "/classify"


def add_classify_route(app: FastAPI, server) -> None:
    """Adds POST /classify (and /v1/classify, SGLang's path) to `app` over `server` (`serve.app.Server`)."""

    async def classify(body: ClassifyRequest, request: Request):
        texts = [body.input] if isinstance(body.input, str) else list(body.input)
        head = await _head(server, body.model, len(texts))
        prompts = [_prompt(server, text, index) for index, text in enumerate(texts)]
        created, request_id = int(time.time()), uuid.uuid4().hex
        probs = await _run(server, request, request_id, prompts, body.model)
        data = [{"index": i, "label": head.labels[int(np.argmax(p))], "probs": [float(x) for x in p],
                 "num_classes": head.num_labels} for i, p in enumerate(probs)]
        tokens = sum(len(p) for p in prompts)
        return {"id": f"classify-{request_id}", "object": "list", "created": created, "model": body.model,
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                                        "prompt_tokens_details": None}}

    app.post(ENDPOINT)(classify)
    app.post("/v1" + ENDPOINT)(classify)


async def _head(server, model: str, count: int):
    """The task head of adapter `model` (read on its first use), after checking the text count."""
    if not 1 <= count <= server.limits.max_prompts:
        raise ApiError(400, f"send 1 to {server.limits.max_prompts} texts in input", "input")
    if model == server.settings.model_name:
        raise ApiError(400, "the base model has no task head: name an adapter that has one", "model")
    await server.read_adapter(model)  # 404 unknown, 400 unusable
    try:
        return await run_in_threadpool(server.engine.task_head, model)
    except UnknownAdapter:
        raise ApiError(404, f"The model `{model}` does not exist.", "model", "not_found_error") from None
    except (NoTaskHead, AdapterError) as err:
        raise ApiError(400, str(err), "model") from err


def _prompt(server, text: str, index: int) -> list[int]:
    """The token ids of one text; ApiError 400 if it is empty or does not fit the context."""
    if not text:
        raise ApiError(400, f"input[{index}] is empty", "input")
    ids = server.tokens_of(text)
    context = server.engine.config.max_model_len
    if len(ids) >= context:
        raise ApiError(400, f"input[{index}] has {len(ids)} tokens; this model's context is {context} tokens", "input")
    return ids


async def _run(server, request: Request, request_id: str, prompts: list[list[int]], model: str) -> list:
    """Submits every text and awaits each one's probabilities; aborts all if the client leaves or one fails."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    ids = [f"{request_id}-{i}" for i in range(len(prompts))]
    results: list = [None] * len(prompts)
    status = "error"
    try:
        for index, prompt in enumerate(prompts):
            callback = lambda event, i=index: loop.call_soon_threadsafe(queue.put_nowait, (i, event))
            _submit(server, ids[index], prompt, model, callback)
        server.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        while any(r is None for r in results):
            try:
                index, event = await asyncio.wait_for(queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    status = "disconnected"
                    raise ApiError(499, "the client disconnected")  # nobody reads the answer
                continue
            if event.probs is None:
                status_code = {"overloaded": 503, "adapter_error": 400}.get(event.finish_reason, 500)
                raise ApiError(status_code, event.error or f"the classification ended: {event.finish_reason}")
            results[index] = event.probs
        status = "ok"
        return results
    finally:
        if status != "ok":
            for sequence_id in ids:
                server.engine.abort(sequence_id)
        server.metrics.requests.labels(ENDPOINT, status).inc()


def _submit(server, request_id: str, prompt: list[int], model: str, callback) -> None:
    try:
        server.engine.classify(request_id, prompt, model, callback)
    except RequestError as err:
        raise ApiError(400, str(err), "input") from err
    except UnknownAdapter as err:
        raise ApiError(404, f"The model `{err.args[0]}` does not exist.", "model", "not_found_error") from err
    except (NoTaskHead, AdapterError) as err:
        raise ApiError(400, str(err), "model") from err
    except EngineBusy as err:
        raise ApiError(429, str(err)) from err
