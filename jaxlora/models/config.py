"""The Llama-family model configuration (built from a HF `config.json` or from GGUF metadata) and
the names, shapes and biases of its LoRA-targetable projections."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

SUPPORTED_HF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
# The linear projections of a decoder layer (PEFT's module names), where LoRA can go.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Projections of one input that a serving model may hold as one kernel, side by side in this
# order (`jaxlora.models.packed`): one GEMM instead of three or two.
PACKED_PROJECTIONS = {("q_proj", "k_proj", "v_proj"): "qkv_proj", ("gate_proj", "up_proj"): "gate_up_proj"}


class ConfigError(ValueError):
    """A model configuration that jaxlora cannot build a model from."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: Llama-3's (`rope_type == "llama3"`, the band factors below) or
    linear position interpolation (`"linear"`: every frequency divided by `factor`)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shapes and constants of a Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama's attention_bias)
    o_proj_bias: bool = False  # bias on the output projection (Llama's attention_bias only)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    qk_norm: bool = False  # RMSNorm of each head's query and key before RoPE (Qwen3)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def projection_shapes(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of one decoder layer."""
    d, f = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (d, config.q_size),
        "k_proj": (d, config.kv_size),
        "v_proj": (d, config.kv_size),
        "o_proj": (config.q_size, d),
        "gate_proj": (d, f),
        "up_proj": (d, f),
        "down_proj": (f, d),
    }


def has_bias(config: LlamaConfig, name: str) -> bool:
    """Whether projection `name` has a bias (q/k/v: attention_bias; o_proj: o_proj_bias)."""
    if name in ("q_proj", "k_proj", "v_proj"):
        return config.attention_bias
    return name == "o_proj" and config.o_proj_bias


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _rope_scaling_from_hf(raw: Mapping[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    rope_type = raw.get("rope_type", raw.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type == "linear":
        return RopeScaling(factor=float(raw["factor"]), rope_type="linear")
    if rope_type != "llama3":
        raise ConfigError(f"unsupported rope_scaling type {rope_type!r} (supported: 'llama3', 'linear'; "
                          f"'dynamic' and 'yarn' are not implemented)")
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw["low_freq_factor"]),
        high_freq_factor=float(raw["high_freq_factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
    )


def _context_within_window(hf: Mapping[str, Any], source: str) -> int:
    """max_position_embeddings, capped at a Mistral-style `sliding_window` (every layer windowed):
    within the window sliding-window attention is full attention, which is what jaxlora runs, so
    the model is exact on every sequence it then accepts."""
    context = int(hf.get("max_position_embeddings", 2048))
    window = hf.get("sliding_window")
    if hf.get("model_type") == "mistral" and window is not None and int(window) < context:
        logging.getLogger(__name__).warning(
            "%s: sliding_window %d < max_position_embeddings %d: context capped at %d (jaxlora runs full attention, "
            "equal to the window's within it)", source, int(window), context, int(window))
        return int(window)
    return context


def config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> LlamaConfig:
    """Builds a config from the dict of a HF `config.json`; `source` names the file in errors."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_HF_ARCHITECTURES:
        raise ConfigError(
            f"{source}: unknown architecture model_type={model_type!r}; "
            f"jaxlora supports {', '.join(SUPPORTED_HF_ARCHITECTURES)}"
        )
    if hf.get("use_sliding_window") or any(kind != "full_attention" for kind in hf.get("layer_types") or ()):
        raise ConfigError(f"{source}: sliding-window attention layers are not supported yet (use_sliding_window / "
                          f"layer_types); jaxlora runs full attention only")
    try:
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        rope_raw = hf.get("rope_scaling") or hf.get("rope_parameters")
        rope_theta = hf.get("rope_theta")
        if rope_theta is None and isinstance(rope_raw, Mapping):
            rope_theta = rope_raw.get("rope_theta")
        return LlamaConfig(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=_rope_scaling_from_hf(rope_raw),
            max_position_embeddings=_context_within_window(hf, source),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            o_proj_bias=model_type != "qwen2" and bool(hf.get("attention_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos_ids(hf.get("eos_token_id")),
            model_type=model_type,
            qk_norm=model_type == "qwen3",
        )
    except KeyError as missing:
        raise ConfigError(f"{source}: missing required key {missing}") from None


def config_from_gguf(metadata: Mapping[str, Any], has_output_tensor: bool, source: str) -> LlamaConfig:
    """Builds a config from GGUF key/value metadata (already decoded to Python values)."""
    arch = metadata.get("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ConfigError(f"{source}: unknown GGUF architecture {arch!r}; jaxlora supports llama, qwen2")

    def key(name: str, default: Any = KeyError):
        full = f"{arch}.{name}"
        if full in metadata:
            return metadata[full]
        if default is KeyError:
            raise ConfigError(f"{source}: GGUF metadata lacks {full!r}")
        return default

    num_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = int(key("vocab_size", len(tokens) if tokens is not None else KeyError))
    rope_scaling = None
    if key("rope.scaling.type", None) == "llama3" or f"{arch}.rope.scaling.low_freq_factor" in metadata:
        rope_scaling = RopeScaling(
            factor=float(key("rope.scaling.factor")),
            low_freq_factor=float(key("rope.scaling.low_freq_factor", 1.0)),
            high_freq_factor=float(key("rope.scaling.high_freq_factor", 4.0)),
            original_max_position_embeddings=int(key("rope.scaling.original_context_length")),
        )
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=int(key("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings=not has_output_tensor,
        attention_bias=arch == "qwen2",
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_ids(eos),
        model_type=arch,
    )
