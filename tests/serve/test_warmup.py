"""The server compiles the engine's step programs before /health reports ready (503 "warming up"
until then), and the first requests after it, greedy and sampled, base and adapter, compile nothing."""

import threading

import httpx
import jax
import pytest

from tests.serve.conftest import LiveServer

# One block-table width (32 tokens = 4 pages) and two token buckets: few programs to compile.
TINY_ENGINE = dict(page_size=8, num_pages=16, max_model_len=32, max_num_seqs=4, token_budget=16, prefill_chunk=16,
                   max_lora_rank=8, max_adapters_on_device=2)
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@pytest.fixture
def held_server(smollm2, adapters8):
    """A live server whose engine warm-up waits for `release.set()`; yields (server, release)."""
    from serve.app import ServerSettings, create_app
    from serve.engine import Engine, EngineConfig

    model, tokenizer = smollm2
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(**TINY_ENGINE), {"ad0": adapters8["ad0"]})
    release, real_warmup = threading.Event(), engine.warmup

    def held_warmup(*args, **kwargs):
        release.wait(timeout=120)
        return real_warmup(*args, **kwargs)

    engine.warmup = held_warmup
    with LiveServer(create_app(engine, tokenizer, ServerSettings("base")), engine) as server:
        yield server, release


def test_ready_only_after_warmup_and_first_requests_compile_nothing(held_server):
    server, release = held_server
    response = httpx.get(server.url + "/health")
    assert response.status_code == 503 and response.json() == {"status": "warming up"}
    release.set()
    server.wait_ready()
    compiles = []

    def listener(event, duration_secs, **kwargs):
        if event == BACKEND_COMPILE:
            compiles.append(duration_secs)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for model, temperature in (("base", 0.0), ("ad0", 0.0), ("ad0", 1.0), ("base", 0.7)):
            response = httpx.post(server.url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": "The capital of France is", "max_tokens": 6, "temperature": temperature})
            assert response.status_code == 200, response.text
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    assert server.engine.stats.step_compiles == 0 and len(server.engine.programs) == len(server.engine.step_shapes())
