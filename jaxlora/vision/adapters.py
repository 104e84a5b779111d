"""PEFT LoRA adapters saved on a vision-language model (`get_peft_model(LlavaForConditionalGeneration
...)` or `Idefics3ForConditionalGeneration`), loaded through `jaxlora.lora.peft_io` for the
language model. The `load_vlm_*` / `save_vlm_adapter` functions take either family's config;
the `*_llava_*` names are the same functions (kept for callers of the first family).

Idefics3 names its language model `model.text_model.layers.N...`, its SigLIP tower
`model.vision_model.encoder.layers.N...` (the same q/k/v/out_proj, fc1, fc2 as CLIP's) and its
connector `model.connector.modality_projection.proj` (refused, as LLaVA's projector).

PEFT names the language model's modules `model.language_model.layers.N.self_attn.q_proj`
(transformers >= 4.52; `language_model.model.layers.N...` before); they are mapped onto a Llama's
`model.layers.N...` names (keys, a regex `target_modules`, rank/alpha patterns) and that part is
read as a Llama adapter. LoRA on the vision tower's linears (what a plain
`target_modules=["q_proj", "v_proj"]` also hits: CLIP's attention has q/k/v_proj) is read by
`load_llava_lora` into a `TowerLora` (`jaxlora.vision.tower_lora`); `load_llava_adapter` (the
language model only, what the serving engine takes today) refuses it with the module's name.
LoRA on the projector is refused by both.
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np

from jaxlora.lora.adapter import LoraAdapter
from jaxlora.lora.adapter_config import AdapterError, module_key
from jaxlora.lora.peft_io import (CONFIG_FILE, WEIGHTS_FILE, adapter_from_peft, lora_config_from_peft,
                                  read_raw_adapter_config, read_weights, save_peft_adapter)
from jaxlora.nn.model_config import PROJECTIONS
from jaxlora.vision.config import LlavaConfig, split_llava_name
from jaxlora.vision.idefics3_config import Idefics3Config, split_idefics3_name
from jaxlora.vision.tower_lora import TowerLora, parse_tower_module, tower_lora_from_peft

# A PEFT target_modules regex for LoRA on every projection of the language model only (LLaVA; Idefics3).
LANGUAGE_MODEL_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
IDEFICS3_LANGUAGE_MODEL_TARGETS = r".*text_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
_PEFT_KEY = re.compile(r"^base_model\.model\.(.*)\.lora_(A|B)(?:\.[^.]+)?\.weight$")


@dataclasses.dataclass(frozen=True)
class _Naming:
    """How a family names its parts in PEFT: `split` (module name -> part, inner name), the
    language model's prefixes of a Llama's `layers.N...` names (new and old transformers), the
    one PEFT saves, the language-only targets regex and the tower's and projector's names."""

    split: object
    prefixes: tuple[str, ...]
    saved: str
    targets: str
    tower: str
    projector: str


_LLAVA = _Naming(split_llava_name, ("model.language_model.", "language_model.model."), "model.language_model.",
                 LANGUAGE_MODEL_TARGETS, "CLIP", "multimodal projector")
_IDEFICS3 = _Naming(split_idefics3_name, ("model.text_model.", "text_model."), "model.text_model.",
                    IDEFICS3_LANGUAGE_MODEL_TARGETS, "SigLIP", "connector")


def _naming(config) -> _Naming:
    return _IDEFICS3 if isinstance(config, Idefics3Config) else _LLAVA


def language_model_targets(config) -> str:
    """The PEFT target_modules regex for LoRA on every projection of `config`'s language model."""
    return _naming(config).targets


@dataclasses.dataclass
class LlavaLora:
    """A PEFT adapter of a LLaVA model: its language model part (None if it has none) and its
    vision tower part (None if it has none)."""

    language: LoraAdapter | None
    tower: TowerLora | None


def _module_of(key: str, naming: _Naming = _LLAVA) -> tuple[str, str, str] | None:
    """A PEFT tensor key -> (part, the module's name in the VLM, the Llama module name for part
    "text"), or None if it is no LoRA A/B weight."""
    match = _PEFT_KEY.match(key)
    if not match:
        return None
    split = naming.split(match.group(1))
    if split is None:
        return None
    return split[0], match.group(1), split[1]


def _refuse(keys, path: str, parts: tuple[str, ...], naming: _Naming = _LLAVA) -> None:
    """AdapterError naming the first module of `parts` ("vision", "projector") the adapter holds."""
    for key in sorted(keys):
        found = _module_of(key, naming)
        if found is None or found[0] not in parts:
            continue
        part, module, _ = found
        if part == "projector":
            raise AdapterError(f"{path}: LoRA on the {naming.projector} (module {module}) is not supported; "
                               f"target the language model and/or the vision tower")
        raise AdapterError(
            f"{path}: LoRA on the vision tower (module {module}) is not supported here: load_vlm_adapter reads "
            f"the language model's LoRA only (jaxlora.vision.adapters.load_vlm_lora also reads the tower's). "
            f"Train with target_modules={naming.targets!r} for the language model only (a plain list "
            f"such as ['q_proj', 'v_proj'] also matches {naming.tower}'s attention)")


def _language_module_names(layer: int, module: str, naming: _Naming) -> tuple[str, ...]:
    """The names PEFT may match a language-model projection by (new and old transformers)."""
    inner = module_key(layer, module)[len("model."):]  # layers.N.self_attn.q_proj
    return tuple(prefix + inner for prefix in naming.prefixes)


