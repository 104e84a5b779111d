"""Merged inference on the serving model: one adapter's ΔW = scale·A·B folded into the base
kernels on the device (V-LoRA §4.4.1, dLoRA), and taken out again with the base bits exact.

The base columns of every targeted projection are copied once (`base_copy`) when the engine
serves with merged modes; `set_merged` then writes, for all layers and projections in one jitted
update that donates the kernels (in place), either copy + ΔW of one pool slot (merge; switching
from one merged adapter to another is the same update) or the copy itself (unmerge: the base
comes back bit-identical). A rounded add cannot be undone exactly from the merged weights and ΔW
alone (`round(W + Δ) - Δ` need not round back to W: where W's exponent is smaller than the sum's,
several W round to the same merged value), so the exact base needs per-element information of
the base's own size; the copy is the simplest such store, it is read instead of the merged
kernel (a switch reads the copy and writes the kernel: 2 bytes moved per weight byte, the floor
`pallas_kernels.merge_gpu` runs at on a GPU), and its
memory is the targeted projections' base weights (e.g. the 8B shape, q/k/v/o: 2.7 GB in bf16;
all seven projections: 14 GB). The window's columns of a packed kernel
(`jaxlora.models.packed.add_adapter_window`) are never touched.

Works on the packed serving model (`jaxlora.models.packed`: q/k/v and gate/up share a kernel,
each projection at its column offset) and on separate kernels alike.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxlora.nn.model_config import PACKED_PROJECTIONS, LlamaConfig, projection_shapes
from pallas_kernels.merge_gpu import merge_columns


@dataclasses.dataclass(frozen=True)
class MergeLayout:
    """Where each targeted projection's base columns sit: targets ((projection, kernel key,
    column offset, width), ...) over stacked kernels [L, k, n_kernel]."""

    targets: tuple

    @property
    def kernel_keys(self) -> list[str]:
        """The kernels `set_merged` writes (each once)."""
        return sorted({key for _, key, _, _ in self.targets})


def merge_layout(config: LlamaConfig, weight_keys, modules) -> MergeLayout:
    """The layout of projections `modules` in a model whose weights have the keys `weight_keys`
    (separate `layers.<p>.kernel` or packed `layers.<group>.kernel`, `config.PACKED_PROJECTIONS`)."""
    shapes, keys, targets = projection_shapes(config), set(weight_keys), []
    for name in modules:
        if f"layers.{name}.kernel" in keys:
            targets.append((name, f"layers.{name}.kernel", 0, shapes[name][1]))
            continue
        for names, group in PACKED_PROJECTIONS.items():
            if name in names and f"layers.{group}.kernel" in keys:
                offset = sum(shapes[n][1] for n in names[: names.index(name)])
                targets.append((name, f"layers.{group}.kernel", offset, shapes[name][1]))
                break
        else:
            raise ValueError(f"the model has no kernel holding {name}")
    return MergeLayout(tuple(targets))


def base_copy(layout: MergeLayout, kernels: dict) -> dict:
    """{projection: its base columns [L, k, n_p]} copied from `kernels` {key: [L, k, n_kernel]}
    (new arrays: the kernels may be donated afterwards)."""
    return {name: jnp.array(kernels[key][:, :, offset: offset + width], copy=True)
            for name, key, offset, width in layout.targets}


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def set_merged(layout: MergeLayout, kernels: dict, base: dict, pool: dict, slot, merged) -> dict:
    """`kernels` {key: [L, k, n_kernel]} (donated: written in place) with each targeted
    projection's base columns set to base + scale·A·B of pool slot `slot` when `merged` (a bool
    scalar), else to `base` itself (unmerged: bit-identical to the copy). base: `base_copy`;
    pool: `jaxlora.lora.pool` arrays ({projection: a [L, slots, k, r], b [L, slots, r, n],
    scale [L, slots]}; a projection the slot's adapter does not target has zero B and scale).
    Each projection's columns in one pass (`pallas_kernels.merge_gpu.merge_columns`: on a GPU one
    kernel reading the base copy and writing the kernel, ΔW formed per tile in float32 and never
    stored; elsewhere the jnp form, per layer), rounded once to the kernel's dtype. One compile
    serves every slot, merge and unmerge."""
    kernels = dict(kernels)
    for name, key, offset, width in layout.targets:
        module = pool[name]
        a = jax.lax.dynamic_index_in_dim(module["a"], slot, axis=1, keepdims=False)  # [L, k, r]
        b = jax.lax.dynamic_index_in_dim(module["b"], slot, axis=1, keepdims=False)  # [L, r, n]
        scale = jax.lax.dynamic_index_in_dim(module["scale"], slot, axis=1, keepdims=False)  # [L]
        kernels[key] = merge_columns(kernels[key], base[name], a, b, scale, merged, offset)
    return kernels
