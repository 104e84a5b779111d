"""Fixtures of the serving tests: random adapters that change greedy outputs, a small engine
configuration, and one live HTTP server (uvicorn in a thread) shared by the HTTP tests."""

import contextlib
import socket
import threading
import time

import pytest

from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig

SMALL_ENGINE = dict(page_size=8, num_pages=96, max_model_len=128, max_num_seqs=16, token_budget=64,
                    prefill_chunk=16, max_lora_rank=8)
BODY_LIMIT = 64 * 1024


def make_adapters(config, count, prefix="ad"):
    """`count` adapters of mixed ranks/targets with B large enough (0.2) to change greedy outputs."""
    targets = [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")]
    return {
        f"{prefix}{i}": random_adapter(
            f"{prefix}{i}", config,
            LoraConfig(r=(4, 8)[i % 2], lora_alpha=16, target_modules=targets[i % 3] + ("down_proj",) * (i % 3 != 2)),
            seed=100 + i, b_std=0.2)
        for i in range(count)
    }


@contextlib.contextmanager
def exact_weights(model):
    """Restores the model's weight arrays exactly afterwards (merge/unmerge round in float32)."""
    saved = {name: param[...] for name, param in model.weights.items()}
    try:
        yield
    finally:
        for name, value in saved.items():
            model.weights[name].set_value(value)


@pytest.fixture(scope="session")
def adapters8(smollm2):
    return make_adapters(smollm2[0].config, 8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving `app` on a free 127.0.0.1 port in a daemon thread."""

    def __init__(self, app, engine):
        import uvicorn

        self.engine, self.port = engine, _free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return self

    def wait_ready(self, timeout: float = 600) -> None:
        """Until /health answers 200 (the engine has compiled its step programs and runs)."""
        import httpx

        deadline = time.time() + timeout
        while httpx.get(self.url + "/health").status_code != 200:
            if time.time() > deadline:
                raise RuntimeError("the server did not become ready")
            time.sleep(0.1)

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="session")
def allowed_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("allowed_adapters")


@pytest.fixture(scope="session")
def live_server(smollm2, adapters8, allowed_dir):
    """A server over SmolLM2 with adapters ad0, ad1 loaded at start and 2 device slots."""
    from serve.app import ServerSettings, create_app
    from serve.engine import Engine, EngineConfig
    from serve.protocol import Limits

    model, tokenizer = smollm2
    config = EngineConfig(max_adapters_on_device=2, **SMALL_ENGINE)
    engine = Engine(model, tokenizer.eos_token_ids, config, {n: adapters8[n] for n in ("ad0", "ad1")})
    settings = ServerSettings("SmolLM2-135M-Instruct", (str(allowed_dir),),
                              Limits(max_tokens=64, max_body_bytes=BODY_LIMIT))
    with LiveServer(create_app(engine, tokenizer, settings), engine) as server:
        server.wait_ready()
        yield server


@pytest.fixture(scope="session")
def client(live_server):
    from openai import OpenAI

    return OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
