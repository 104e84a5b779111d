"""OpenAI-compatible request bodies (pydantic), the server's input limits, and error responses.

Field types are checked by pydantic (a wrong type is a 400 with pydantic's message); ranges that
depend on the server's configuration (max_tokens vs the context, n, temperature, prompt sizes)
are checked by `check_common` against `Limits`, so every input a client sends is bounded.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds on what one HTTP request may ask for."""

    max_tokens: int = 1024          # largest max_tokens (further capped by the context)
    default_max_tokens: int = 16    # /v1/completions' default, as OpenAI's
    max_n: int = 8
    max_prompts: int = 32           # prompts in one /v1/completions batch
    max_sequences: int = 64         # prompts x n
    max_temperature: float = 2.0
    max_stop: int = 4
    max_stop_chars: int = 128
    max_messages: int = 256
    max_body_bytes: int = 1 << 20


class ApiError(Exception):
    """An error answered as OpenAI's JSON error body with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {400: "invalid_request_error", 403: "permission_error", 404: "not_found_error",
                             413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(max_length=256)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = Field(default=None, max_length=256)


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    tools: list | None = None


class LoadAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:/-]+$")
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = None


def check_common(body: _Sampling, limits: Limits) -> None:
    """ApiError(400) for out-of-range sampling fields and options this server does not support."""
    if not 1 <= body.n <= limits.max_n:
        raise ApiError(400, f"n must be in [1, {limits.max_n}], got {body.n}", "n")
    if body.temperature is not None and not 0 <= body.temperature <= limits.max_temperature:
        raise ApiError(400, f"temperature must be in [0, {limits.max_temperature}], got {body.temperature}",
                       "temperature")
    if body.top_p is not None and not 0 < body.top_p <= 1:
        raise ApiError(400, f"top_p must be in (0, 1], got {body.top_p}", "top_p")
    if body.max_tokens is not None and not 1 <= body.max_tokens <= limits.max_tokens:
        raise ApiError(400, f"max_tokens must be in [1, {limits.max_tokens}], got {body.max_tokens}", "max_tokens")
    if body.seed is not None and not 0 <= body.seed < 2**63:
        raise ApiError(400, "seed must be in [0, 2**63)", "seed")
    stops = stop_list(body.stop)
    if len(stops) > limits.max_stop or any(not s or len(s) > limits.max_stop_chars for s in stops):
        raise ApiError(400, f"stop takes at most {limits.max_stop} non-empty strings of at most "
                            f"{limits.max_stop_chars} characters", "stop")
    if body.presence_penalty or body.frequency_penalty:
        raise ApiError(400, "presence_penalty and frequency_penalty are not supported (send 0)")


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)
