"""Loads a vision-language model from a HF directory written by `transformers`: `load_vlm`
dispatches on config.json's model_type ("llava": here; "idefics3": `jaxlora.vision.
idefics3_loading`). LLaVA-1.5 (`LlavaForConditionalGeneration`, safetensors): the language model through `jaxlora.weights`' Llama loader (its tensors renamed to
a Llama checkpoint's), the CLIP tower and projector here; plus the tokenizer and the image
processor's settings.

Three tensor layouts are read: transformers >= 4.52 in memory (`model.language_model.layers.0...`,
`model.vision_tower...`, `model.multi_modal_projector...`, `lm_head.weight`), what it writes
(`language_model.model.layers.0...`, `language_model.lm_head.weight`, `vision_tower...`,
`multi_modal_projector...`) and the llava-hf hub files (the same with `vision_tower.vision_model.`).
The tower's layers after the deepest feature layer are not read (LLaVA-1.5 skips the last)."""

from __future__ import annotations

import os
import re

import jax.numpy as jnp

from jaxlora.jsonfile import read_json_file
from jaxlora.models.llama import Llama
from jaxlora.nn.model_config import ConfigError
from jaxlora.tokenizer import Tokenizer
from jaxlora.vision.clip import LAYER_LINEARS, LAYER_NORMS, VisionTower, weight_shapes
from jaxlora.vision.config import LlavaConfig, llava_config_from_hf, split_llava_name
from jaxlora.vision.idefics3_config import Idefics3Config, idefics3_config_from_hf
from jaxlora.vision.idefics3_loading import load_idefics3, open_checkpoint
from jaxlora.vision.idefics3_preprocess import read_idefics3_image_config
from jaxlora.vision.llava import Llava
from jaxlora.vision.preprocess import ImageError, ImageProcessorConfig, read_image_processor
from jaxlora.vision.prompts import IMAGE_TOKEN, Idefics3Processing, idefics3_processing
from jaxlora.vision.tower_weights import stack_tower_weights
from jaxlora.weights import WeightsError, load_tokenizer
from jaxlora.weights.hf import read_hf_config
from jaxlora.weights.layout import stack_weights

__all__ = ["FAMILIES", "IMAGE_TOKEN", "is_vlm_dir", "load_llava", "load_vlm", "read_llava_config",
           "read_vlm_config"]
FAMILIES = ("llava", "idefics3")  # config.json model_types load_vlm reads

_VISION_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.(?:self_attn\.|mlp\.)?([a-z_0-9]+)\.(weight|bias)$")


def read_llava_config(path: str) -> LlavaConfig:
    """The `LlavaConfig` of a HF directory's `config.json`; WeightsError if it is not one."""
    return read_hf_config(path, parse=llava_config_from_hf)


def vlm_config_from_hf(hf, source: str = "config.json") -> LlavaConfig | Idefics3Config:
    """The family's config of a VLM `config.json` dict, by its model_type; ConfigError naming
    the model_type for the others (Gemma 3, Qwen2-VL, LLaVA-NeXT, SmolVLM2, ...)."""
    model_type = hf.get("model_type")
    if model_type in ("idefics3", "smolvlm", "idefics2", "idefics"):
        return idefics3_config_from_hf(hf, source)
    if model_type in ("llava", "llava_next", "llava_onevision", "llava_next_video"):
        return llava_config_from_hf(hf, source)
    raise ConfigError(f"{source}: model_type {model_type!r} is not a vision-language model jaxlora runs "
                      f"(supported: {', '.join(repr(f) for f in FAMILIES)})")


def read_vlm_config(path: str) -> LlavaConfig | Idefics3Config:
    """The family's config of a HF VLM directory's `config.json`; WeightsError if it is none."""
    return read_hf_config(path, parse=vlm_config_from_hf)


