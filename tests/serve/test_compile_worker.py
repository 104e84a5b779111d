"""The compile worker (issue 35): the background compile in a child process serves the tokens of
programs compiled in-process, the server falls back to compiling in-process where the child fails,
and the child's arguments are rebuilt with their shapes, dtypes and shardings."""

import logging
import pickle

import jax
import numpy as np

from serve.compile_worker import CompileWorker, abstract, concrete
from serve.engine import Engine, EngineConfig
from tests.serve.test_background_compile import (  # noqa: F401 (expected: the fixture, in-process tokens)
    PROMPTS, TINY_ENGINE, _serve, expected, hold_background,
)

ENGINE = dict(TINY_ENGINE, scan_layers_from_tokens=16, background_compile=True)


def test_background_compile_in_the_worker_serves_the_same_tokens(smollm2, adapters8, expected):
    model, tokenizer = smollm2
    config = EngineConfig(**ENGINE, compile_worker=True)
    engine = Engine(model, tokenizer.eos_token_ids, config, {name: adapters8[name] for name in ("ad0", "ad1")})
    release = hold_background(engine)  # the background thread waits until the first requests are served
    info = engine.warmup()
    worker = engine.startup.worker
    assert info["background"] > 0 and worker is not None and worker.alive
    try:
        assert _serve(engine, tokenizer) == expected  # in the stand-ins and larger buckets meanwhile
    finally:
        release.set()
        engine.startup.background.join(timeout=600)
    assert worker.failed is None
    assert worker.compiled == info["background"]  # every program of the background compile, none in-process
    assert not engine.programs.stand_ins() and set(engine.step_shapes()) <= set(engine.programs.shapes())
    assert _serve(engine, tokenizer) == expected  # now in the worker's programs
    assert engine.stats.step_compiles == 0
    assert not worker.alive and worker._process.returncode is not None  # the child ended with the compile


def test_worker_errors_and_death_fall_back_to_compiling_in_process(smollm2, caplog):
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(**TINY_ENGINE))
    shapes = [s for s in engine.step_shapes() if s.program == "forward" and not s.lora][:2]
    worker = CompileWorker.start()
    try:
        with caplog.at_level(logging.WARNING, logger="jaxlora.serve"):
            assert worker.compile("no_such_program", (), (), {}) is None  # the child's error, logged
        assert "could not compile program no_such_program (KeyError" in caplog.text and worker.alive
        engine.programs.compile(shapes[0], engine.startup.padding_args(shapes[0]), worker=worker)
        assert worker.compiled == 1 and shapes[0] in engine.programs
        worker._process.kill()
        worker._process.wait()
        with caplog.at_level(logging.WARNING, logger="jaxlora.serve"):
            engine.programs.compile(shapes[1], engine.startup.padding_args(shapes[1]), worker=worker)
        assert shapes[1] in engine.programs and worker.compiled == 1  # compiled here
        assert worker.failed and "the child ended" in worker.failed and not worker.alive
        assert "compile worker stopped" in caplog.text
    finally:
        worker.close()
    got = []  # both programs run
    engine.submit(0, tokenizer.encode(PROMPTS[0]), None, __import__("jaxlora.sampling").sampling.SamplingParams(3),
                  got.append)
    engine.run_until_idle()
    assert [e.token for e in got if e.token is not None]


def test_engine_stop_ends_the_worker(smollm2):
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(**ENGINE, compile_worker=True))
    release = hold_background(engine)
    engine.warmup()
    worker = engine.startup.worker
    engine.start()
    engine.stop()
    release.set()
    engine.startup.background.join(timeout=300)
    assert not engine.startup.background.is_alive() and not worker.alive
    assert worker.compiled == 0 and engine.programs.stand_ins()  # stopped before compiling anything


def test_abstract_arguments_keep_shapes_dtypes_and_shardings():
    device = jax.devices()[0]
    committed = jax.device_put(np.arange(6, dtype=np.float32).reshape(2, 3), device)
    uncommitted = jax.numpy.zeros((4,), jax.numpy.bfloat16)
    spec = jax.ShapeDtypeStruct((5, 7), np.int32, sharding=jax.sharding.SingleDeviceSharding(device))
    args = ({"a": committed, "b": uncommitted}, (spec, np.ones(3, np.int16)), 3, None)
    rebuilt = concrete(pickle.loads(pickle.dumps(abstract(args))))
    assert rebuilt[0]["a"] == jax.ShapeDtypeStruct((2, 3), np.float32, sharding=committed.sharding)
    assert rebuilt[0]["b"].shape == (4,) and rebuilt[0]["b"].dtype == np.dtype("bfloat16")
    assert rebuilt[0]["b"].sharding is None  # uncommitted: lands on the default device, as in the call
    assert rebuilt[1][0] == spec
    assert rebuilt[1][1] == jax.ShapeDtypeStruct((3,), np.int16) and rebuilt[2:] == (3, None)


def test_a_worker_that_cannot_start_leaves_the_compile_in_process(smollm2, monkeypatch, caplog):
    import serve.warmup

    def fail():
        raise OSError("no processes here")

    monkeypatch.setattr(serve.warmup.CompileWorker, "start", staticmethod(fail))
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(**ENGINE, compile_worker=True))
    with caplog.at_level(logging.WARNING, logger="jaxlora.serve"):
        engine.startup.start_worker()
    assert engine.startup.worker is None and "compile worker not started (OSError: no processes here)" in caplog.text
