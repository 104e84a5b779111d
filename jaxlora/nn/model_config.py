"""The Llama-family model configuration (built from a HF `config.json` or from GGUF metadata) and
the names, shapes and biases of its LoRA-targetable projections."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

SUPPORTED_HF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3")
# The MLP's gate activations (HF's `hidden_act` / `hidden_activation` names).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Attention kinds of a layer (HF's `layer_types`): all keys, or only the last `sliding_window`.
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("llama3", "linear", "dynamic", "yarn")
# The linear projections of a decoder layer (PEFT's module names), where LoRA can go.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Projections of one input that a serving model may hold as one kernel, side by side in this
# order (`jaxlora.models.packed`): one GEMM instead of three or two.
PACKED_PROJECTIONS = {("q_proj", "k_proj", "v_proj"): "qkv_proj", ("gate_proj", "up_proj"): "gate_up_proj"}


class ConfigError(ValueError):
    """A model configuration that jaxlora cannot build a model from."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as transformers' rope utils define each `rope_type`:
    "llama3" (the band factors below), "linear" (position interpolation: every frequency divided
    by `factor`), "dynamic" (NTK: the base grows with the longest position of the call past
    `original_max_position_embeddings`) or "yarn" (frequencies ramped between interpolation and
    extrapolation by `beta_fast`/`beta_slow`; cos/sin scaled by `attention_factor`)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"unsupported rope_scaling type {self.rope_type!r} (supported: {', '.join(ROPE_TYPES)})")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shapes and constants of a Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2/3,
    Gemma 2/3, Phi-3). The defaults are Llama's; the fields after `qk_norm` are what the other
    families change."""

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
    qk_norm: bool = False  # RMSNorm of each head's query and key before RoPE (Qwen3, Gemma 3)
    sliding_window: int | None = None  # keys a "sliding_attention" layer sees: q_pos - k_pos < window
    layer_types: tuple[str, ...] | None = None  # per layer, one of LAYER_TYPES; None: all full attention
    hidden_act: str = "silu"  # the MLP gate's activation, one of ACTIVATIONS (Gemma: gelu tanh)
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight), in float32 (Gemma: 1)
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and MLP too (post_/pre_feedforward_)
    embed_scale: float | None = None  # embeddings multiplied by it (Gemma: sqrt(hidden), in the weights' dtype)
    query_scale: float | None = None  # attention scores' scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask (Gemma 2)
    final_logit_softcap: float | None = None  # the same on the logits (Gemma 2)
    local_rope_theta: float | None = None  # RoPE base of sliding layers, unscaled (Gemma 3); None: as global

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"unsupported hidden_act {self.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise ConfigError(f"layer_types must give one of {LAYER_TYPES} for each of the {self.num_layers} "
                                  f"layers, got {self.layer_types}")
            if "sliding_attention" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
                raise ConfigError(f"sliding_attention layers need a positive sliding_window, got {self.sliding_window}")
        scaled_cos = self.rope_scaling is not None and self.rope_scaling.attention_factor != 1.0
        if scaled_cos and self.local_rope_theta is not None and len(set(self.layer_types or ())) > 1:
            raise ConfigError("yarn's attention factor on global layers beside local-RoPE sliding layers "
                              "(Gemma 3 with yarn) is not supported")

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window (None: full attention)."""
        types = self.layer_types or ("full_attention",) * self.num_layers
        return tuple(self.sliding_window if kind == "sliding_attention" else None for kind in types)

    @property
    def scores_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return self.head_dim**-0.5 if self.query_scale is None else self.query_scale

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


# Checkpoint tensors that hold several projections side by side (Phi-3): name -> the parts in order.
FUSED_CHECKPOINT_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fused_parts(config: LlamaConfig, name: str) -> list[tuple[str, int]] | None:
    """[(projection, output rows)] of a fused checkpoint projection (`qkv_proj`, `gate_up_proj`:
    rows of the HF weight, split in this order), or None for any other name."""
    parts = FUSED_CHECKPOINT_PROJECTIONS.get(name)
    if parts is None:
        return None
    shapes = projection_shapes(config)
    return [(part, shapes[part][1]) for part in parts]


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