def is_vlm_dir(path: str) -> bool:
    """Whether `path` is a HF directory of a vision-language model (config.json has a vision_config)."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        return False
    try:
        raw = read_json_file(config_file, WeightsError, "")
    except WeightsError:  # the model loader reports a broken config.json
        return False
    return isinstance(raw, dict) and "vision_config" in raw


def _vision_model_name(inner: str, config: LlavaConfig) -> tuple[str, int | None, str] | None:
    """A tensor name inside the CLIP vision model -> (weight name, layer or None, how to lay it
    out: "as_is" | "transpose" | "patch"), or None for tensors the tower does not use."""
    fixed = {"embeddings.class_embedding": ("class_embedding", None, "as_is"),
             "embeddings.position_embedding.weight": ("position_embedding", None, "as_is"),
             "embeddings.patch_embedding.weight": ("patch_embedding", None, "patch"),
             "pre_layrnorm.weight": ("pre_layrnorm.weight", None, "as_is"),
             "pre_layrnorm.bias": ("pre_layrnorm.bias", None, "as_is")}
    if inner in fixed:
        return fixed[inner]
    match = _VISION_LAYER.match(inner)
    if not match:
        return None  # post_layernorm, position_ids buffers: not used by LLaVA
    layer, module, kind = int(match.group(1)), match.group(2), match.group(3)
    if layer >= config.vision.num_layers or module not in LAYER_LINEARS + LAYER_NORMS:
        return None
    if module in LAYER_NORMS:
        return f"layers.{module}.{kind}", layer, "as_is"
    return (f"layers.{module}.kernel", layer, "transpose") if kind == "weight" else (f"layers.{module}.bias", layer,
                                                                                       "as_is")


def _tower_weights(config: LlavaConfig, tensors: dict[str, tuple[str, str]], read, dtype, path: str) -> dict:
    """The tower's and projector's weights ({flat name: array}, `jaxlora.vision.clip`) from
    tensors {checkpoint name: (part, inner name)}."""
    mapped = []
    for name, (part, inner) in tensors.items():
        if part == "projector":
            match = re.fullmatch(r"(linear_[12])\.(weight|bias)", inner)
            if not match:
                raise WeightsError(f"{path}: unexpected projector tensor {name}")
            target = (f"projector.{match.group(1)}.{'kernel' if match.group(2) == 'weight' else 'bias'}", None,
                      "transpose" if match.group(2) == "weight" else "as_is")
        else:
            target = _vision_model_name(inner, config)
        if target is not None:
            mapped.append((name, target))
    return stack_tower_weights(path, mapped, read, weight_shapes(config), config.vision.num_layers, dtype,
                               "LLaVA config (e.g. a projector bias with multimodal_projector_bias=false)",
                               "vision/projector")


def load_llava(path: str, dtype=jnp.float32) -> Llava:
    """Loads a LLaVA-1.5 HF directory (config.json + safetensors) as a `Llava` in `dtype`."""
    config = read_llava_config(path)
    owner, read = open_checkpoint(path)
    text_names: dict[str, str] = {}  # Llama checkpoint name -> LLaVA checkpoint name
    tower: dict[str, tuple[str, str]] = {}
    for name in sorted(owner):
        split = split_llava_name(name)
        if split is None:
            raise WeightsError(f"{owner[name]}: tensor {name} is not part of a LLaVA model (language_model, "
                               f"vision_tower or multi_modal_projector)")
        part, inner = split
        if part == "text":
            text_names[inner] = name
        else:
            tower[name] = split
    text_weights = stack_weights(config.text, sorted(text_names), lambda n: read(text_names[n]), dtype, source=path,
                                 file_of=lambda n: owner[text_names.get(n, n)])
    vision = VisionTower(config, weights=_tower_weights(config, tower, read, dtype, path), dtype=dtype)
    return Llava(config, vision=vision, language=Llama(config.text, weights=text_weights, dtype=dtype), dtype=dtype)


def load_vlm(path: str, dtype=jnp.float32) -> tuple[Llava, Tokenizer, ImageProcessorConfig | Idefics3Processing]:
    """A VLM HF directory's model (`Llava`, or `Idefics3` for model_type "idefics3"), tokenizer
    (`tokenizer.json`; its `<image>` token is the config's image token) and processor: LLaVA's
    image settings (`preprocessor_config.json`), or Idefics3's settings and prompt layout."""
    config = read_vlm_config(path)
    model = load_idefics3(path, dtype) if isinstance(config, Idefics3Config) else load_llava(path, dtype)
    tokenizer = load_tokenizer(path)
    tokenizer.image_placeholder = IMAGE_TOKEN  # a chat template reading typed parts gets them
    image_token = tokenizer.token_text(model.config.image_token_id)
    if image_token != IMAGE_TOKEN:
        raise WeightsError(f"{path}: the config's image token id {model.config.image_token_id} is "
                           f"{image_token!r} in tokenizer.json, not {IMAGE_TOKEN!r}")
    try:
        if isinstance(config, Idefics3Config):
            processor = _idefics3_processing(path, config, tokenizer)
        else:
            processor = read_image_processor(path)
    except (ImageError, ValueError) as err:
        raise WeightsError(f"{path}: {err}") from err
    size = processor.output_size()
    vision = model.config.vision
    if size is not None and size != (vision.image_size, vision.image_size):
        raise WeightsError(f"{path}: the image processor makes {size[0]}x{size[1]} images, but the vision tower "
                           f"takes {vision.image_size}x{vision.image_size}")
    return model, tokenizer, processor


def _idefics3_processing(path: str, config: Idefics3Config, tokenizer: Tokenizer) -> Idefics3Processing:
    """Idefics3's image settings and prompt layout; ValueError if the processor's image_seq_len
    (`processor_config.json`) is not the model's tokens a tile."""
    file = os.path.join(path, "processor_config.json")
    raw = read_json_file(file, WeightsError, "") if os.path.isfile(file) else {}
    seq_len = raw.get("image_seq_len") if isinstance(raw, dict) else None
    if seq_len is not None and int(seq_len) != config.tokens_per_image:
        raise ValueError(f"processor_config.json's image_seq_len {seq_len} is not the model's "
                         f"{config.tokens_per_image} image tokens a tile")
    encode = lambda text: tokenizer.encode(text, add_bos=False)
    return idefics3_processing(read_idefics3_image_config(path), encode, config.image_token_id,
                               config.tokens_per_image)
