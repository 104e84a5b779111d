"""The HTTP server over a replica set (what `jaxlora-serve --replicas N` runs) on a tiny random
checkpoint: streaming clients (the official `openai` client) see each token exactly once while a
replica short of KV migrates their requests; GET /state, per-replica /metrics, POST /drain."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from fastapi.testclient import TestClient

from serve.app import ServerSettings, create_app
from serve.engine import Engine, EngineConfig
from serve.replicas import ReplicaSet
from tests.serve.conftest import LiveServer
from tests.serve.tiny_checkpoint import QUESTIONS, make_checkpoint, reference_tokens

# 6 requests of ~15 prompt tokens take 4 pages each on admission: replica 0 is full, then runs short
GROWING = dict(page_size=4, num_pages=24, max_model_len=96, max_num_seqs=8, token_budget=32, prefill_chunk=16,
               max_lora_rank=8, reserve_output_kv=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"))


def _stream(client, question, model, max_tokens):
    """(token ids, text, finish reasons) of one streamed chat answer."""
    ids, text, reasons = [], "", []
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0,
            stream=True, extra_body={"return_token_ids": True, "ignore_eos": True}):
        choice = chunk.choices[0]
        ids += choice.model_extra.get("token_ids") or []
        text += choice.delta.content or ""
        reasons.append(choice.finish_reason)
    return ids, text, reasons


def test_streams_see_each_token_once_across_migrations(checkpoint):
    from openai import OpenAI

    _, _, model, tokenizer, adapters = checkpoint
    jobs = [(QUESTIONS[i % 4], ("ad0", "ad1", "tiny")[i % 3], 40) for i in range(6)]
    roomy = Engine(model, tokenizer.eos_token_ids, EngineConfig(**dict(GROWING, num_pages=96, reserve_output_kv=True)),
                   adapters)
    expected = reference_tokens(roomy, tokenizer, jobs)
    replicas = ReplicaSet([Engine(model, tokenizer.eos_token_ids, EngineConfig(**GROWING), adapters)
                           for _ in range(2)])
    replicas.start()  # started before the app: it compiles on demand, no warm-up
    try:
        app = create_app(replicas, tokenizer, ServerSettings("tiny"))
        with LiveServer(app, replicas) as server:
            client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
                answers = list(pool.map(lambda job: _stream(client, *job), jobs))
            state = httpx.get(server.url + "/state").json()
            metrics = httpx.get(server.url + "/metrics").text
            drained = httpx.post(server.url + "/drain", json={"replica": 1})
            refused = httpx.post(server.url + "/drain", json={"replica": 5})
            undone = httpx.post(server.url + "/drain", json={"replica": 1, "undo": True}).json()
    finally:
        replicas.stop()
    for (ids, text, reasons), want in zip(answers, expected):
        assert ids == want and text == tokenizer.decode(want)
        assert reasons.count("length") == 1 and reasons[-1] == "length"
    assert state["migrations"] >= 1 and len(state["replicas"]) == 2
    assert all(r["free_pages"] == GROWING["num_pages"] for r in state["replicas"])
    assert 'jaxlora_replica_batch{replica="1"}' in metrics and "jaxlora_migrations" in metrics
    assert drained.status_code == 200 and drained.json()["draining"] and drained.json()["idle"]
    assert refused.status_code == 400 and "replica must be in [0, 2)" in refused.json()["error"]["message"]
    assert not undone["draining"]


def test_a_server_of_one_engine_reports_its_state_and_refuses_drain(checkpoint):
    _, _, model, tokenizer, adapters = checkpoint
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(**GROWING), adapters)
    client = TestClient(create_app(engine, tokenizer, ServerSettings("tiny")))  # no lifespan: engine not started
    state = client.get("/state").json()
    assert state["replicas"][0]["free_pages"] == GROWING["num_pages"] and state["max_model_len"] == 96
    reply = client.post("/drain", json={"replica": 0})
    assert reply.status_code == 400 and "runs one engine" in reply.json()["error"]["message"]
    assert client.post("/drain", json={"replica": 0, "bogus": 1}).status_code == 400
