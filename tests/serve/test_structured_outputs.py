"""Structured outputs through the official `openai` client against the shared live server
(tests/serve/conftest.py: SmolLM2-135M-Instruct, adapters ad0 and ad1, async scheduling): every
answer under a JSON schema parses and validates (several schemas, base and adapters, streaming and
not, greedy and sampled, chat and completions), json_object gives a JSON object, regex, choice and
grammar answers match, and schemas llguidance cannot enforce (or malformed requests) are 400s in
OpenAI's error shape. The engine-level tests (free rows sharing steps with constrained rows get
the tokens they get alone) are in tests/serve/test_structured_engine.py."""

import json
import re

import httpx
import jsonschema
import openai
import pytest

BASE = "SmolLM2-135M-Instruct"

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
COLORS = {"type": "object", "additionalProperties": False, "required": ["colors", "ok"],
          "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                    "minItems": 1, "maxItems": 3},
                         "ok": {"type": "boolean"}}}
NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4}
POINT = {"type": "object", "additionalProperties": False, "required": ["point", "label"],
         "properties": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                                  "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50},
                                                 "y": {"type": "integer", "minimum": -50, "maximum": 50}}},
                        "label": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}}}
SCHEMAS = {"person": PERSON, "colors": COLORS, "numbers": NUMBERS, "point": POINT}
ASK = {"person": "Describe a person.", "colors": "Which colors do you like?", "numbers": "Give me a few numbers.",
       "point": "Give a point on a map."}


def _format(name):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def _chat(client, content, model=BASE, stream=False, **kw):
    """(text, finish reasons) of a chat completion (streamed: the deltas joined)."""
    kw.setdefault("temperature", 0)
    messages = [{"role": "user", "content": content}]
    response = client.chat.completions.create(model=model, messages=messages, max_tokens=56, stream=stream, **kw)
    if not stream:
        return [c.message.content for c in response.choices], [c.finish_reason for c in response.choices]
    texts, reasons = {}, {}
    for chunk in response:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    return [texts[i] for i in sorted(texts)], [reasons[i] for i in sorted(reasons)]


def _valid(text, schema):
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("name,model,stream", [("person", BASE, False), ("person", "ad0", True),
                                               ("colors", "ad1", False), ("colors", BASE, True),
                                               ("numbers", "ad0", False), ("numbers", "ad1", True),
                                               ("point", BASE, False), ("point", "ad0", True)])
def test_json_schema_answers_validate(client, name, model, stream):
    texts, reasons = _chat(client, ASK[name], model, stream, response_format=_format(name))
    assert reasons == ["stop"]  # the grammar let EOS through once the value was complete
    _valid(texts[0], SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_sampled_choices_validate_and_differ_from_free_text(client, stream):
    texts, reasons = _chat(client, ASK["person"], "ad1", stream, response_format=_format("person"), n=3,
                           temperature=1.0, seed=7)
    assert reasons == ["stop"] * 3
    for text in texts:
        _valid(text, PERSON)
    free, _ = _chat(client, ASK["person"], "ad1", n=1, temperature=0)
    with pytest.raises(ValueError):  # unconstrained, the model answers in prose: the grammar made the JSON
        json.loads(free[0])


@pytest.mark.parametrize("stream", [False, True])
def test_completions_take_a_schema_from_response_format_and_vllm_fields(client, stream):
    prompt = "A person in JSON:"
    for extra in ({"response_format": _format("point")}, {"structured_outputs": {"json": POINT}},
                  {"guided_json": json.dumps(POINT)}):
        response = client.completions.create(model="ad1", prompt=prompt, max_tokens=56, temperature=0, stream=stream,
                                             extra_body=extra)
        chunks = list(response) if stream else [response]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
        _valid(text, POINT)


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_gives_a_json_object(client, smollm2, stream):
    _, tokenizer = smollm2
    texts, reasons = _chat(client, 'Give a JSON object with a key "name".', BASE, stream,
                           response_format={"type": "json_object"})
    assert reasons == ["stop"] and "name" in json.loads(texts[0]), texts
    texts, reasons = _chat(client, 'Return {"ok": true} as JSON.', "ad1", stream,
                           response_format={"type": "json_object"})
    assert reasons == ["stop"] and isinstance(json.loads(texts[0]), dict), texts
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": 'Return {"ok": true} as JSON.'}])
    response = client.completions.create(model=BASE, prompt=prompt, max_tokens=56, temperature=0,
                                         extra_body={"structured_outputs": {"json_object": True}})
    assert json.loads(response.choices[0].text) == {"ok": True}


def test_regex_choice_and_grammar(client):
    pattern = r"[A-Z][a-z]{2,8} \d{2}"
    texts, reasons = _chat(client, "Name a city and a number.", extra_body={"guided_regex": pattern})
    assert reasons == ["stop"] and re.fullmatch(pattern, texts[0]), texts
    texts, _ = _chat(client, "Say a date.", "ad0", True, extra_body={"structured_outputs": {"regex": r"\d{4}-\d{2}"}})
    assert re.fullmatch(r"\d{4}-\d{2}", texts[0]), texts
    choices = ["Paris", "London", "Berlin, Germany"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        texts, reasons = _chat(client, "Which city is the capital of France?", "ad1", n=2, temperature=1.0, seed=3,
                               extra_body=extra)
        assert reasons == ["stop", "stop"] and all(t in choices for t in texts), texts
    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    texts, _ = _chat(client, "Is water wet?", extra_body={"structured_outputs": {"grammar": lark}})
    assert texts[0] in ("The answer is yes.", "The answer is no.")


def test_structured_outputs_with_logprobs_and_stop(client):
    texts, reasons = _chat(client, ASK["person"], response_format=_format("person"), logprobs=True, top_logprobs=2)
    _valid(texts[0], PERSON)
    texts, reasons = _chat(client, ASK["person"], response_format=_format("person"), stop=[","])
    assert reasons == ["stop"] and "," not in texts[0] and texts[0].startswith('{"name":')


TOO_LARGE = {"type": "object", "properties": {f"field_{i:05d}": {"type": "string"} for i in range(1000)}}

BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "Invalid type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}},
     "response_format", "not"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "uniqueItems"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": {"type": "string", "format": "colour"}}, "guided_json", "format"),
    ({"guided_regex": "(a"}, "guided_regex", "regex"),
    ({"guided_regex": "a\\bc"}, "guided_regex", "lookaround"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs", ""),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "at most one"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "takes one of"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "at most one"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}}, "response_format",
     "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": PERSON,
                                                                  "description": "a person"}}}, None, "description"),
    ({"response_format": {"type": "yaml"}}, None, "type"),
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, None, "guided_decoding_backend"),
    ({"guided_json": TOO_LARGE}, "guided_json", "at most"),
    ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens", "min_tokens"),
]


@pytest.mark.parametrize("extra,param,message", BAD)
def test_bad_grammars_are_400s_in_openai_shape(live_server, extra, param, message):
    body = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    response = httpx.post(live_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert message.lower() in error["message"].lower(), error
    if param is not None:
        assert error["param"] == param


def test_bad_schema_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=BASE, prompt="x", max_tokens=4,
                                  extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                      "name": "x", "schema": {"type": "object", "if": {}}}}})
    assert "if" in err.value.body["message"] and err.value.body["param"] == "response_format"
