"""On a GPU: the bfloat16 forward of SmolLM2 agrees with the float32 forward on the CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.weights import load_model
from tests.jaxlora.hf_checkpoints import relative_error

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time, in a land far away,"]


@pytest.mark.gpu_only
def test_bf16_gpu_logits_match_f32_cpu():
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        model_f32, tokenizer = load_model("default", dtype=jnp.float32)
    model_bf16, _ = load_model("default", dtype=jnp.bfloat16)
    errors, top1_agreement = [], []
    for prompt in PROMPTS:
        tokens = np.array([tokenizer.encode(prompt)])
        positions = np.arange(tokens.shape[1])[None]
        with jax.default_device(cpu):
            reference = np.asarray(model_f32(tokens, positions)[0])
        on_gpu, _ = jax.jit(lambda t, p: model_bf16(t, p))(tokens, positions)
        assert next(iter(on_gpu.devices())).platform == "gpu"
        on_gpu = np.asarray(on_gpu, np.float32)
        errors.append(relative_error(on_gpu, reference))
        top1_agreement.append(float((on_gpu.argmax(-1) == reference.argmax(-1)).mean()))
    print(f"\n{jax.devices()[0].device_kind}: bf16 GPU vs f32 CPU relative error per prompt "
          f"{[f'{e:.2e}' for e in errors]}, top-1 agreement {[f'{a:.2f}' for a in top1_agreement]}")
    assert max(errors) <= 5e-2  # measured 1.7e-2..2.9e-2 on an H100 (2026-11-22)
    assert min(top1_agreement) >= 0.8
