"""Shared test set-up: pytest markers for accelerator-only tests, float32 matmuls, model fixtures
(the embedded SmolLM2, a tiny random Llama directory with its vocabulary)."""

import gc

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


def _platform() -> str:
    return jax.default_backend()


def pytest_collection_modifyitems(config, items):
    platform = _platform()
    for item in items:
        if "gpu_only" in item.keywords and platform != "gpu":
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU"))
        if "tpu_only" in item.keywords and platform != "tpu":
            item.add_marker(pytest.mark.skip(reason="needs a TPU"))


def _memory_map_count() -> int:
    """Memory regions this process has mapped (0 where /proc is missing)."""
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


def _memory_map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            return int(limit.read())
    except (OSError, ValueError):
        return 65530


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops jax's compiled programs after a test module once the process holds many.

    XLA:CPU maps ~6 memory regions per compiled program and keeps them while the program is
    cached; the single pytest process of `make test` compiles thousands, reached the kernel's
    vm.max_map_count (65530) at ~85% of the suite, and the next compile segfaulted inside LLVM (an
    mmap that failed). Clearing past a third of the limit keeps the cache warm within a module."""
    yield
    if _memory_map_count() > _memory_map_limit() // 3:
        jax.clear_caches()
        gc.collect()


# The session's SmolLM2 and its weight arrays as loaded (jax arrays are immutable: a test that
# writes a weight replaces the array, which `_shared_model_unchanged` sees by identity).
_SHARED_MODEL: dict = {}


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct in float32, loaded once and shared:
    a test that changes its weights must put the same arrays back (tests.serve.conftest.exact_weights)."""
    from jaxlora.weights import load_model

    model, tokenizer = load_model("default")
    _SHARED_MODEL.update(model=model, arrays={name: param.get_value() for name, param in model.weights.items()})
    return model, tokenizer


@pytest.fixture(autouse=True, scope="module")
def _shared_model_unchanged(request):
    """Fails a module that left the shared SmolLM2's weights changed, and restores them.

    Found by a full-suite run: a merge then unmerge "up to float rounding" left the shared weights
    ~1e-7 off, and a later test that compares training on the shared model with training on a fresh
    load of the same file differed by up to 5e-3 (bit for bit when run alone)."""
    yield
    if not _SHARED_MODEL:
        return
    from flax import nnx

    weights, arrays = _SHARED_MODEL["model"].weights, _SHARED_MODEL["arrays"]
    changed = sorted(set(weights.keys()) ^ set(arrays)) + sorted(
        name for name, array in arrays.items() if name in weights and weights[name].get_value() is not array)
    for name in changed:
        if name not in arrays:
            del weights[name]
        elif name in weights:
            weights[name].set_value(arrays[name])
        else:
            weights[name] = nnx.Param(arrays[name])
    assert not changed, f"{request.node.nodeid} left the shared smollm2 weights changed: {changed[:4]}"


@pytest.fixture(scope="session")
def smollm2_path():
    from jaxlora.weights import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2):
    """A 2-layer random Llama (SmolLM2's vocabulary) saved as a HF directory with tokenizer.json."""
    from tests.jaxlora.hf_checkpoints import write_tiny_model_dir

    return write_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_model")), smollm2[1])


@pytest.fixture(scope="session")
def topic_head_adapter(tmp_path_factory, smollm2):
    """(folder, held-out records, losses) of a SmolLM2 classification adapter with a task head,
    trained once per session on the generated topic task (tests/train/head_task.py)."""
    from tests.train.head_task import train_topic_adapter

    return train_topic_adapter(str(tmp_path_factory.mktemp("topic_head")), *smollm2)
