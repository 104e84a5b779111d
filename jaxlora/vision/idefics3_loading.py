"""Loads Idefics3 / SmolVLM from a HF directory written by `transformers`
(`Idefics3ForConditionalGeneration`, safetensors): the language model through `jaxlora.weights`'
Llama loader (`model.text_model.*` renamed to a Llama checkpoint's `model.*`; `lm_head.weight`,
or tied embeddings), the SigLIP tower and connector here (`model.vision_model.*`,
`model.connector.modality_projection.proj.weight`; the same without `model.` is read too)."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jaxlora.models.llama import Llama
from jaxlora.vision.clip import LAYER_LINEARS, LAYER_NORMS
from jaxlora.vision.idefics3 import Idefics3
from jaxlora.vision.idefics3_config import Idefics3Config, idefics3_config_from_hf, split_idefics3_name
from jaxlora.vision.siglip import Idefics3Tower, weight_shapes
from jaxlora.vision.tower_weights import stack_tower_weights
from jaxlora.weights import WeightsError
from jaxlora.weights.hf import read_hf_config, safetensors_files
from jaxlora.weights.layout import stack_weights

__all__ = ["load_idefics3", "open_checkpoint", "read_idefics3_config"]

_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.(?:self_attn\.|mlp\.)?([a-z_0-9]+)\.(weight|bias)$")
_FIXED = {"embeddings.patch_embedding.weight": ("patch_embedding", "patch"),
          "embeddings.patch_embedding.bias": ("patch_bias", "as_is"),
          "embeddings.position_embedding.weight": ("position_embedding", "as_is"),
          "post_layernorm.weight": ("post_layernorm.weight", "as_is"),
          "post_layernorm.bias": ("post_layernorm.bias", "as_is")}


def read_idefics3_config(path: str) -> Idefics3Config:
    """The `Idefics3Config` of a HF directory's `config.json`; WeightsError if it is not one."""
    return read_hf_config(path, parse=idefics3_config_from_hf)


def open_checkpoint(path: str):
    """(owner: tensor name -> its safetensors file, read: name -> numpy array) of a HF directory's
    weights; WeightsError naming the file for one that cannot be read."""
    handles = {}
    for file in safetensors_files(path):
        try:
            handles[file] = safe_open(file, framework="numpy")
        except Exception as err:  # safetensors raises its own error types
            raise WeightsError(f"{file}: cannot read safetensors (truncated or corrupt?): {err}") from err
    owner = {name: file for file, handle in handles.items() for name in handle.keys()}

    def read(name: str) -> np.ndarray:
        try:
            return handles[owner[name]].get_tensor(name)
        except Exception as err:
            raise WeightsError(f"{owner[name]}: cannot read tensor {name}: {err}") from err

    return owner, read


def _mapped(part: str, inner: str) -> tuple[str, int | None, str] | None:
    """A tower/connector tensor (inside the vision model or connector) -> (weight name, layer or
    None, "as_is" | "transpose" | "patch"); None for a tensor the tower does not use."""
    if part == "projector":  # anything but the projection is no weight of the tower: refused by the caller
        return ("connector.kernel", None, "transpose") if inner == "modality_projection.proj.weight" else (
            f"connector.{inner}", None, "as_is")
    if inner in _FIXED:
        return _FIXED[inner][0], None, _FIXED[inner][1]
    match = _LAYER.match(inner)
    if not match:
        return None  # buffers such as position_ids
    layer, module, kind = int(match.group(1)), match.group(2), match.group(3)
    if module in LAYER_NORMS:
        return f"layers.{module}.{kind}", layer, "as_is"
    if module in LAYER_LINEARS:
        return (f"layers.{module}.kernel", layer, "transpose") if kind == "weight" else (f"layers.{module}.bias", layer,
                                                                                           "as_is")
    return None


def _tower_weights(config: Idefics3Config, tensors: dict[str, tuple[str, str]], read, dtype, path: str) -> dict:
    """The tower's and connector's weights ({flat name: array}, `jaxlora.vision.siglip`) from
    tensors {checkpoint name: (part, inner name)}."""
    mapped = []
    for name, (part, inner) in tensors.items():
        target = _mapped(part, inner)
        if target is None:
            continue
        if target[1] is not None and target[1] >= config.vision.num_layers:
            raise WeightsError(f"{path}: tensor {name} is not part of this Idefics3 config")
        mapped.append((name, target))
    return stack_tower_weights(path, mapped, read, weight_shapes(config), config.vision.num_layers, dtype,
                               "Idefics3 config", "vision/connector")


def load_idefics3(path: str, dtype=jnp.float32) -> Idefics3:
    """Loads an Idefics3 / SmolVLM HF directory (config.json + safetensors) as an `Idefics3`."""
    config = read_idefics3_config(path)
    owner, read = open_checkpoint(path)
    text_names: dict[str, str] = {}  # Llama checkpoint name -> Idefics3 checkpoint name
    tower: dict[str, tuple[str, str]] = {}
    for name in sorted(owner):
        split = split_idefics3_name(name)
        if split is None:
            raise WeightsError(f"{owner[name]}: tensor {name} is not part of an Idefics3 model (text_model, "
                               f"vision_model, connector or lm_head)")
        if split[0] == "text":
            text_names[split[1]] = name
        else:
            tower[name] = split
    text_weights = stack_weights(config.text, sorted(text_names), lambda n: read(text_names[n]), dtype, source=path,
                                 file_of=lambda n: owner[text_names.get(n, n)])
    vision = Idefics3Tower(config, weights=_tower_weights(config, tower, read, dtype, path), dtype=dtype)
    return Idefics3(config, vision=vision, language=Llama(config.text, weights=text_weights, dtype=dtype), dtype=dtype)
