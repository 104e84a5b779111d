"""Small random-weight checkpoints written by `transformers` (safetensors) and as GGUF, for tests."""

from __future__ import annotations

import os

import numpy as np


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    values = dict(
        vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    )
    values.update(overrides)
    return LlamaConfig(**values)


def tiny_qwen2_config(**overrides):
    from transformers import Qwen2Config

    values = dict(
        vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
    )
    values.update(overrides)
    return Qwen2Config(**values)


def tiny_qwen3_config(**overrides):
    from transformers import Qwen3Config

    values = dict(
        vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
    )
    values.update(overrides)
    return Qwen3Config(**values)


def _tiny(config_class, **values):
    """A 3-layer, hidden-64 config of `config_class` (GQA 4/2, vocab 320) with `values` on top."""
    base = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512)
    return config_class(**{**base, **values})


def tiny_mistral_config(**overrides):
    """Mistral with a sliding window (8) shorter than the test sequences: every layer windowed."""
    from transformers import MistralConfig

    return _tiny(MistralConfig, sliding_window=8, **overrides)


def tiny_gemma2_config(**overrides):
    """Gemma 2: every other layer windowed (8), both soft-caps, query_pre_attn_scalar != head_dim."""
    from transformers import Gemma2Config

    return _tiny(Gemma2Config, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                 attn_logit_softcapping=3.0, final_logit_softcapping=5.0, **overrides)


def tiny_gemma3_config(**overrides):
    """Gemma 3 (text): layers 0-1 windowed with the local RoPE base, layer 2 global (pattern 3) with
    linear RoPE scaling; q/k norms."""
    from transformers import Gemma3TextConfig

    values = dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24, sliding_window_pattern=3,
                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}})
    return _tiny(Gemma3TextConfig, **{**values, **overrides})


def tiny_phi3_config(**overrides):
    """Phi-3: fused qkv_proj and gate_up_proj, a sliding window (8) on every layer."""
    from transformers import Phi3Config

    return _tiny(Phi3Config, sliding_window=8, pad_token_id=0, eos_token_id=2, **overrides)


def save_random_model(config, directory: str, seed: int = 0):
    """Writes a randomly initialised model with `save_pretrained` (safetensors); returns it."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    # eager: soft-capping and sliding windows exactly as transformers defines them
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # make norms and biases non-trivial so a mix-up would show
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    model.eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def write_tiny_model_dir(directory: str, tokenizer, num_layers: int = 2, seed: int = 0) -> str:
    """A random Llama of `num_layers` layers (hidden 64) with `tokenizer`'s vocabulary (e.g.
    SmolLM2's), saved as a HF directory with tokenizer.json and tokenizer_config.json: a model a
    server or trainer loads by path, small enough for fast CPU tests."""
    import json

    config = tiny_llama_config(vocab_size=tokenizer.vocab_size, num_hidden_layers=num_layers, hidden_size=64,
                               intermediate_size=128, eos_token_id=list(tokenizer.eos_token_ids),
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    save_random_model(config, directory, seed)
    tokenizer.backend.save(os.path.join(directory, "tokenizer.json"))
    eos = tokenizer.token_text(tokenizer.eos_token_ids[0])
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": eos, "chat_template": tokenizer.chat_template}, f)
    return directory


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def _permute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape
    )


def write_llama_gguf(model, path: str, qtype=None, tensor_types: dict | None = None) -> None:
    """Writes a HF Llama model as a llama.cpp-style GGUF (permuted q/k), weights in `qtype`."""
    import gguf
    from gguf.quants import quantize

    qtype = qtype or gguf.GGMLQuantizationType.F32
    config = model.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                   "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    for hf_name, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        if hf_name in names:
            name = names[hf_name]
        else:
            parts = hf_name.split(".")
            module = ".".join(parts[3:-1])
            name = f"blk.{parts[2]}.{layer_names[module]}.{parts[-1]}"
        if name.endswith("attn_q.weight"):
            array = _permute_rotary(array, config.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            array = _permute_rotary(array, config.num_key_value_heads)
        kind = (tensor_types or {}).get(name, qtype if array.ndim == 2 else gguf.GGMLQuantizationType.F32)
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def relative_error(ours, reference) -> float:
    ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
    return float(np.linalg.norm(ours - reference) / np.linalg.norm(reference))


def jax_logits(model, tokens: np.ndarray) -> np.ndarray:
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    logits, _ = model(tokens, positions)
    return np.asarray(logits)


def checkpoint_dir(tmp_path, name: str) -> str:
    path = os.path.join(str(tmp_path), name)
    os.makedirs(path, exist_ok=True)
    return path
