"""Shared test set-up: pytest markers for accelerator-only tests, float32 matmuls, model fixtures
(the embedded SmolLM2, a tiny random Llama directory with its vocabulary)."""

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


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct in float32, loaded once."""
    from jaxlora.weights import load_model

    return load_model("default")


@pytest.fixture(scope="session")
def smollm2_path():
    from jaxlora.weights import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2):
    """A 2-layer random Llama (SmolLM2's vocabulary) saved as a HF directory with tokenizer.json."""
    from tests.jaxlora.hf_checkpoints import write_tiny_model_dir

    return write_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_model")), smollm2[1])
