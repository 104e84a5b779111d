"""A serving model with packed projections: q/k/v as one kernel and gate/up as one
(`config.PACKED_PROJECTIONS`), so a decoder layer runs 4 GEMMs instead of 7.

On a decode step the GEMMs are weight-bound and small: packing cut the matmul-only step of the 8B
shape from 4.74 to 4.23 ms at 32 rows on an H200 (`bench/lora_window.py`,
bench/results/lora_window_h200.json). `jaxlora.lora.project.project_group` runs a packed kernel
when the layer's weights hold one; the LoRA of each projection is unchanged (its adapter is added
to its own columns of the packed output). The trainer packs too on one device (`train.trainer`:
the same programs as training inside the server); training inputs (LoRA dropout, the fused
kernels) run each projection on its own columns. The tensor-parallel layouts keep one kernel per
projection.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlora.nn.model_config import PACKED_PROJECTIONS, LlamaConfig, projection_shapes
from jaxlora.models.llama import Llama, layer_key


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


# The adapter window -----------------------------------------------------------------------------
# Each decoder layer's GEMMs of the packed serving model, by kernel, and the projections whose
# outputs each one holds side by side (in this order).
WINDOW_GROUPS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                 "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclasses.dataclass(frozen=True)
class AdapterWindow:
    """Where the adapter window sits in a packed serving model (`add_adapter_window`).

    slots: W, the adapters the window holds; rank: r, each slot's columns per projection.
    groups: ((kernel, ((projection, output offset, output width), ...), batched), ...): per packed
      kernel of `WINDOW_GROUPS`, the projections with window columns, in column order; batched:
      they are all of the kernel's projections and of one width, so B is held one block per
      projection [P, W*r, n_p] (a batched expand GEMM) instead of block-diagonal [P*W*r, n]."""

    slots: int
    rank: int
    groups: tuple

    def columns(self, group: str) -> int:
        """Window columns of `group`'s kernel: P projections x W slots x r."""
        placed = {name: projections for name, projections, _ in self.groups}[group]
        return len(placed) * self.slots * self.rank


def window_layout(config: LlamaConfig, slots: int, rank: int, modules) -> AdapterWindow:
    """The window of `slots` adapters of rank <= `rank` over the projections `modules`."""
    shapes = projection_shapes(config)
    groups = []
    for group, names in WINDOW_GROUPS.items():
        offsets = np.cumsum([0] + [shapes[name][1] for name in names])
        placed = tuple((name, int(offsets[i]), shapes[name][1]) for i, name in enumerate(names) if name in modules)
        batched = len(placed) == len(names) > 1 and len({width for _, _, width in placed}) == 1
        if placed:
            groups.append((group, placed, batched))
    return AdapterWindow(slots, rank, tuple(groups))


