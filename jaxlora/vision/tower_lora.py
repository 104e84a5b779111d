"""LoRA on the CLIP vision tower's linear layers (q/k/v/out_proj, fc1, fc2), as PEFT puts it when
its `target_modules` match them (a plain `["q_proj", "v_proj"]` on LLaVA does).

One adapter's tower part is a `TowerLora` (host numpy: per module A [L, in, r], B [L, r, out],
rank and scale [L], as `jaxlora.lora.adapter.ModuleLora`); a call takes `TowerLoraInputs`: the
adapters of the call stacked on a slot axis and each image's slot, so the images of one batch
can each run with their own adapter (or none, slot -1); `jaxlora.vision.clip.tower_lora_delta` adds the deltas."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.lora.adapter import ModuleLora
from jaxlora.lora.adapter_config import AdapterError, pattern_key
from jaxlora.vision.clip import LAYER_LINEARS, linear_shapes
from jaxlora.vision.config import LlavaConfig

_TOWER_MODULE = re.compile(r"^encoder\.layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_0-9]+)$")


@dataclasses.dataclass
class TowerLora:
    """One adapter's LoRA on the vision tower: module name -> `ModuleLora` over the tower's
    layers (rank 0 where a layer is not targeted)."""

    name: str
    modules: dict[str, ModuleLora]


class TowerLoraInputs(NamedTuple):
    """A call's tower adapters: module -> (a [L, S, in, r], b [L, S, r, out], scale [L, S]) over
    S stacked adapters; slots [N]: each image's adapter (-1: none)."""

    weights: dict
    slots: jax.Array


def parse_tower_module(inner: str) -> tuple[int, str] | None:
    """'encoder.layers.3.self_attn.q_proj' (a name inside the CLIP vision model) -> (3, 'q_proj')."""
    match = _TOWER_MODULE.match(inner)
    return (int(match.group(1)), match.group(2)) if match and match.group(2) in LAYER_LINEARS else None


def tower_lora_from_peft(raw: dict, tensors: dict[str, tuple[str, int, str, str, np.ndarray]], config: LlavaConfig,
                         name: str, path: str) -> TowerLora:
    """The tower part of a PEFT adapter. raw: its `adapter_config.json`; tensors: key -> (full
    module name in the LLaVA model, layer, module, "A" | "B", tensor). Ranks come from the
    tensors; scales from r / lora_alpha / use_rslora and PEFT's rank_pattern / alpha_pattern
    matched against the full module name."""
    shapes = linear_shapes(config.vision)
    layers = config.vision.num_layers
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    full_names: dict[tuple[int, str], str] = {}
    for key, (full, layer, module, part, tensor) in tensors.items():
        if layer >= config.vision.num_layers:
            continue  # a layer after the deepest feature layer: never runs
        found.setdefault((layer, module), {})[part] = np.asarray(tensor, np.float32)
        full_names[(layer, module)] = full
    r, alpha = int(raw.get("r", 8)), float(raw.get("lora_alpha", 8))
    ranks, alphas = raw.get("rank_pattern") or {}, raw.get("alpha_pattern") or {}
    modules: dict[str, ModuleLora] = {}
    for module in sorted({m for _, m in found}, key=LAYER_LINEARS.index):
        fan_in, fan_out = shapes[module]
        width = max((found[(l, m)]["A"].shape[0] for l, m in found if m == module and "A" in found[(l, m)]),
                    default=0)
        weights = ModuleLora(np.zeros((layers, fan_in, width), np.float32), np.zeros((layers, width, fan_out), np.float32),
                             np.zeros(layers, np.int32), np.zeros(layers, np.float32))
        for layer in range(layers):
            parts = found.get((layer, module))
            if parts is None:
                continue
            if set(parts) != {"A", "B"}:
                raise AdapterError(f"{path}: {full_names[(layer, module)]} lacks lora_{'B' if 'A' in parts else 'A'}")
            a, b = parts["A"], parts["B"]
            rank = a.shape[0]
            if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
                raise AdapterError(f"{path}: {full_names[(layer, module)]} LoRA A {a.shape} / B {b.shape} do not fit "
                                   f"the tower's {module} ({fan_in} -> {fan_out})")
            full = full_names[(layer, module)]
            rank_key, alpha_key = pattern_key(list(ranks), full), pattern_key(list(alphas), full)
            want = int(ranks[rank_key]) if rank_key else r
            if want != rank:
                raise AdapterError(f"{path}: {full} has rank {rank}, the adapter config says {want}")
            module_alpha = float(alphas[alpha_key]) if alpha_key else alpha
            weights.a[layer, :, :rank], weights.b[layer, :rank] = a.T, b.T
            weights.rank[layer] = rank
            weights.scale[layer] = module_alpha / (math.sqrt(rank) if raw.get("use_rslora") else rank)
        if not np.all(np.isfinite(weights.a)) or not np.all(np.isfinite(weights.b)):
            raise AdapterError(f"{path}: the vision tower's {module} LoRA holds NaN or Inf")
        modules[module] = weights
    return TowerLora(name, modules)


def tower_lora_inputs(adapters: Sequence[TowerLora | None], image_slots: Sequence[int], dtype=jnp.float32
                      ) -> TowerLoraInputs | None:
    """The call's `TowerLoraInputs`: adapters stacked on the slot axis (ranks zero-padded to the
    widest; a module an adapter lacks is zero there), image_slots [N] indices into adapters (-1:
    none). None when no adapter has tower LoRA."""
    present = [a for a in adapters if a is not None]
    modules = sorted({m for a in present for m in a.modules}, key=LAYER_LINEARS.index)
    if not modules:
        return None
    weights = {}
    for module in modules:
        parts = [a.modules[module] for a in present if module in a.modules]
        layers, fan_in, fan_out = parts[0].a.shape[0], parts[0].a.shape[1], parts[0].b.shape[2]
        width = max(p.a.shape[2] for p in parts)
        a = np.zeros((layers, len(adapters), fan_in, width), np.float32)
        b = np.zeros((layers, len(adapters), width, fan_out), np.float32)
        scale = np.zeros((layers, len(adapters)), np.float32)
        for slot, adapter in enumerate(adapters):
            lora = None if adapter is None else adapter.modules.get(module)
            if lora is not None:
                rank = lora.a.shape[2]
                a[:, slot, :, :rank], b[:, slot, :rank], scale[:, slot] = lora.a, lora.b, lora.scale
        weights[module] = (jnp.asarray(a, dtype), jnp.asarray(b, dtype), jnp.asarray(scale))
    return TowerLoraInputs(weights, jnp.asarray(np.asarray(image_slots, np.int32)))

