"""Shared test set-up: pytest markers for accelerator-only tests, float32 matmuls, model fixtures."""

import os

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
