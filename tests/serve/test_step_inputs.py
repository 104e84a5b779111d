"""A step's small inputs in device buffers that stay put (serve/step_inputs.py): the same buffers
for every step of one program, the new values in them, and the engine's answers unchanged."""

import jax
import numpy as np

from serve.step_inputs import StepInputs
from tests.serve.test_unified_pages import _mixed_rank_adapters, _serve


def _pointers(tree) -> list:
    return [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(tree)]


def test_place_writes_new_values_into_the_held_buffers():
    rng = np.random.default_rng(0)
    inputs = StepInputs(enabled=True)
    first = (rng.integers(0, 9, 12).astype(np.int32), {"slot": rng.integers(-1, 4, 12).astype(np.int32)}, None)
    second = (rng.integers(0, 9, 12).astype(np.int32), {"slot": rng.integers(-1, 4, 12).astype(np.int32)}, None)
    placed = inputs.place("forward", first)
    pointers = _pointers(placed)
    again = inputs.place("forward", second)
    assert _pointers(again) == pointers  # the same device buffers
    for got, want in zip(jax.tree.leaves(again), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(got), want)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(placed))  # donated into `again`
    other = inputs.place("forward", (np.zeros(16, np.int32), {"slot": np.zeros(16, np.int32)}, None))
    assert _pointers(other) != pointers  # another shape: buffers of its own
    device_leaf = jax.device_put(np.arange(12, dtype=np.int32))  # device leaves (the last step's tokens) too
    mixed = inputs.place("forward", (device_leaf, {"slot": second[1]["slot"]}, None))
    assert _pointers(mixed) == pointers and not device_leaf.is_deleted()
    np.testing.assert_array_equal(np.asarray(mixed[0]), np.arange(12))
    off = StepInputs(enabled=False)
    assert off.place("forward", first) is first


def test_prepared_copy_serves_the_steps_of_its_signature():
    """`prepare` (the engine's warmup, per program) compiles the copy ahead; `place` then runs it."""
    inputs = StepInputs(enabled=True)
    step = lambda seed: (np.random.default_rng(seed).integers(0, 9, 10).astype(np.int32), np.zeros(3, np.float32))
    inputs.prepare("decode", step(0))
    assert len(inputs._copies) == 1
    inputs.prepare("decode", step(1))  # the same signature: nothing more to compile
    assert len(inputs._copies) == 1
    placed = inputs.place("decode", step(2))
    pointers = _pointers(placed)
    again = inputs.place("decode", step(3))
    assert _pointers(again) == pointers
    np.testing.assert_array_equal(np.asarray(again[0]), step(3)[0])
    StepInputs(enabled=False).prepare("decode", step(0))  # off: nothing compiled, no error


def test_engine_answers_are_the_same_with_stable_inputs(tiny_model_dir):
    """Greedy tokens (float32) of requests over 8 adapters with the inputs held in stable buffers equal
    those without, with the XLA delta and with the paged kernels (interpret mode; unified paging), and
    the held buffers are one set per program."""
    from jaxlora.weights import load_model

    model, tokenizer = load_model(tiny_model_dir)
    adapters = _mixed_rank_adapters(model.config)
    requests = [(tokenizer.encode(f"Request {i} of the inputs test"), f"m{(5 * i) % 8}") for i in range(9)]
    for backend, extra in (("gather", {}), ("pallas", {"unified_paging": True, "adapter_rows": 48})):
        _, plain = _serve(model, tokenizer, adapters, requests, lora_backend=backend, stable_step_inputs=False,
                          **extra)
        engine, stable = _serve(model, tokenizer, adapters, requests, lora_backend=backend,
                                stable_step_inputs=True, **extra)
        assert stable == plain, backend
        held = engine.step_inputs._held
        assert 0 < len(held) <= len(engine.step_shapes())
        assert len({key for key, _ in held}) == len(held)  # one set of buffers per program
