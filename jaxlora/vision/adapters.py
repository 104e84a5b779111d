"""PEFT LoRA adapters saved on a LLaVA model (`get_peft_model(LlavaForConditionalGeneration...)`),
loaded through `jaxlora.lora.peft_io` for the language model.

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
from jaxlora.vision.tower_lora import TowerLora, parse_tower_module, tower_lora_from_peft

# A PEFT target_modules regex for LoRA on every projection of the language model only.
LANGUAGE_MODEL_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
_PEFT_KEY = re.compile(r"^base_model\.model\.(.*)\.lora_(A|B)(?:\.[^.]+)?\.weight$")


@dataclasses.dataclass
class LlavaLora:
    """A PEFT adapter of a LLaVA model: its language model part (None if it has none) and its
    vision tower part (None if it has none)."""

    language: LoraAdapter | None
    tower: TowerLora | None


def _module_of(key: str) -> tuple[str, str, str] | None:
    """A PEFT tensor key -> (part, the module's name in the LLaVA model, the Llama module name
    for part "text"), or None if it is no LoRA A/B weight."""
    match = _PEFT_KEY.match(key)
    if not match:
        return None
    split = split_llava_name(match.group(1))
    if split is None:
        return None
    return split[0], match.group(1), split[1]


def _refuse(keys, path: str, parts: tuple[str, ...]) -> None:
    """AdapterError naming the first module of `parts` ("vision", "projector") the adapter holds."""
    for key in sorted(keys):
        found = _module_of(key)
        if found is None or found[0] not in parts:
            continue
        part, module, _ = found
        if part == "projector":
            raise AdapterError(f"{path}: LoRA on the multimodal projector (module {module}) is not supported; "
                               f"target the language model and/or the vision tower")
        raise AdapterError(
            f"{path}: LoRA on the vision tower (module {module}) is not supported here: load_llava_adapter reads "
            f"the language model's LoRA only (jaxlora.vision.adapters.load_llava_lora also reads the tower's). "
            f"Train with target_modules={LANGUAGE_MODEL_TARGETS!r} for the language model only (a plain list "
            f"such as ['q_proj', 'v_proj'] also matches CLIP's attention)")


def _llava_module_names(layer: int, module: str) -> tuple[str, ...]:
    """The names PEFT may match a language-model projection by (new and old transformers)."""
    ours = module_key(layer, module)  # model.layers.N.self_attn.q_proj
    inner = ours[len("model."):]
    return f"model.language_model.{inner}", f"language_model.model.{inner}"


def _translated_config(raw: dict, config: LlavaConfig) -> dict:
    """The adapter config with LLaVA module names mapped onto the Llama's: a target regex becomes
    the alternation of the Llama module names it matches; pattern keys lose `language_model.`."""
    targets = raw.get("target_modules")
    if isinstance(targets, list):  # the tower's own names (out_proj, fc1, ...) are its part's
        targets = [t for t in targets if str(t).split(".")[-1] in PROJECTIONS]
    elif isinstance(targets, str):
        matched = [module_key(layer, module) for layer in range(config.text.num_layers) for module in PROJECTIONS
                   if any(re.fullmatch(targets, name) for name in _llava_module_names(layer, module))]
        if matched:
            targets = "(?:" + "|".join(re.escape(name) for name in matched) + ")"

    def pattern(key: str) -> str:
        return key.replace("language_model\\.", "").replace("language_model.", "")

    patterns = {name: {pattern(k): v for k, v in (raw.get(name) or {}).items()} for name in ("rank_pattern",
                                                                                             "alpha_pattern")}
    return {**raw, "target_modules": targets, **patterns}


def _read_tensors(file: str, keep_dtype: bool) -> dict[str, np.ndarray]:
    """The file's tensors: views of the buffer it was read into in one call (`read_weights`), or
    float32 copies without `keep_dtype`."""
    tensors = read_weights(file).tensors()
    return tensors if keep_dtype else {key: t.astype(np.float32) for key, t in tensors.items()}


def _language_adapter(raw: dict, tensors: dict, config: LlavaConfig, name: str, path: str,
                      keep_dtype: bool) -> LoraAdapter:
    renamed = {}
    for key, tensor in tensors.items():
        found = _module_of(key)
        llama_key = key if found is None else key.replace(f"base_model.model.{found[1]}.",
                                                          f"base_model.model.{found[2]}.", 1)
        renamed[llama_key] = tensor
    lora = lora_config_from_peft(_translated_config(raw, config), config.text, os.path.join(path, CONFIG_FILE))
    return adapter_from_peft(lora, renamed, config.text, name, path, keep_dtype)


def load_llava_adapter(path: str, config: LlavaConfig, name: str | None = None,
                       keep_dtype: bool = False) -> LoraAdapter:
    """Reads a PEFT LoRA adapter directory saved on a LLaVA model as an adapter of its language
    model (`config.text`); AdapterError if unusable (LoRA on the tower or projector included).
    keep_dtype: as `jaxlora.lora.peft_io.load_peft_adapter`."""
    raw = read_raw_adapter_config(path)
    tensors = _read_tensors(os.path.join(path, WEIGHTS_FILE), keep_dtype)
    _refuse(tensors, path, ("vision", "projector"))
    return _language_adapter(raw, tensors, config, name or os.path.basename(os.path.normpath(path)), path,
                             keep_dtype)


def load_llava_lora(path: str, config: LlavaConfig, name: str | None = None, keep_dtype: bool = False) -> LlavaLora:
    """Reads a PEFT LoRA adapter directory saved on a LLaVA model: the language model's part (as
    `load_llava_adapter`) and the vision tower's (float32); AdapterError for the projector's."""
    name = name or os.path.basename(os.path.normpath(path))
    raw = read_raw_adapter_config(path)
    tensors = _read_tensors(os.path.join(path, WEIGHTS_FILE), keep_dtype)
    _refuse(tensors, path, ("projector",))
    text, tower = {}, {}
    for key, tensor in tensors.items():
        found = _module_of(key)
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


def save_llava_adapter(adapter: LoraAdapter, path: str, base_model_name: str = "") -> None:
    """Writes an adapter of a LLaVA's language model (Llama module names) as PEFT saves LoRA on
    `LlavaForConditionalGeneration`'s language model: tensors `base_model.model.model.
    language_model.layers.N...`, target_modules a regex of exactly those modules (a plain list
    would also hit CLIP's q/k/v_proj). `load_llava_adapter` and PEFT read it."""
    save_peft_adapter(adapter, path, base_model_name,
                      rename=lambda name: "model.language_model." + name[len("model."):])
