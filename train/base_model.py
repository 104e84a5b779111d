"""The job file's `base_model`: "default" (the embedded SmolLM2-135M), a HF directory or a .gguf
file, or `preset:NAME` for a named shape with random weights (`jaxlora.models.presets`; to
measure speed and memory at a model's size without its weights), or a vision-language model's
HF directory (LLaVA-1.5, Idefics3 / SmolVLM: its language model is trained, its tower and projector stay frozen,
`train.images.VisionInputs`). The datasets are read with `tokenizer` when given, else the
model's own (for a preset: the embedded model's)."""

from __future__ import annotations

import dataclasses

from jaxlora.models import presets
from jaxlora.nn.model_config import LlamaConfig
from train.config import ConfigError

PRESETS = {"llama-3.1-8b": presets.LLAMA_3_1_8B, "tiny": dataclasses.replace(presets.TINY, num_layers=4)}
PREFIX = "preset:"


def preset_config(base_model: str) -> LlamaConfig | None:
    """The preset's config, None when `base_model` names no preset; ConfigError for a bad name."""
    if not str(base_model).startswith(PREFIX):
        return None
    name = base_model[len(PREFIX):]
    if name not in PRESETS:
        raise ConfigError(f"base_model={base_model!r}: unknown preset (known: "
                          f"{', '.join(PREFIX + p for p in PRESETS)})")
    return PRESETS[name]


def base_model_config(base_model: str) -> LlamaConfig:
    """The model's shape, read without loading its weights."""
    from jaxlora.vision.loading import is_vlm_dir, read_vlm_config
    from jaxlora.weights import load_config

    config = preset_config(base_model)
    if config is None and is_vlm_dir(str(base_model)):
        return read_vlm_config(base_model).text
    return config or load_config(base_model)


def load_base_model(base_model: str, dtype, seed: int = 0, tokenizer_path: str | None = None):
    """(model, tokenizer) of a text `base_model` (task heads, knowledge fusion), the tokenizer
    from `tokenizer_path` when given; ConfigError for a vision-language model."""
    model, tokenizer, vision = load_training_model(base_model, dtype, seed, tokenizer_path)
    if vision is not None:
        raise ConfigError(f"base_model {base_model!r} is a vision-language model: task heads and knowledge fusion "
                          "train on text models only (plain LoRA jobs train on it)")
    return model, tokenizer


def load_training_model(base_model: str, dtype, seed: int = 0, tokenizer_path: str | None = None):
    """(model, tokenizer, vision) of `base_model`: for a vision-language model directory its
    language model (a `Llama`), its tokenizer and its frozen tower (`train.images.VisionInputs`);
    else vision is None and the tokenizer comes from `tokenizer_path` when given."""
    from flax import nnx

    from jaxlora.vision.llava import TowerEncoder
    from jaxlora.vision.loading import is_vlm_dir, load_vlm
    from train.images import VisionInputs

    if preset_config(base_model) is None and is_vlm_dir(str(base_model)):
        if tokenizer_path is not None:
            raise ConfigError(f"tokenizer: a vision-language model ({base_model!r}) reads its datasets with its own "
                              "tokenizer (its image token); leave 'tokenizer' out")
        vlm, tokenizer, processor = load_vlm(base_model, dtype)
        return vlm.language, tokenizer, VisionInputs(vlm.config, processor, TowerEncoder(vlm.vision, dtype))

    from jaxlora.models.llama import Llama
    from jaxlora.weights import load_llama, load_model, load_tokenizer

    config = preset_config(base_model)
    if config is None and tokenizer_path is None:
        return (*load_model(base_model, dtype=dtype), None)
    tokenizer = load_tokenizer(tokenizer_path or "default")
    if config is None:
        model = load_llama(base_model, dtype=dtype)
    else:
        model = Llama(config, rngs=nnx.Rngs(seed), dtype=dtype)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ConfigError(f"tokenizer: its vocabulary ({tokenizer.vocab_size}) is larger than base_model "
                          f"{base_model!r}'s ({model.config.vocab_size})")
    return model, tokenizer, None
