"""`jaxlora-serve --replicas 4 --grow-kv` on 4 simulated devices builds a replica set with one
engine per device behind the app; GET /state lists them."""

import jax
from fastapi.testclient import TestClient

from serve.cli import build_app, build_parser
from serve.replicas import ReplicaSet
from tests.serve.tiny_checkpoint import make_checkpoint


def test_serve_replicas_option_builds_one_engine_per_device(tmp_path):
    directory, paths, *_ = make_checkpoint(tmp_path)
    args = build_parser().parse_args(["--model", str(directory), "--replicas", "4", "--grow-kv", "--max-model-len",
                                      "64", "--compile-cache", "", "--adapter", f"ad0={paths['ad0']}"])
    app = build_app(args)
    engine = app.state.server.engine
    assert isinstance(engine, ReplicaSet) and len(engine.engines) == 4
    assert not engine.config.reserve_output_kv and engine.adapter_names() == ["ad0"]
    state = TestClient(app).get("/state").json()  # no lifespan: the engines are not started
    assert [r["device"] for r in state["replicas"]] == [str(d) for d in jax.devices()[:4]]
