"""LLaVA-1.5's configuration from a HF `config.json` (`LlavaForConditionalGeneration`): the CLIP
vision tower's shapes, the projector, which vision layer feeds it, and the language model's
`LlamaConfig` (built by `jaxlora.nn.model_config.config_from_hf` from `text_config`)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

from jaxlora.nn.model_config import ConfigError, LlamaConfig, config_from_hf

VISION_ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "gelu_new")
FEATURE_STRATEGIES = ("default", "full")  # "default": the CLS position dropped; "full": kept

# transformers' class defaults, for keys a `config.json` leaves out (HF writes only what differs
# from them in older files: llava-hf/llava-1.5-7b-hf's text_config names 5 keys).
_CLIP_VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                             image_size=224, patch_size=32, num_channels=3, layer_norm_eps=1e-5,
                             hidden_act="quick_gelu")
# LlavaConfig's vision tower when `vision_config` is absent: CLIP ViT-L/14 at 336 pixels.
_LLAVA_VISION_DEFAULTS = dict(_CLIP_VISION_DEFAULTS, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                              num_attention_heads=16, image_size=336, patch_size=14)
_LLAMA_TEXT_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                            num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6,
                            hidden_act="silu", bos_token_id=1, eos_token_id=2)

# Where a LLaVA checkpoint's (or PEFT adapter's) names put the language model, tower and projector.
_TEXT = re.compile(r"^(?:language_model\.(model\.|lm_head\.)|model\.language_model\.|(lm_head\.))(.*)$")
_VISION = re.compile(r"^(?:model\.)?vision_tower\.(?:vision_model\.)?(.*)$")
_PROJECTOR = re.compile(r"^(?:model\.)?multi_modal_projector\.(.*)$")


@dataclasses.dataclass(frozen=True)
class ClipVisionConfig:
    """A CLIP ViT: patches of `patch_size` pixels of an `image_size` square image, a CLS token,
    learned positions, pre-norm encoder layers (LayerNorm with bias, MHA with biases, fc1 -> act ->
    fc2). `num_layers` counts the layers the model runs (those up to the deepest feature layer)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    def __post_init__(self):
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise ConfigError(f"unsupported vision hidden_act {self.hidden_act!r} "
                              f"(supported: {', '.join(VISION_ACTIVATIONS)})")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"vision hidden_size {self.hidden_size} is not a multiple of {self.num_heads} heads")
        if self.image_size % self.patch_size:
            raise ConfigError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def patch_features(self) -> int:
        """Pixels of one patch, channels first: num_channels * patch_size ** 2."""
        return self.num_channels * self.patch_size**2


@dataclasses.dataclass(frozen=True)
class LlavaConfig:
    """LLaVA-1.5: vision tower -> the hidden states of `feature_layers` (indices into the tower's
    hidden states: 0 the embeddings, i the output of layer i; concatenated along features) ->
    projector (linear_1 -> act -> linear_2) -> one text embedding per image token."""

    vision: ClipVisionConfig
    text: LlamaConfig
    image_token_id: int
    feature_layers: tuple[int, ...]
    feature_strategy: str = "default"
    projector_act: str = "gelu"
    projector_bias: bool = True

    def __post_init__(self):
        if self.feature_strategy not in FEATURE_STRATEGIES:
            raise ConfigError(f"unsupported vision_feature_select_strategy {self.feature_strategy!r} "
                              f"(supported: {', '.join(FEATURE_STRATEGIES)})")
        if self.projector_act not in VISION_ACTIVATIONS:
            raise ConfigError(f"unsupported projector_hidden_act {self.projector_act!r}")
        if not all(0 <= layer <= self.vision.num_layers for layer in self.feature_layers):
            raise ConfigError(f"feature layers {self.feature_layers} outside the tower's 0..{self.vision.num_layers}")

    @property
    def tokens_per_image(self) -> int:
        """Image tokens (text positions) one image fills: its patches, plus CLS for "full"."""
        return self.vision.num_patches + (self.feature_strategy == "full")

    @property
    def projector_in(self) -> int:
        return self.vision.hidden_size * len(self.feature_layers)