def add_adapter_window(model: Llama, window: AdapterWindow) -> None:
    """Makes room for the window in the packed `model` (in place): each group's kernel
    `layers.<group>.kernel` [L, k, n] gets P*W*r zero columns (A of each window slot and
    projection: column (p*W + w)*r + i is rank component i of slot w's projection p), and
    `layers.<group>.window_b` [L, P*W*r, n] holds the window's B, block-diagonal (rows of
    projection p only in p's output columns), or [L, P, W*r, n_p] for a batched group (see
    `AdapterWindow`), zero until `fill_window_slot` writes a slot.

    A step with a `WindowPlan` then gets each row's LoRA shrink out of the base GEMM and adds one
    expand GEMM per group (`jaxlora.lora.project`); other steps drop the window's columns."""
    weights = model.weights
    for group, placed, batched in window.groups:
        key = f"layers.{group}.kernel"
        if key not in weights:
            raise ValueError(f"the adapter window needs the packed serving model ({key} is missing)")
        kernel = weights[key][...]
        layers, _, width = kernel.shape
        extra = window.columns(group)
        weights[key] = nnx.Param(jnp.concatenate([kernel, jnp.zeros((*kernel.shape[:2], extra), kernel.dtype)], -1))
        shape = (layers, len(placed), extra // len(placed), width // len(placed)) if batched else (layers, extra, width)
        weights[f"layers.{group}.window_b"] = nnx.Param(jnp.zeros(shape, kernel.dtype))


def window_key(group: str, part: str, layer: int | None = None) -> str:
    """The name of a window weight: `layers.<group>.<part>` stacked, or layer `layer`'s own
    (`jaxlora.models.llama.layer_key`)."""
    return f"layers.{group}.{part}" if layer is None else layer_key(layer, f"{group}.{part}")


def window_layers(split_layers: int) -> list[int | None]:
    """The layers a window fill addresses one by one: [None] (the stacks) or range(split_layers)."""
    return list(range(split_layers)) if split_layers else [None]


def window_keys(window: AdapterWindow, split_layers: int = 0) -> list[str]:
    """The weights `fill_window_slot` writes: `layers.<group>.<part>` of the stacked model, or with
    `split_layers` = L (`jaxlora.models.llama.split_layers`) each layer's own, for L layers."""
    return [window_key(group, part, layer) for layer in window_layers(split_layers) for group, _, _ in window.groups
            for part in ("kernel", "window_b")]


def _fill_group(kernel, window_b, a, b, scale, column: int, row, offset: int, batched: bool, p: int):
    """`kernel` [(L,) k, n] with `a` [(L,) k, r] in its columns from `column`; `window_b` with `b`
    [(L,) r, n_p] times `scale` [(L,)] at rows `row` (a batched group's block p; else columns from
    `offset`)."""
    lead = (0,) * (kernel.ndim - 2)  # the layer axis of a stacked model, none for one layer's arrays
    kernel = jax.lax.dynamic_update_slice(kernel, a.astype(kernel.dtype), (*lead, 0, column))
    b = (b.astype(jnp.float32) * scale[..., None, None]).astype(window_b.dtype)
    if batched:  # [(L,) P, W*r, n_p]: projection p's block, rows of the slot
        window_b = jax.lax.dynamic_update_slice(window_b, jnp.expand_dims(b, len(lead)), (*lead, p, row, 0))
    else:  # [(L,) P*W*r, n]: rows of (p, slot), p's output columns
        window_b = jax.lax.dynamic_update_slice(window_b, b, (*lead, row, offset))
    return kernel, window_b


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("split_layers",), donate_argnums=(1,))
def fill_window_slot(window: AdapterWindow, weights: dict, pool: dict, window_slot, pool_slot,
                     split_layers: int = 0) -> dict:
    """`weights` (the `window_keys(window, split_layers)` arrays, donated: written in place; stacked,
    or one array a layer with `split_layers` = L) with window slot `window_slot` holding the adapter in slot `pool_slot` of the adapter pool `pool`
    (`jaxlora.lora.pool` arrays: a [L, slots, k, r], b [L, slots, r, n], scale [L, slots]):
    its A into the kernels' window columns, its B scaled by its per-layer scale into the
    block-diagonal `window_b`. The pool's rank padding is zeros, so an adapter of lower rank
    leaves zero columns. One compile serves every (window slot, pool slot)."""
    weights = dict(weights)
    w, r = window.slots, window.rank
    for group, placed, batched in window.groups:
        for layer in window_layers(split_layers):
            kernel_key, b_key = window_key(group, "kernel", layer), window_key(group, "window_b", layer)
            kernel, window_b = weights[kernel_key], weights[b_key]
            base_width = kernel.shape[-1] - window.columns(group)
            for p, (name, offset, _) in enumerate(placed):
                module = pool[name]
                a = jax.lax.dynamic_index_in_dim(module["a"], pool_slot, axis=1, keepdims=False)  # [L, k, r]
                b = jax.lax.dynamic_index_in_dim(module["b"], pool_slot, axis=1, keepdims=False)  # [L, r, n_p]
                scale = jax.lax.dynamic_index_in_dim(module["scale"], pool_slot, axis=1, keepdims=False)
                if layer is not None:
                    a, b, scale = a[layer], b[layer], scale[layer]
                row = (window_slot * r) if batched else (p * w + window_slot) * r
                kernel, window_b = _fill_group(kernel, window_b, a, b, scale, base_width + (p * w + window_slot) * r,
                                               row, offset, batched, p)
            weights[kernel_key], weights[b_key] = kernel, window_b
    return weights
