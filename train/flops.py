"""Model FLOPs of LoRA training steps and the devices' peak, for MFU (model FLOPs utilisation:
the FLOPs the model needs, recomputation not counted, over what the devices could do).

The base model is frozen, so its weights get no gradient: a linear layer costs 2 FLOPs per
weight and token forward and 2 more backward (the input gradient), 4 in all (not the usual 6).
Attention (causal, inside each packed sample of n tokens: n(n+1)/2 query-key pairs) costs two
matmuls forward and four backward. LoRA (A [k, r], B [r, n]) costs 6 FLOPs per parameter and
token (forward, input and weight gradients)."""

from __future__ import annotations

from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.nn.model_config import LlamaConfig

# Dense bf16 TFLOP/s per device, by `jax.Device.device_kind` (the first entry that is a substring).
PEAK_TFLOPS = (
    ("H200", 989.0), ("H100", 989.0), ("A100", 312.0), ("L4", 121.0),
    ("TPU v6", 918.0), ("TPU v5 lite", 197.0), ("TPU v5", 459.0), ("TPU v4", 275.0),
)


def peak_tflops(device_kind: str) -> float | None:
    """The bf16 dense peak of a device kind, None when unknown (e.g. a CPU)."""
    for name, peak in PEAK_TFLOPS:
        if name in device_kind:
            return peak
    return None


def _projection_shapes(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    d, q, kv, ffn = (config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim,
                     config.intermediate_size)
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, ffn), "up_proj": (d, ffn), "down_proj": (ffn, d)}


def base_flops_per_token(config: LlamaConfig) -> float:
    """Forward + input-gradient FLOPs of the frozen linear layers (and the LM head) per token."""
    per_layer = sum(k * n for k, n in _projection_shapes(config).values())
    return 4.0 * (config.num_layers * per_layer + config.hidden_size * config.vocab_size)


def attention_flops(config: LlamaConfig, length: int) -> float:
    """Training FLOPs of causal attention over one packed sample of `length` tokens."""
    pairs = length * (length + 1) / 2
    forward = 2 * 2 * config.num_heads * config.head_dim * pairs  # q k^T and p v
    return 3.0 * forward * config.num_layers


def lora_flops_per_token(config: LlamaConfig, lora: LoraConfig) -> float:
    """Training FLOPs of one adapter per token (its rank `r` in every layer of its targets)."""
    shapes = _projection_shapes(config)
    return 6.0 * config.num_layers * sum(lora.r * sum(shapes[m]) for m in lora.target_modules)


def sample_flops(config: LlamaConfig, lora: LoraConfig, length: int) -> float:
    """Model FLOPs of training on one sample of `length` tokens with adapter `lora`."""
    return length * (base_flops_per_token(config) + lora_flops_per_token(config, lora)) + attention_flops(
        config, length)