def _rope_scaling_from_hf(raw: Mapping[str, Any] | None, hf: Mapping[str, Any], source: str) -> RopeScaling | None:
    """The RoPE scaling of a HF rope dict (`rope_scaling` / `rope_parameters`); refuses the types
    jaxlora does not implement by name."""
    if not raw:
        return None
    rope_type = raw.get("rope_type", raw.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type in ("longrope", "su"):
        raise ConfigError(f"{source}: rope_scaling type {rope_type!r} (Phi-3's LongRoPE: short/long factors "
                          f"switched by sequence length) is not implemented")
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{source}: unsupported rope_scaling type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
    context = int(hf.get("max_position_embeddings", 2048))
    if rope_type in ("linear", "dynamic"):  # dynamic: transformers scales past max_position_embeddings
        return RopeScaling(factor=float(raw["factor"]), rope_type=rope_type, original_max_position_embeddings=context)
    if rope_type == "yarn":
        return _yarn_from_hf(raw, hf, context)
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw["low_freq_factor"]),
        high_freq_factor=float(raw["high_freq_factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
    )


def _yarn_from_hf(raw: Mapping[str, Any], hf: Mapping[str, Any], context: int) -> RopeScaling:
    """YaRN's constants as transformers' `_compute_yarn_parameters` derives them."""
    original = int(hf.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings") or context)
    factor = float(raw["factor"]) if raw.get("factor") is not None else context / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = raw.get("attention_factor")
    if attention_factor is None:
        m, m_all = raw.get("mscale"), raw.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeScaling(factor=factor, rope_type="yarn", original_max_position_embeddings=original,
                       beta_fast=float(raw.get("beta_fast") or 32), beta_slow=float(raw.get("beta_slow") or 1),
                       truncate=bool(raw.get("truncate", True)), attention_factor=float(attention_factor))


def _rope_from_hf(hf: Mapping[str, Any], source: str) -> tuple[float, RopeScaling | None, float | None]:
    """(rope_theta, scaling of the global layers, theta of sliding layers or None) of a HF config:
    one rope dict, or Gemma 3's dict per layer type (or its older `rope_local_base_freq`)."""
    raw = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    local_theta = hf.get("rope_local_base_freq")
    if isinstance(raw, Mapping) and "full_attention" in raw:  # per layer type
        local = raw.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"{source}: RoPE scaling on sliding layers ({local.get('rope_type')!r}) is not supported")
        local_theta = local.get("rope_theta", local_theta)
        raw = raw["full_attention"] or {}
    if float(raw.get("partial_rotary_factor", hf.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise ConfigError(f"{source}: partial_rotary_factor != 1 (RoPE on part of each head) is not supported")
    theta = hf.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        theta = 1_000_000.0 if hf.get("model_type") == "gemma3_text" else 10000.0
    if hf.get("model_type") == "gemma3_text" and local_theta is None:
        local_theta = 10000.0
    return float(theta), _rope_scaling_from_hf(raw, hf, source), None if local_theta is None else float(local_theta)


def _layer_types_from_hf(hf: Mapping[str, Any], num_layers: int) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) as transformers builds them for each family: Mistral and Phi-3
    window every layer, Qwen2/3 the layers from `max_window_layers` on (with `use_sliding_window`),
    Gemma 2 every other layer, Gemma 3 all but every `sliding_window_pattern`-th; an explicit
    `layer_types` list wins."""
    model_type, window = hf.get("model_type"), hf.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window"):
        window = None
    if window is None:
        return None, None
    if hf.get("layer_types"):
        return int(window), tuple(hf["layer_types"])
    if model_type in ("qwen2", "qwen3"):
        start = int(hf.get("max_window_layers", 28))
        sliding = [i >= start for i in range(num_layers)]
    elif model_type == "gemma2":
        sliding = [(i + 1) % 2 != 0 for i in range(num_layers)]
    elif model_type == "gemma3_text":
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    else:
        sliding = [True] * num_layers
    return int(window), tuple("sliding_attention" if s else "full_attention" for s in sliding)


def _family_fields(hf: Mapping[str, Any], model_type: str, head_dim: int, hidden: int, source: str) -> dict[str, Any]:
    """The config fields where Gemma 2/3 differ from Llama (activation, norms, scales, soft-caps)."""
    if model_type not in ("gemma2", "gemma3_text"):
        return dict(hidden_act=hf.get("hidden_act", "silu"))
    if hf.get("use_bidirectional_attention"):
        raise ConfigError(f"{source}: use_bidirectional_attention=true (Gemma embedding models) is not supported")
    return dict(
        hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        norm_offset=1.0, sandwich_norms=True, embed_scale=hidden**0.5,
        query_scale=float(hf.get("query_pre_attn_scalar", head_dim)) ** -0.5,
        # transformers' defaults where a file omits them: Gemma 2 caps (50, 30), Gemma 3 does not
        attn_logit_softcap=hf.get("attn_logit_softcapping", 50.0 if model_type == "gemma2" else None),
        final_logit_softcap=hf.get("final_logit_softcapping", 30.0 if model_type == "gemma2" else None),
    )


def config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> LlamaConfig:
    """Builds a config from the dict of a HF `config.json`; `source` names the file in errors."""
    model_type = hf.get("model_type")
    if model_type == "gemma3":
        raise ConfigError(f"{source}: model_type 'gemma3' is Gemma 3's image-text model; jaxlora runs the text "
                          f"model only (model_type 'gemma3_text', e.g. gemma-3-1b)")
    if model_type not in SUPPORTED_HF_ARCHITECTURES:
        raise ConfigError(
            f"{source}: unknown architecture model_type={model_type!r}; "
            f"jaxlora supports {', '.join(SUPPORTED_HF_ARCHITECTURES)}"
        )
    try:
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        num_layers = int(hf["num_hidden_layers"])
        head_dim = int(hf.get("head_dim") or hidden // num_heads)
        rope_theta, rope_scaling, local_rope_theta = _rope_from_hf(hf, source)
        sliding_window, layer_types = _layer_types_from_hf(hf, num_layers)
        return LlamaConfig(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", model_type in ("gemma2", "gemma3_text"))),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            o_proj_bias=model_type != "qwen2" and bool(hf.get("attention_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos_ids(hf.get("eos_token_id")),
            model_type=model_type,
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            sliding_window=sliding_window,
            layer_types=layer_types,
            local_rope_theta=local_rope_theta,
            **_family_fields(hf, model_type, head_dim, hidden, source),
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
