"""Folding one adapter into the base weights (merged inference, export) and taking it out again."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxlora.lora.adapter import LoraAdapter
from jaxlora.models.llama import Llama


def adapter_delta(adapter: LoraAdapter, module: str) -> np.ndarray:
    """[L, k, n]: scale * A @ B for every layer of `module` (float32)."""
    weights = adapter.modules[module]
    return weights.scale[:, None, None] * np.einsum("lkr,lrn->lkn", weights.a, weights.b)


def merge_adapter(model: Llama, adapter: LoraAdapter, sign: float = 1.0) -> None:
    """W += sign * scale * A @ B for every projection the adapter targets (in place)."""
    for module in adapter.modules:
        param = model.weights[f"layers.{module}.kernel"]
        merged = param[...].astype(jnp.float32) + sign * jnp.asarray(adapter_delta(adapter, module))
        merged = merged.astype(param[...].dtype)
        param.set_value(merged) if hasattr(param, "set_value") else setattr(param, "value", merged)


def unmerge_adapter(model: Llama, adapter: LoraAdapter) -> None:
    """Undoes `merge_adapter` (up to float rounding)."""
    merge_adapter(model, adapter, sign=-1.0)