def _translated_config(raw: dict, config) -> dict:
    """The adapter config with the VLM's module names mapped onto the Llama's: a target regex
    becomes the alternation of the Llama module names it matches; pattern keys lose
    `language_model.` / `text_model.`."""
    naming = _naming(config)
    targets = raw.get("target_modules")
    if isinstance(targets, list):  # the tower's own names (out_proj, fc1, ...) are its part's
        targets = [t for t in targets if str(t).split(".")[-1] in PROJECTIONS]
    elif isinstance(targets, str):
        matched = [module_key(layer, module) for layer in range(config.text.num_layers) for module in PROJECTIONS
                   if any(re.fullmatch(targets, name) for name in _language_module_names(layer, module, naming))]
        if matched:
            targets = "(?:" + "|".join(re.escape(name) for name in matched) + ")"

    def pattern(key: str) -> str:
        for name in ("language_model", "text_model"):
            key = key.replace(name + "\\.", "").replace(name + ".", "")
        return key

    patterns = {name: {pattern(k): v for k, v in (raw.get(name) or {}).items()} for name in ("rank_pattern",
                                                                                             "alpha_pattern")}
    return {**raw, "target_modules": targets, **patterns}


def _read_tensors(file: str, keep_dtype: bool) -> dict[str, np.ndarray]:
    """The file's tensors: views of the buffer it was read into in one call (`read_weights`), or
    float32 copies without `keep_dtype`."""
    tensors = read_weights(file).tensors()
    return tensors if keep_dtype else {key: t.astype(np.float32) for key, t in tensors.items()}


def _language_adapter(raw: dict, tensors: dict, config, name: str, path: str, keep_dtype: bool) -> LoraAdapter:
    renamed = {}
    for key, tensor in tensors.items():
        found = _module_of(key, _naming(config))
        llama_key = key if found is None else key.replace(f"base_model.model.{found[1]}.",
                                                          f"base_model.model.{found[2]}.", 1)
        renamed[llama_key] = tensor
    lora = lora_config_from_peft(_translated_config(raw, config), config.text, os.path.join(path, CONFIG_FILE))
    return adapter_from_peft(lora, renamed, config.text, name, path, keep_dtype)


def load_vlm_adapter(path: str, config: LlavaConfig | Idefics3Config, name: str | None = None,
                     keep_dtype: bool = False) -> LoraAdapter:
    """Reads a PEFT LoRA adapter directory saved on a VLM (LLaVA or Idefics3) as an adapter of its
    language model (`config.text`); AdapterError if unusable (LoRA on the tower or projector
    included). keep_dtype: as `jaxlora.lora.peft_io.load_peft_adapter`."""
    raw = read_raw_adapter_config(path)
    tensors = _read_tensors(os.path.join(path, WEIGHTS_FILE), keep_dtype)
    _refuse(tensors, path, ("vision", "projector"), _naming(config))
    return _language_adapter(raw, tensors, config, name or os.path.basename(os.path.normpath(path)), path,
                             keep_dtype)


def load_vlm_lora(path: str, config: LlavaConfig | Idefics3Config, name: str | None = None,
                  keep_dtype: bool = False) -> LlavaLora:
    """Reads a PEFT LoRA adapter directory saved on a VLM: the language model's part (as
    `load_vlm_adapter`) and the vision tower's (float32); AdapterError for the projector's."""
    name = name or os.path.basename(os.path.normpath(path))
    naming = _naming(config)
    raw = read_raw_adapter_config(path)
    tensors = _read_tensors(os.path.join(path, WEIGHTS_FILE), keep_dtype)
    _refuse(tensors, path, ("projector",), naming)
    text, tower = {}, {}
    for key, tensor in tensors.items():
        found = _module_of(key, naming)
        if found is None or found[0] == "text":
            text[key] = tensor
            continue
        parsed = parse_tower_module(found[2])
        if parsed is None:
            raise AdapterError(f"{path}: LoRA on the vision tower's {found[1]} is not supported "
                               f"(its q/k/v/out_proj and fc1/fc2 are)")
        tower[key] = (found[1], parsed[0], parsed[1], _PEFT_KEY.match(key).group(2), tensor)
    language = _language_adapter(raw, text, config, name, path, keep_dtype) if text else None
    return LlavaLora(language, tower_lora_from_peft(raw, tower, config, name, path) if tower else None)


def save_vlm_adapter(adapter: LoraAdapter, path: str, config: LlavaConfig | Idefics3Config,
                     base_model_name: str = "") -> None:
    """Writes an adapter of a VLM's language model (Llama module names) as PEFT saves LoRA on
    the VLM's language model: tensors `base_model.model.model.language_model.layers.N...` (LLaVA)
    or `base_model.model.model.text_model.layers.N...` (Idefics3), target_modules a regex of
    exactly those modules (a plain list would also hit the tower's q/k/v_proj).
    `load_vlm_adapter` and PEFT read it."""
    saved = _naming(config).saved
    save_peft_adapter(adapter, path, base_model_name, rename=lambda name: saved + name[len("model."):])


def load_llava_adapter(path: str, config: LlavaConfig, name: str | None = None,
                       keep_dtype: bool = False) -> LoraAdapter:
    """`load_vlm_adapter` (the first family's name)."""
    return load_vlm_adapter(path, config, name, keep_dtype)


def load_llava_lora(path: str, config: LlavaConfig, name: str | None = None, keep_dtype: bool = False) -> LlavaLora:
    """`load_vlm_lora` (the first family's name)."""
    return load_vlm_lora(path, config, name, keep_dtype)


def save_llava_adapter(adapter: LoraAdapter, path: str, base_model_name: str = "") -> None:
    """`save_vlm_adapter` for a LLaVA: PEFT's names on `LlavaForConditionalGeneration`."""
    save_peft_adapter(adapter, path, base_model_name, rename=lambda name: _LLAVA.saved + name[len("model."):])
