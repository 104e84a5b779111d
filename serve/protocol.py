"""OpenAI-compatible request bodies (pydantic), the server's input limits, and error responses.

Field types are checked by pydantic (a wrong type is a 400 with pydantic's message); a field the
server does not know is refused (400 naming it: nothing a client asks for is silently ignored);
ranges that depend on the server's configuration (max_tokens vs the context, n, temperature,
prompt sizes) are checked by `check_common` against `Limits`, so every input a client sends is
bounded. The sampling fields are vLLM's (`jaxlora.sampling.SamplingParams` says what each does).
A structured-output grammar (`request_grammar`, `compile_request`) is bounded by
`Limits.max_grammar_bytes`, and one llguidance cannot enforce is a 400 naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxlora.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS
from serve.structured import Constraint, GrammarCompiler, GrammarError


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
    max_logit_bias: int = 300       # entries of logit_bias (OpenAI's bound)
    max_stop_token_ids: int = 64
    max_body_bytes: int = 1 << 20
    max_grammar_bytes: int = 32 << 10  # a structured-output grammar (JSON schema, regex, choices), serialized
    max_images: int = 8             # image_url parts in one chat request (serve.images)
    max_image_bytes: int = 1 << 20  # one image, decoded (PNG/JPEG bytes)
    max_image_pixels: int = 4096 * 4096


class ApiError(Exception):
    """An error answered as OpenAI's JSON error body with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {400: "invalid_request_error", 403: "permission_error", 404: "not_found_error",
                             405: "invalid_request_error", 413: "invalid_request_error",
                             429: "rate_limit_error"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class _Strict(BaseModel):
    """A request body that refuses fields it does not declare."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema: the schema is always enforced (strict or not)."""

    model_config = ConfigDict(extra="forbid", serialize_by_alias=True)
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: "text", "json_object" (any JSON object) or "json_schema"
    (`serve.structured`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: one of a JSON schema (dict or JSON text), a regex, a list of
    choices, a Lark/GBNF grammar, or json_object (`serve.structured`)."""

    model_config = ConfigDict(extra="forbid", serialize_by_alias=True)
    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(_Strict):
    """Fields shared by completions and chat."""

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
    repetition_penalty: float = 1.0
    top_k: int = -1  # -1 or 0: off (vLLM)
    min_p: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's; and its older guided_* fields:
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = Field(default=None, max_length=256)
    return_token_ids: bool = False  # vLLM's: each choice (chunk) also carries its token ids, and its prompt's


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' log-probabilities and top-N
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str  # a data: URL (serve.images: remote URLs are refused); bounded by the body's size
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    """OpenAI's image content part; checked and decoded by `serve.images.check_images`."""

    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart | ImagePart] | None = None

    def text(self, image: str | None = None) -> str:
        """The message's text: its text parts joined, each image part as `image` where it was (a
        vision-language model's placeholder, e.g. `<image>`; None: left out, `serve.images` reads them)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text if isinstance(part, TextPart) else (image or "") for part in self.content)


class ChatRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's body): `prompt`, or chat `messages` rendered with the chat template."""

    model: str | None = Field(default=None, max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # the tokenizer's BOS, if it adds one
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's body)."""

    model: str | None = Field(default=None, max_length=256)
    tokens: list[int]


class ClassifyRequest(_Strict):
    """POST /classify (vLLM's body): the texts to classify with the task head of adapter `model`."""

    model: str = Field(max_length=256)
    input: str | list[str]
    user: str | None = Field(default=None, max_length=256)


class DrainRequest(_Strict):
    """POST /drain: stop placing requests on `replica` (undo: resume); migrate: hand its requests to
    the other replicas now instead of letting them finish there."""

    replica: int
    migrate: bool = False
    undo: bool = False


class LoadAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:/-]+$")
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = None


