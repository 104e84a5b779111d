"""`ReplicaSet.on_devices` over 4 simulated CPU devices (what `jaxlora-serve --replicas 4` builds):
each engine's weights, adapter pool and KV pages live on its own device, and a KV shortage
migrates requests between devices with every request's tokens equal to one engine's."""

import jax

from serve.engine import Engine, EngineConfig
from serve.replicas import ReplicaSet, server_state
from tests.jaxlora.parallel.fixtures import CONFIG, tiny_model
from tests.serve.conftest import make_adapters
from tests.serve.test_replicas import ROOMY_KV, SHORT_KV, _requests, _serve, _tokens


def test_one_engine_per_device_and_migration_between_devices():
    model, adapters = tiny_model(CONFIG), make_adapters(CONFIG, 3)
    devices = jax.devices()[:4]
    replicas = ReplicaSet.on_devices(model, (), EngineConfig(**SHORT_KV), adapters, devices)
    for engine, device in zip(replicas.engines, devices):
        assert engine.cache.k.devices() == {device}
        assert {d for leaf in jax.tree.leaves(engine.pool.arrays) for d in leaf.devices()} == {device}
    requests = _requests(6)
    events = _serve(replicas, requests)
    reference = _serve(Engine(model, (), EngineConfig(**ROOMY_KV), adapters), requests)
    assert replicas.migrations >= 1
    assert [_tokens(events[i]) for i in range(6)] == [_tokens(reference[i]) for i in range(6)]
    state = server_state(replicas)
    assert [r["device"] for r in state["replicas"]] == [str(d) for d in devices]
    assert all(r["free_pages"] == SHORT_KV["num_pages"] for r in state["replicas"])
