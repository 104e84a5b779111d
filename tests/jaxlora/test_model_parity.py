"""Our Llama-family forward against HF `transformers` on the same weights (float32)."""

import os

import numpy as np
import pytest

from jaxlora.weights import load_llama
from tests.jaxlora.hf_checkpoints import (
    checkpoint_dir, hf_logits, jax_logits, relative_error, save_random_model, tiny_gemma2_config, tiny_gemma3_config,
    tiny_llama_config, tiny_mistral_config, tiny_phi3_config, tiny_qwen2_config, tiny_qwen3_config, write_llama_gguf,
)

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "In 1969, Neil Armstrong became the first person to walk on the Moon. He said: 'That's one small step",
]


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path), dtype=torch.float32
    )
    return model.eval()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_smollm2_gguf_matches_transformers(smollm2, hf_smollm2, prompt):
    model, tokenizer = smollm2
    tokens = np.array([tokenizer.encode(prompt)])
    assert relative_error(jax_logits(model, tokens), hf_logits(hf_smollm2, tokens)) <= 1e-4


def test_smollm2_greedy_answer(smollm2):
    model, tokenizer = smollm2
    tokens = np.array([tokenizer.encode("The capital of France is")])
    next_id = int(jax_logits(model, tokens)[0, -1].argmax())
    assert tokenizer.decode([next_id]).strip() == "Paris"


@pytest.mark.parametrize(
    "make_config",
    [tiny_llama_config, tiny_qwen2_config, lambda: tiny_llama_config(attention_bias=True, tie_word_embeddings=True),
     tiny_qwen3_config,
     lambda: tiny_llama_config(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})],
    ids=["llama3-rope-untied", "qwen2-bias-tied", "llama-attention-bias", "qwen3-qk-norm-head-dim", "linear-rope"],
)
def test_random_hf_checkpoint_matches_transformers(tmp_path, make_config):
    directory = checkpoint_dir(tmp_path, "model")
    reference = save_random_model(make_config(), directory)
    tokens = np.random.default_rng(1).integers(0, 320, size=(2, 37))
    ours = jax_logits(load_llama(directory), tokens)
    assert relative_error(ours, hf_logits(reference, tokens)) <= 1e-4


FAMILIES = {
    "mistral-sliding-window": tiny_mistral_config,
    "qwen2-sliding-layers": lambda: tiny_qwen2_config(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "gemma2": tiny_gemma2_config,
    "gemma3-text": tiny_gemma3_config,
    "phi3": tiny_phi3_config,
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_model_family_matches_transformers(tmp_path, family):
    """A random checkpoint of each family, with a sliding window (8) shorter than the sequence
    (37): full forward logits equal transformers' (eager attention, f32)."""
    directory = checkpoint_dir(tmp_path, "model")
    reference = save_random_model(FAMILIES[family](), directory)
    model = load_llama(directory)
    assert any(model.config.layer_windows())
    tokens = np.random.default_rng(1).integers(0, 320, size=(2, 37))
    assert relative_error(jax_logits(model, tokens), hf_logits(reference, tokens)) <= 1e-4


@pytest.mark.parametrize("make_config", [
    lambda: tiny_llama_config(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0},
                              max_position_embeddings=24),
    lambda: tiny_llama_config(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                               "original_max_position_embeddings": 16, "beta_fast": 16.0}),
    lambda: tiny_qwen2_config(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                               "original_max_position_embeddings": 16, "mscale": 0.8,
                                               "mscale_all_dim": 0.5, "truncate": False}),
], ids=["dynamic-past-max-position", "yarn", "yarn-mscale-untruncated"])
def test_rope_scaling_types_match_transformers(tmp_path, make_config):
    """'dynamic' (NTK, base recomputed from the call's longest position: 37 > 24) and 'yarn'."""
    directory = checkpoint_dir(tmp_path, "model")
    reference = save_random_model(make_config(), directory)
    tokens = np.random.default_rng(1).integers(0, 320, size=(2, 37))
    assert relative_error(jax_logits(load_llama(directory), tokens), hf_logits(reference, tokens)) <= 1e-4


