"""LoRA hyper-parameters (PEFT's names and semantics): rank, alpha, dropout, targets, rsLoRA, patterns."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Mapping, Sequence

from jaxlora.nn.model_config import PROJECTIONS

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


class AdapterError(ValueError):
    """An adapter that cannot be used with this base model; the message names the problem."""


def module_key(layer: int, module: str) -> str:
    """PEFT's module name of a projection, e.g. 'model.layers.3.self_attn.q_proj'."""
    block = "self_attn" if module in ATTENTION_MODULES else "mlp"
    return f"model.layers.{layer}.{block}.{module}"


def pattern_key(patterns: Sequence[str], key: str) -> str | None:
    """The first pattern of a PEFT `rank_pattern`/`alpha_pattern` that matches `key` (PEFT's rule)."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return pattern
    return None


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """One adapter's LoRA settings; `rank_pattern`/`alpha_pattern` override r/alpha per module."""

    r: int = 8
    lora_alpha: float = 8.0
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = dataclasses.field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = dataclasses.field(default_factory=dict)
    layers_to_transform: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.r < 1:
            raise AdapterError(f"LoRA rank r must be >= 1, got {self.r}")
        if not 0 <= self.lora_dropout < 1:
            raise AdapterError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        unknown = sorted(set(self.target_modules) - set(PROJECTIONS))
        if unknown or not self.target_modules:
            raise AdapterError(
                f"unsupported target_modules {unknown or '[]'}: jaxlora puts LoRA on {', '.join(PROJECTIONS)}"
            )
        for name, value in self.rank_pattern.items():
            if int(value) < 1:
                raise AdapterError(f"rank_pattern[{name!r}] must be >= 1, got {value}")

    def targets(self, layer: int, module: str) -> bool:
        if module not in self.target_modules:
            return False
        return self.layers_to_transform is None or layer in self.layers_to_transform

    def rank(self, layer: int, module: str) -> int:
        key = pattern_key(list(self.rank_pattern), module_key(layer, module))
        return int(self.rank_pattern[key]) if key is not None else self.r

    def alpha(self, layer: int, module: str) -> float:
        key = pattern_key(list(self.alpha_pattern), module_key(layer, module))
        return float(self.alpha_pattern[key]) if key is not None else float(self.lora_alpha)

    def scale(self, layer: int, module: str) -> float:
        """alpha / r, or alpha / sqrt(r) with rsLoRA."""
        rank = self.rank(layer, module)
        return self.alpha(layer, module) / (math.sqrt(rank) if self.use_rslora else rank)

    def max_rank(self, num_layers: int) -> int:
        return max(self.rank(layer, m) for layer in range(num_layers) for m in self.target_modules)