def _clip_vision(raw: Mapping[str, Any] | None, source: str) -> tuple[dict, int]:
    """(the vision config's values with defaults filled, its num_hidden_layers)."""
    if raw is None:
        values = dict(_LLAVA_VISION_DEFAULTS)
    else:
        kind = raw.get("model_type", "clip_vision_model")
        if kind != "clip_vision_model":
            raise ConfigError(f"{source}: vision_config model_type {kind!r} is not supported "
                              f"(LLaVA-1.5's CLIP tower, 'clip_vision_model', is)")
        values = {**_CLIP_VISION_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    return values, int(values["num_hidden_layers"])


def _feature_layers(value: Any, total_layers: int, source: str) -> tuple[int, ...]:
    """HF's `vision_feature_layer` (an int or a list; negative counts from the end of the
    total_layers + 1 hidden states) as non-negative indices."""
    layers = [value] if isinstance(value, int) else list(value)
    if not layers:
        raise ConfigError(f"{source}: vision_feature_layer is empty")
    states = total_layers + 1
    out = []
    for layer in layers:
        if not -states <= int(layer) < states:
            raise ConfigError(f"{source}: vision_feature_layer {layer} outside the tower's {states} hidden states")
        out.append(int(layer) % states)
    return tuple(out)


def llava_config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> LlavaConfig:
    """A `LlavaConfig` from the dict of a HF `config.json` of model_type "llava"; ConfigError
    names what is not supported (LLaVA-NeXT's tiling, other towers, non-Llama language models)."""
    model_type = hf.get("model_type")
    if model_type in ("llava_next", "llava_onevision", "llava_next_video"):
        raise ConfigError(f"{source}: model_type {model_type!r} (LLaVA-NeXT's any-resolution tiling) is not "
                          f"supported; jaxlora runs LLaVA-1.5 (model_type 'llava')")
    if model_type != "llava":
        raise ConfigError(f"{source}: model_type {model_type!r} is not a vision-language model jaxlora runs "
                          f"(supported: 'llava')")
    vision_values, total_layers = _clip_vision(hf.get("vision_config"), source)
    feature_layers = _feature_layers(hf.get("vision_feature_layer", -2), total_layers, source)
    text_raw = dict(hf.get("text_config") or {"model_type": "llama"})
    if text_raw.get("model_type", "llama") == "llama":
        text_raw = {**_LLAMA_TEXT_DEFAULTS, "model_type": "llama", **text_raw}
    if hf.get("tie_word_embeddings"):
        text_raw["tie_word_embeddings"] = True
    text_raw.setdefault("tie_word_embeddings", False)
    text = config_from_hf(text_raw, source=f"{source} (text_config)")
    try:
        vision = ClipVisionConfig(
            hidden_size=int(vision_values["hidden_size"]),
            intermediate_size=int(vision_values["intermediate_size"]),
            num_layers=max(feature_layers),  # the layers after the deepest feature layer never run
            num_heads=int(vision_values["num_attention_heads"]),
            image_size=int(vision_values["image_size"]),
            patch_size=int(vision_values["patch_size"]),
            num_channels=int(vision_values["num_channels"]),
            layer_norm_eps=float(vision_values["layer_norm_eps"]),
            hidden_act=str(vision_values["hidden_act"]),
        )
        image_token = hf.get("image_token_index", hf.get("image_token_id", 32000))
        return LlavaConfig(
            vision=vision, text=text, image_token_id=int(image_token), feature_layers=feature_layers,
            feature_strategy=str(hf.get("vision_feature_select_strategy", "default")),
            projector_act=str(hf.get("projector_hidden_act", "gelu")),
            projector_bias=bool(hf.get("multimodal_projector_bias", True)),
        )
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def split_llava_name(name: str) -> tuple[str, str] | None:
    """A LLaVA checkpoint tensor -> ("text", its Llama checkpoint name) | ("vision", name inside
    the CLIP vision model) | ("projector", name inside the projector); None if none of them."""
    match = _TEXT.match(name)
    if match:
        head, lm_head, rest = match.groups()
        if head == "lm_head." or lm_head:
            return "text", f"lm_head.{rest}"
        return "text", f"model.{rest}"
    for part, pattern in (("vision", _VISION), ("projector", _PROJECTOR)):
        match = pattern.match(name)
        if match:
            return part, match.group(1)
    return None