def check_common(body: _Sampling, limits: Limits) -> None:
    """ApiError(400) for out-of-range sampling fields and options this server does not support
    (token ids against the vocabulary: `check_token_ids`)."""
    if not 1 <= body.n <= limits.max_n:
        raise ApiError(400, f"n must be in [1, {limits.max_n}], got {body.n}", "n")
    if body.temperature is not None and not 0 <= body.temperature <= limits.max_temperature:
        raise ApiError(400, f"temperature must be in [0, {limits.max_temperature}], got {body.temperature}",
                       "temperature")
    if body.top_p is not None and not 0 < body.top_p <= 1:
        raise ApiError(400, f"top_p must be in (0, 1], got {body.top_p}", "top_p")
    lowest = 0 if getattr(body, "echo", False) else 1  # 0 with echo: the prompt (and its log-probabilities) only
    if body.max_tokens is not None and not lowest <= body.max_tokens <= limits.max_tokens:
        raise ApiError(400, f"max_tokens must be in [{lowest}, {limits.max_tokens}] (0 only with echo), got "
                            f"{body.max_tokens}", "max_tokens")
    if body.seed is not None and not 0 <= body.seed < 2**63:
        raise ApiError(400, "seed must be in [0, 2**63)", "seed")
    stops = stop_list(body.stop)
    if len(stops) > limits.max_stop or any(not s or len(s) > limits.max_stop_chars for s in stops):
        raise ApiError(400, f"stop takes at most {limits.max_stop} non-empty strings of at most "
                            f"{limits.max_stop_chars} characters", "stop")
    _check_ranges(body, [
        ("presence_penalty", -2, 2), ("frequency_penalty", -2, 2), ("min_p", 0, 1), ("top_k", -1, 2**31 - 1),
        ("repetition_penalty", 1e-3, 10), ("min_tokens", 0, body.max_tokens or limits.max_tokens)])
    if len(body.logit_bias or {}) > limits.max_logit_bias:
        raise ApiError(400, f"logit_bias takes at most {limits.max_logit_bias} entries", "logit_bias")
    if any(not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for v in (body.logit_bias or {}).values()):
        raise ApiError(400, f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", "logit_bias")
    if len(body.stop_token_ids or []) > limits.max_stop_token_ids:
        raise ApiError(400, f"stop_token_ids takes at most {limits.max_stop_token_ids} ids", "stop_token_ids")
    fmt = body.response_format
    if fmt is not None and (fmt.type == "json_schema") != (fmt.json_schema is not None):
        raise ApiError(400, "response_format takes json_schema exactly with type \"json_schema\"", "response_format")


def _check_ranges(body, ranges) -> None:
    """ApiError(400) naming the first field of (name, low, high) outside [low, high] (NaN included)."""
    for name, low, high in ranges:
        value = getattr(body, name)
        if not low <= value <= high:
            raise ApiError(400, f"{name} must be in [{low:g}, {high:g}], got {value}", name)


def check_completion(body: CompletionRequest) -> None:
    """ApiError(400) for completion-only fields out of range or not supported."""
    if body.logprobs is not None:
        _check_ranges(body, [("logprobs", 0, MAX_LOGPROBS)])
    if body.prompt_logprobs is not None:
        _check_ranges(body, [("prompt_logprobs", 0, MAX_LOGPROBS)])
    if (body.best_of or 1) != 1:
        raise ApiError(400, "best_of other than 1 is not supported", "best_of")
    if body.suffix:
        raise ApiError(400, "suffix is not supported", "suffix")


def check_chat(body: ChatRequest, limits: Limits) -> None:
    """ApiError(400) for chat-only fields out of range or not supported."""
    if body.max_completion_tokens is not None and not 1 <= body.max_completion_tokens <= limits.max_tokens:
        raise ApiError(400, f"max_completion_tokens must be in [1, {limits.max_tokens}]", "max_completion_tokens")
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        _check_ranges(body, [("top_logprobs", 0, MAX_LOGPROBS)])
    if body.tools:
        raise ApiError(400, "tools are not supported", "tools")


def check_token_ids(body: _Sampling, vocab_size: int) -> None:
    """ApiError(400) unless logit_bias keys and stop_token_ids are token ids in [0, vocab_size)."""
    for key in body.logit_bias or {}:
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < vocab_size):
            raise ApiError(400, f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}", "logit_bias")
    if any(not 0 <= i < vocab_size for i in body.stop_token_ids or []):
        raise ApiError(400, f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def request_grammar(body, limits: Limits) -> tuple[str, object, str] | None:
    """(kind, source, field) of the structured-output grammar a checked request body names
    (`serve.structured`'s module doc: response_format, structured_outputs, guided_*), None if none;
    ApiError(400) for two of them, an empty one, or one over `limits.max_grammar_bytes`."""
    found = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("json_object", None, "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        found.append(("json_schema", fmt.json_schema.schema_, "response_format"))
    vllm = body.structured_outputs
    if vllm is not None:
        for key, kind in (("json_", "json_schema"), ("regex", "regex"), ("choice", "choice"), ("grammar", "grammar")):
            if getattr(vllm, key) is not None:
                found.append((kind, getattr(vllm, key), "structured_outputs"))
        if vllm.json_object:
            found.append(("json_object", None, "structured_outputs"))
        if not found or found[-1][2] != "structured_outputs":
            raise ApiError(400, "structured_outputs takes one of json, regex, choice, grammar, json_object: true",
                           "structured_outputs")
    for key, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(body, key) is not None:
            found.append((kind, getattr(body, key), key))
    if len(found) > 1:
        raise ApiError(400, "give at most one of response_format (json_object, json_schema), structured_outputs "
                            "(one of json, regex, choice, grammar, json_object) and guided_*", found[1][2])
    if not found:
        return None
    kind, source, field = found[0]
    _check_source(kind, source, field, limits)
    if kind == "json_schema" and isinstance(source, str):
        try:
            source = json.loads(source)
        except ValueError as err:
            raise ApiError(400, f"the JSON schema is not valid JSON: {err}", field) from err
    return kind, source, field


def _check_source(kind: str, source, field: str, limits: Limits) -> None:
    """ApiError(400) unless the grammar source is non-empty and at most `limits.max_grammar_bytes`."""
    if kind == "json_object":
        return
    if kind == "choice" and (not source or any(not choice for choice in source)):
        raise ApiError(400, "choice takes a non-empty list of non-empty strings", field)
    if kind in ("regex", "grammar") and not source:
        raise ApiError(400, f"the {kind} is empty", field)
    size = len(source.encode() if isinstance(source, str) else json.dumps(source).encode())
    if size > limits.max_grammar_bytes:
        raise ApiError(400, f"the {kind} has {size} bytes; this server takes at most {limits.max_grammar_bytes}",
                       field)


def compile_request(compiler: Callable[[], GrammarCompiler], body, limits: Limits) -> Constraint | None:
    """The Constraint of a checked request body (None: no grammar); ApiError(400) as
    `request_grammar`, or with llguidance's message for a grammar it cannot enforce. compiler():
    the server's GrammarCompiler (made on the first request with a grammar)."""
    found = request_grammar(body, limits)
    if found is None:
        return None
    kind, source, field = found
    if body.min_tokens:
        raise ApiError(400, "min_tokens cannot be combined with structured outputs (the grammar decides when the "
                            "output may end)", "min_tokens")
    try:
        return compiler().compile(kind, source)
    except GrammarError as err:
        raise ApiError(400, f"the {kind.replace('_', ' ')} cannot be used for structured outputs: {err}",
                       field) from err
