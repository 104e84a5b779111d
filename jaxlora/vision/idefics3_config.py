"""Idefics3's configuration (`Idefics3ForConditionalGeneration`: SmolVLM and Idefics3-8B) from a
HF `config.json`: the SigLIP-style vision tower's shapes (no CLS, no pre-LayerNorm, a patch bias,
a post-LayerNorm; `ClipVisionConfig` holds the shapes, which are the same fields), the connector's
pixel-shuffle `scale_factor` and the language model's `LlamaConfig` (`text_config`)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar, Mapping

from jaxlora.nn.model_config import ConfigError, LlamaConfig, config_from_hf
from jaxlora.vision.config import ClipVisionConfig

# transformers' Idefics3VisionConfig defaults (SigLIP so400m-like), for keys a config.json omits.
_VISION_DEFAULTS = dict(hidden_size=1152, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16,
                        image_size=224, patch_size=32, num_channels=3, layer_norm_eps=1e-6,
                        hidden_act="gelu_pytorch_tanh")
# Idefics3Config's text_config when absent: LlamaConfig(rms_norm_eps=1e-5) with Llama's defaults.
_TEXT_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-5,
                      hidden_act="silu", bos_token_id=1, eos_token_id=2)
_REFUSED = {
    "smolvlm": "SmolVLM2's 'smolvlm' (video frames, its own processor) is not supported; SmolVLM v1 checkpoints "
               "(HuggingFaceTB/SmolVLM-*-Instruct) are model_type 'idefics3' and are",
    "idefics2": "Idefics2's perceiver resampler connector is not supported (Idefics3's pixel shuffle is)",
    "idefics": "Idefics (v1) is not supported",
}

# Where an Idefics3 checkpoint's (or PEFT adapter's) names put the language model, tower and connector.
_TEXT = re.compile(r"^(?:model\.)?text_model\.(.*)$")
_HEAD = re.compile(r"^lm_head\.(.*)$")
_VISION = re.compile(r"^(?:model\.)?vision_model\.(.*)$")
_CONNECTOR = re.compile(r"^(?:model\.)?connector\.(.*)$")


@dataclasses.dataclass(frozen=True)
class Idefics3Config:
    """Idefics3: every image tile (`image_size` square pixels) -> the vision tower's last hidden
    state after its post-LayerNorm [P, D] -> pixel shuffle (each `scale_factor` x `scale_factor`
    block of patches concatenated along features: [P / s^2, D * s^2]) -> one linear without bias
    (the connector's `modality_projection.proj`) -> `tokens_per_image` text embeddings a tile."""

    family: ClassVar[str] = "idefics3"
    vision: ClipVisionConfig
    text: LlamaConfig
    image_token_id: int
    scale_factor: int = 2

    def __post_init__(self):
        side = self.vision.image_size // self.vision.patch_size
        if self.scale_factor < 1 or side % self.scale_factor:
            raise ConfigError(f"scale_factor {self.scale_factor} does not divide the tower's {side} patches a side")

    @property
    def tokens_per_image(self) -> int:
        """Image tokens (text positions) one tile fills: (patches / scale_factor^2)."""
        return self.vision.num_patches // self.scale_factor**2

    @property
    def connector_in(self) -> int:
        return self.vision.hidden_size * self.scale_factor**2


def idefics3_config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> Idefics3Config:
    """An `Idefics3Config` from the dict of a HF `config.json` of model_type "idefics3";
    ConfigError names what is not supported (SmolVLM2, Idefics2, non-Llama language models)."""
    model_type = hf.get("model_type")
    if model_type in _REFUSED:
        raise ConfigError(f"{source}: model_type {model_type!r}: {_REFUSED[model_type]}")
    if model_type != "idefics3":
        raise ConfigError(f"{source}: model_type {model_type!r} is not Idefics3 ('idefics3')")
    raw_vision = dict(hf.get("vision_config") or {})
    kind = raw_vision.get("model_type", "idefics3_vision")
    if kind not in ("idefics3_vision", "idefics3"):
        raise ConfigError(f"{source}: vision_config model_type {kind!r} is not Idefics3's tower ('idefics3_vision')")
    vision_values = {**_VISION_DEFAULTS, **{k: v for k, v in raw_vision.items() if v is not None}}
    text_raw = dict(hf.get("text_config") or {"model_type": "llama"})
    if text_raw.get("model_type", "llama") != "llama":
        raise ConfigError(f"{source}: text_config model_type {text_raw.get('model_type')!r} is not supported "
                          f"(Idefics3 / SmolVLM's language model is a Llama: 'llama')")
    text_raw = {**_TEXT_DEFAULTS, "model_type": "llama", **text_raw}
    if hf.get("tie_word_embeddings"):
        text_raw["tie_word_embeddings"] = True
    text_raw.setdefault("tie_word_embeddings", False)
    text = config_from_hf(text_raw, source=f"{source} (text_config)")
    try:
        vision = ClipVisionConfig(
            hidden_size=int(vision_values["hidden_size"]),
            intermediate_size=int(vision_values["intermediate_size"]),
            num_layers=int(vision_values["num_hidden_layers"]),
            num_heads=int(vision_values["num_attention_heads"]),
            image_size=_square(vision_values["image_size"], "image_size"),
            patch_size=_square(vision_values["patch_size"], "patch_size"),
            num_channels=int(vision_values["num_channels"]),
            layer_norm_eps=float(vision_values["layer_norm_eps"]),
            hidden_act=str(vision_values["hidden_act"]),
        )
        return Idefics3Config(vision=vision, text=text, image_token_id=int(hf.get("image_token_id", 128257)),
                              scale_factor=int(hf.get("scale_factor", 2)))
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def _square(value: Any, what: str) -> int:
    """An int, or a [h, w] pair with h == w (the tower is square); ConfigError otherwise."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ConfigError(f"vision {what} {list(value)} is not square")
        value = value[0]
    return int(value)


def split_idefics3_name(name: str) -> tuple[str, str] | None:
    """An Idefics3 checkpoint tensor (or PEFT module) name -> ("text", its Llama checkpoint name)
    | ("vision", name inside the vision model) | ("projector", name inside the connector); None
    if none of them. Both `model.text_model.` (transformers) and `text_model.` are read."""
    match = _TEXT.match(name)
    if match:
        return "text", f"model.{match.group(1)}"
    match = _HEAD.match(name)
    if match:
        return "text", f"lm_head.{match.group(1)}"
    for part, pattern in (("vision", _VISION), ("projector", _CONNECTOR)):
        match = pattern.match(name)
        if match:
            return part, match.group(1)
    return None