@pytest.mark.parametrize("family", ["gemma2", "gemma3-text"])
def test_cached_decoding_with_windows_equals_full_forward(tmp_path, family):
    """The dense KV cache (generation) masks keys older than each layer's window like the full forward."""
    from jaxlora.models.llama import KVCache

    directory = checkpoint_dir(tmp_path, "model")
    save_random_model(FAMILIES[family](), directory)
    model = load_llama(directory)
    tokens = np.random.default_rng(4).integers(0, 320, size=(1, 30))
    full = jax_logits(model, tokens)
    cache = KVCache.zeros(model.config, 1, 32)
    logits, cache = model(tokens[:, :20], np.arange(20)[None], cache=cache)
    steps = [np.asarray(logits)[0]]
    for t in range(20, 30):
        logits, cache = model(tokens[:, t:t + 1], np.array([[t]]), cache=cache)
        steps.append(np.asarray(logits)[0])
    assert relative_error(np.concatenate(steps), full[0]) <= 1e-4


def test_layer_windows_follow_each_family():
    """Qwen2.5's files say sliding_window 131072 with use_sliding_window false: no window; Gemma 2
    alternates, Gemma 3 windows all but every pattern-th layer."""
    from jaxlora.nn.model_config import config_from_hf

    qwen = {**tiny_qwen2_config().to_dict(), "sliding_window": 131072, "use_sliding_window": False}
    assert config_from_hf(qwen).layer_windows() == (None, None, None)
    assert config_from_hf(tiny_gemma2_config().to_dict()).layer_windows() == (8, None, 8)
    gemma3 = {k: v for k, v in tiny_gemma3_config().to_dict().items() if k != "layer_types"}
    assert config_from_hf({**gemma3, "sliding_window_pattern": 3}).layer_windows() == (8, 8, None)


def test_unsupported_model_options_are_refused_by_name():
    from jaxlora.nn.model_config import ConfigError, config_from_hf

    refused = {
        "longrope": tiny_phi3_config(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                      "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                                      "original_max_position_embeddings": 256}),
        "partial_rotary_factor": tiny_phi3_config(partial_rotary_factor=0.5),
        "use_bidirectional_attention": tiny_gemma3_config(use_bidirectional_attention=True),
    }
    for name, config in refused.items():
        with pytest.raises(ConfigError, match=name):
            config_from_hf(config.to_dict())
    with pytest.raises(ConfigError, match="gemma3_text"):
        config_from_hf({"model_type": "gemma3"})
    with pytest.raises(ConfigError, match="rope_scaling type 'mrope'"):
        config_from_hf(tiny_llama_config(rope_parameters={"rope_type": "mrope", "rope_theta": 1.0}).to_dict())
    with pytest.raises(ConfigError, match="hidden_act 'relu'"):
        config_from_hf(tiny_llama_config(hidden_act="relu").to_dict())


def test_sharded_safetensors_load(tmp_path):
    import torch

    directory = checkpoint_dir(tmp_path, "sharded")
    reference = save_random_model(tiny_llama_config(), directory)
    torch.manual_seed(0)
    reference.save_pretrained(directory, safe_serialization=True, max_shard_size="100KB")
    assert os.path.exists(os.path.join(directory, "model.safetensors.index.json"))
    os.remove(os.path.join(directory, "model.safetensors")) if os.path.exists(
        os.path.join(directory, "model.safetensors")) else None
    tokens = np.random.default_rng(2).integers(0, 320, size=(1, 20))
    assert relative_error(jax_logits(load_llama(directory), tokens), hf_logits(reference, tokens)) <= 1e-4


@pytest.mark.parametrize("qtype_name", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_types_dequantize_like_reference(tmp_path, qtype_name):
    """A GGUF written from a random HF Llama loads back to its (de)quantized weights."""
    import gguf
    from gguf.quants import dequantize, quantize

    qtype = gguf.GGMLQuantizationType[qtype_name]
    reference = save_random_model(tiny_llama_config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                                  checkpoint_dir(tmp_path, "hf"))
    with np.errstate(all="ignore"):
        import torch

        with torch.no_grad():  # the reference sees exactly the rounding the file holds
            for name, param in reference.named_parameters():
                if param.ndim == 2:
                    array = param.numpy()
                    param.copy_(torch.from_numpy(dequantize(quantize(array, qtype), qtype).reshape(array.shape)))
    path = os.path.join(str(tmp_path), "tiny.gguf")
    write_llama_gguf(reference, path, qtype)
    tokens = np.random.default_rng(3).integers(0, 320, size=(2, 19))
    assert relative_error(jax_logits(load_llama(path), tokens), hf_logits(reference, tokens)) <= 1e-4
