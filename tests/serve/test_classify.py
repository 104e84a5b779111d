"""Task heads served: an adapter trained with a head (tests/train/head_task.py) answers /classify
with the in-process model's labels and probabilities; its rows share the engine's batches with
generation requests of other adapters without changing their tokens; a replica set and merged mode
classify as the model does; bad input is a 4xx with a message and the server keeps serving."""

import dataclasses
import json
import shutil
import types

import httpx
import numpy as np
import pytest

from jaxlora.lora.head import load_head
from jaxlora.lora.peft_io import load_peft_adapter
from jaxlora.sampling import SamplingParams
from tests.serve.conftest import SMALL_ENGINE
from train.heads import adapter_pool, classify, encode_text

BASE = "SmolLM2-135M-Instruct"


def _in_process(smollm2, path, texts):
    """(labels, probabilities [n, L]) of `texts` by the adapter and head in `path`, without the engine."""
    model, tokenizer = smollm2
    head = load_head(path, model.config.hidden_size)
    samples = [types.SimpleNamespace(tokens=encode_text(tokenizer, t, 256)) for t in texts]
    probs = classify(model, adapter_pool(model, load_peft_adapter(path, model.config)), head, samples, 256)
    return [head.labels[i] for i in probs.argmax(-1)], probs


def _close(a, b, bound=1e-4):
    return np.linalg.norm(np.asarray(a) - np.asarray(b)) <= bound * np.linalg.norm(np.asarray(b))


def test_classification_rows_share_batches_with_generation(smollm2, adapters8, topic_head_adapter):
    from serve.engine import Engine, EngineConfig

    model, tokenizer = smollm2
    path, held, _ = topic_head_adapter
    texts = [r["text"] for r in held[:6]]
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(max_adapters_on_device=2, **SMALL_ENGINE),
                    {"ad0": adapters8["ad0"]})
    engine.add_adapter("topic", load_peft_adapter(path, model.config), path)
    mixed = []  # steps with classification rows and generation rows
    engine.step_fn = lambda step, cache: (mixed.append({r.seq.seq_id[0] for r in step.plan.rows}), engine.device_step(
        step, cache))[1]
    events: dict = {}

    def run(requests):
        for request_id, prompt, adapter, kind in requests:
            callback = lambda event, key=request_id: events.setdefault(key, []).append(event)
            if kind == "classify":
                engine.classify(request_id, tokenizer.encode(prompt), adapter, callback)
            else:
                engine.submit(request_id, tokenizer.encode(prompt), adapter, SamplingParams(max_new_tokens=6), callback)
        engine.run_until_idle()

    generation = [(("g", 0), "The capital of France is", "ad0", "generate"), (("g", 1), "Once upon a time", None,
                                                                               "generate")]
    run(generation + [(("c", i), text, "topic", "classify") for i, text in enumerate(texts)])
    assert any(kinds == {"g", "c"} for kinds in mixed), "no step held both kinds of rows"
    labels, probs = _in_process(smollm2, path, texts)
    for i in range(len(texts)):
        (event,) = events[("c", i)]
        assert event.finish_reason == "classified" and event.token is None
        assert engine.task_head("topic").labels[int(np.argmax(event.probs))] == labels[i]
        assert _close(event.probs, probs[i])
    together = {key: [e.token for e in events[key] if e.token is not None] for key, *_ in generation}
    events.clear()
    run(generation)
    assert together == {key: [e.token for e in events[key] if e.token is not None] for key, *_ in generation}


def _post(server, body, path="/classify"):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers={"Content-Type": "application/json"}, timeout=120)


def _error(response, status):
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    assert message
    return message


@pytest.fixture(scope="module")
def head_server(live_server, allowed_dir, topic_head_adapter):
    """The shared live server with the topic adapter (and a copy whose head is corrupt) loaded at
    run time from the allowed directory; unloaded afterwards."""
    folder = allowed_dir / "topic-head"
    shutil.copytree(topic_head_adapter[0], folder)
    broken = allowed_dir / "broken-head"
    shutil.copytree(topic_head_adapter[0], broken)
    (broken / "head_config.json").write_text('{"format": "jaxlora-task-head", "labels": ["a"]')
    for name, path in (("topic-head", folder), ("broken-head", broken)):
        response = httpx.post(live_server.url + "/v1/load_lora_adapter", json={"lora_name": name,
                                                                               "lora_path": str(path)})
        assert response.status_code == 200, response.text
    yield live_server
    for name in ("topic-head", "broken-head"):
        httpx.post(live_server.url + "/v1/unload_lora_adapter", json={"lora_name": name})


