"""A serving model with packed projections: q/k/v as one kernel and gate/up as one
(`config.PACKED_PROJECTIONS`), so a decoder layer runs 4 GEMMs instead of 7.

On a decode step the GEMMs are weight-bound and small: packing cut the matmul-only step of the 8B
shape from 4.74 to 4.23 ms at 32 rows on an H200 (`bench/lora_window.py`,
bench/results/lora_window_h200.json). `jaxlora.lora.project.project_group` runs a packed kernel
when the layer's weights hold one; the LoRA of each projection is unchanged (its adapter is added
to its own columns of the packed output). Serving only: training and the tensor-parallel
layouts keep one kernel per projection.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxlora.models.config import PACKED_PROJECTIONS
from jaxlora.models.llama import Llama


def pack_projections(model: Llama) -> Llama:
    """A copy of `model` (sharing every array it does not pack) whose stacked layer weights hold
    `layers.qkv_proj.kernel` [L, d, q + 2 kv] and `layers.gate_up_proj.kernel` [L, d, 2 f] (and
    packed biases where the projections have them) in place of the separate kernels. The packed
    kernels are new arrays: the separate ones stay with `model` (drop it to free them)."""
    packed = nnx.clone(model)
    weights = packed.weights
    for names, name in PACKED_PROJECTIONS.items():
        for part in ("kernel", "bias"):
            keys = [f"layers.{n}.{part}" for n in names]
            present = [key in weights for key in keys]
            if not any(present):
                continue
            if not all(present):
                raise ValueError(f"cannot pack {names}: only some of them have a {part}")
            weights[f"layers.{name}.{part}"] = nnx.Param(jnp.concatenate([weights[key][...] for key in keys], axis=-1))
            for key in keys:
                del weights[key]
    return packed
