"""One LoRA adapter in host memory: per target module, A [L, k, r] and B [L, r, n] (zero-padded to
the module's largest rank across layers), with each layer's rank and scale."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxlora.lora.adapter_config import AdapterError, LoraConfig
from jaxlora.nn.model_config import LlamaConfig
from jaxlora.nn.model_config import projection_shapes


@dataclasses.dataclass
class ModuleLora:
    """LoRA weights of one projection for every layer. a [L, k, r], b [L, r, n]; rank/scale [L]
    (rank 0 and zero weights where a layer is not targeted)."""

    a: np.ndarray
    b: np.ndarray
    rank: np.ndarray
    scale: np.ndarray


@dataclasses.dataclass
class LoraAdapter:
    """A named adapter: its config and its per-module weights (numpy; float32, or the dtype it was
    stored in when read with `load_peft_adapter(..., keep_dtype=True)`)."""

    name: str
    config: LoraConfig
    modules: dict[str, ModuleLora]

    @property
    def max_rank(self) -> int:
        return max(int(m.rank.max()) for m in self.modules.values())

    def delta_weight(self, module: str, layer: int) -> np.ndarray:
        """scale * A @ B of one layer's projection: [k, n]."""
        lora = self.modules[module]
        return lora.scale[layer] * (lora.a[layer] @ lora.b[layer])


def empty_module(base: LlamaConfig, lora: LoraConfig, module: str, dtype=np.float32) -> ModuleLora:
    """Zero weights (of `dtype`) with the right shapes, ranks and scales for `module`."""
    fan_in, fan_out = projection_shapes(base)[module]
    layers = range(base.num_layers)
    ranks = np.array([lora.rank(l, module) if lora.targets(l, module) else 0 for l in layers], np.int32)
    scales = np.array([lora.scale(l, module) if lora.targets(l, module) else 0.0 for l in layers], np.float32)
    width = int(ranks.max())
    return ModuleLora(
        a=np.zeros((base.num_layers, fan_in, width), dtype),
        b=np.zeros((base.num_layers, width, fan_out), dtype),
        rank=ranks,
        scale=scales,
    )


def random_adapter(name: str, base: LlamaConfig, lora: LoraConfig, seed: int = 0, b_std: float = 0.02) -> LoraAdapter:
    """An adapter with random A (Kaiming-like) and random non-zero B (for tests and benchmarks)."""
    rng = np.random.default_rng(seed)
    modules = {}
    for module in lora.target_modules:
        weights = empty_module(base, lora, module)
        for layer, rank in enumerate(weights.rank):
            fan_in = weights.a.shape[1]
            weights.a[layer, :, :rank] = rng.normal(0, fan_in**-0.5, (fan_in, rank))
            weights.b[layer, :rank] = rng.normal(0, b_std, (rank, weights.b.shape[2]))
        modules[module] = weights
    return LoraAdapter(name, lora, modules)


# Exponent bits of 16-bit floats: all ones means Inf or NaN (bfloat16: 8 bits, float16: 5).
_NONFINITE_EXPONENT = {"bfloat16": 0x7F80, "float16": 0x7C00}


def nonfinite(values: np.ndarray) -> np.ndarray:
    """Bool mask of NaN/Inf entries of `values`. 16-bit floats are tested on their bits with integer
    ops (numpy's native loops: fast, and they let other threads run; a server's disk readers check
    every adapter they read while its engine thread serves)."""
    mask = _NONFINITE_EXPONENT.get(values.dtype.name)
    if mask is None:
        return ~np.isfinite(values)
    return (values.view(np.uint16) & np.uint16(mask)) == mask


def check_finite(adapter: LoraAdapter, source: str) -> None:
    for module, weights in adapter.modules.items():
        for part in ("a", "b"):
            bad = nonfinite(np.asarray(getattr(weights, part)))
            if bad.any():
                layer = int(np.argwhere(bad)[0][0])
                raise AdapterError(f"{source}: {module} lora_{part.upper()} of layer {layer} holds NaN or Inf")