def test_classify_answers_with_the_in_process_labels(head_server, smollm2, topic_head_adapter):
    path, held, _ = topic_head_adapter
    held = held[:6] + held[-6:]  # both kinds of held-out text (tests/train/head_task.py)
    texts = [r["text"] for r in held]
    response = _post(head_server, {"model": "topic-head", "input": texts})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["id"].startswith("classify-") and body["model"] == "topic-head"
    labels, probs = _in_process(smollm2, path, texts)
    assert [d["index"] for d in body["data"]] == list(range(len(texts)))
    assert [d["label"] for d in body["data"]] == labels
    assert all(d["num_classes"] == 4 and _close(d["probs"], p) for d, p in zip(body["data"], probs))
    assert np.mean([label == r["label"] for label, r in zip(labels, held)]) >= 0.95
    tokens = sum(len(smollm2[1].encode(t)) for t in texts)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                             "prompt_tokens_details": None}
    single = _post(head_server, {"model": "topic-head", "input": texts[0]}, "/v1/classify").json()
    assert single["data"][0]["label"] == labels[0]


@pytest.mark.parametrize("body, status, words", [
    ({"model": "no-such-adapter", "input": "hi"}, 404, "does not exist"),
    ({"model": "ad0", "input": "hi"}, 400, "no task head"),
    ({"model": BASE, "input": "hi"}, 400, "base model has no task head"),
    ({"model": "broken-head", "input": "hi"}, 400, "head_config.json"),
    ({"model": "topic-head", "input": ""}, 400, "input[0] is empty"),
    ({"model": "topic-head", "input": []}, 400, "send 1 to"),
    ({"model": "topic-head", "input": ["a tiger"] * 33}, 400, "send 1 to"),
    ({"model": "topic-head", "input": "tiger " * 200}, 400, "context"),
    ({"model": "topic-head", "input": 5}, 400, "input"),
    ({"model": "topic-head"}, 400, "input"),
    ({"model": "topic-head", "input": "hi", "truncate_prompt_tokens": 3}, 400, "unsupported"),
    ('{"model": "topic-head", "input": ', 400, ""),
])
def test_bad_classify_input_is_4xx_and_the_server_lives(head_server, body, status, words):
    assert words in _error(_post(head_server, body), status)
    assert _post(head_server, {"model": "topic-head", "input": "We read a story about a quiet piano."}).json()[
        "data"][0]["label"] == "music"


@pytest.mark.parametrize("front", ["replicas", "merged"])
def test_replicas_and_merged_mode_classify_as_the_in_process_model(tmp_path, front):
    from jaxlora.lora.head import TaskHead, save_head
    from jaxlora.lora.peft_io import save_peft_adapter
    from serve.engine import Engine, EngineConfig
    from serve.replicas import ReplicaSet
    from tests.jaxlora.parallel.fixtures import CONFIG, tiny_model
    from tests.serve.conftest import make_adapters

    model, adapter = tiny_model(CONFIG), make_adapters(CONFIG, 1)["ad0"]
    rng = np.random.default_rng(1)
    head = TaskHead(("x", "y", "z"), rng.normal(size=(3, CONFIG.hidden_size)).astype(np.float32),
                    rng.normal(size=3).astype(np.float32))
    save_peft_adapter(adapter, str(tmp_path))
    save_head(head, str(tmp_path))
    config = EngineConfig(page_size=4, num_pages=64, max_model_len=32, max_num_seqs=8, token_budget=32,
                          prefill_chunk=8, max_lora_rank=8, max_adapters_on_device=2)
    if front == "replicas":
        front = ReplicaSet([Engine(model, (), config) for _ in range(2)])
    else:  # the adapter's ΔW folded into the base weights: its rows run the plain base path
        front = Engine(model, (), dataclasses.replace(config, inference_mode="merged"))
    front.add_adapter("a", load_peft_adapter(str(tmp_path), CONFIG), str(tmp_path))
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (3, 11, 20, 6)]  # 20: chunked prefill
    events = {i: [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        front.classify(i, prompt, "a", events[i].append)
    front.run_until_idle()
    expected = classify(model, adapter_pool(model, adapter), head,
                        [types.SimpleNamespace(tokens=np.asarray(p, np.int32)) for p in prompts], 32)
    for i in range(len(prompts)):
        (event,) = events[i]
        assert event.finish_reason == "classified" and _close(event.probs, expected[i], 1e-5)


def test_router_forwards_classify(head_server):
    from serve.router import Router, create_router_app
    from tests.serve.conftest import LiveServer

    body = {"model": "topic-head", "input": ["Tell me something about the old violin.", "A rabbit ran."]}
    direct = _post(head_server, body).json()
    with LiveServer(create_router_app(Router([head_server.url])), None) as router:
        routed = _post(router, body)
        assert routed.status_code == 200, routed.text
        assert routed.json()["data"] == direct["data"]
        assert "no task head" in _error(_post(router, {"model": "ad0", "input": "hi"}, "/v1/classify"), 400)
