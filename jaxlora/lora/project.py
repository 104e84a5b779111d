"""The projections of a decoder layer with LoRA: x @ W (+ bias) plus each row's adapter delta,
through a LoRA backend of `jaxlora.lora.backends` (a delta added to x @ W, or the fused training
kernels), with LoRA dropout from the kernels' counter-based hash so that every backend drops the
same elements."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.lora import backends
from jaxlora.lora.backends import LoraBackend
from jaxlora.lora.ops import stacked_pool
from jaxlora.lora.plan import LoraPlan, WindowPlan
from jaxlora.nn.model_config import PACKED_PROJECTIONS, PROJECTIONS
from jaxlora.nn.layers import dense
from pallas_kernels.fused_lora_layout import dropout_inv_keep, dropout_mask
from pallas_kernels.window_expand import base_width, window_expand


class LoraInputs(NamedTuple):
    """Adapters for one batch: the pool arrays (per module, leading layer axis; see
    `jaxlora.lora.pool`) and the batch's plan (which slot each token uses). For training,
    `dropout_rate` [slots] and a `dropout_key` turn on LoRA dropout (on the LoRA input only)."""

    pool: dict
    plan: LoraPlan
    dropout_rate: jax.Array | None = None
    dropout_key: jax.Array | None = None


class LayerLora(NamedTuple):
    """One decoder layer's LoRA context (built by `layer_lora`).

    pool: {module: this layer's arrays ({"a" [slots, k, r], "b" [slots, r, n], "scale", "rank"}
      [slots]) or a `StackedModulePool` (every layer's stack and this layer's index)};
    inputs: the batch's `LoraInputs` (plan, dropout); backend: the `LoraBackend` (from the
    registry, `jaxlora.lora.backends`); layer: this layer's index (int32 scalar; seeds dropout,
    indexes stacked pools)."""

    pool: dict
    inputs: LoraInputs
    backend: LoraBackend
    layer: jax.Array


class StackedWeight(NamedTuple):
    """A layer weight passed as every layer's stack [L, ...] and the layer a call reads (int32
    scalar): the adapter window's B (`<name>.window_b`) in the paged forward's layer scan, which
    the window's GPU kernel reads in place (a slice of a stack given to a kernel is a copy)."""

    stack: jax.Array
    layer: jax.Array


def layer_lora(inputs: LoraInputs | None, layer_pool: dict | None, backend: LoraBackend, layer) -> LayerLora | None:
    """The LoRA context of one layer, or None without adapters. layer_pool: this layer's pool
    arrays; None takes the whole stacked pool of `inputs` at `layer` (`StackedModulePool`s: the
    kernels index the stack in place, no per-layer slice is copied); backend: the `LoraBackend`
    (resolved by the caller's edge; a registry name, from a direct call, is looked up here)."""
    if inputs is None:
        return None
    if layer_pool is None:
        layer_pool = stacked_pool(inputs.pool, layer)
    if not isinstance(backend, LoraBackend):
        backend = backends.get(backend)
    return LayerLora(layer_pool, inputs, backend, layer)


def project(x: jax.Array, weights: dict[str, jax.Array], name: str, layer_lora: LayerLora | None = None) -> jax.Array:
    """x @ W (+ bias) (+ the LoRA delta of each row's adapter, if this projection has adapters).

    x [..., k]; weights hold `<name>.kernel` [k, n] (and `<name>.bias` [n]); layer_lora: this
    layer's `LayerLora` or None. Returns [..., n] in x's dtype."""
    window = _window_plan(layer_lora)
    if window is not None:
        return _window_output(x, weights, name, window)
    has_lora = layer_lora is not None and name in layer_lora.pool
    if has_lora and layer_lora.backend.fused:
        y = _fused_project(x, weights[f"{name}.kernel"], name, layer_lora)
        if f"{name}.bias" in weights:
            y = y + weights[f"{name}.bias"]
    else:  # float32 for a LoRA added in float32; else x's dtype (a serving kernel writes it directly)
        y = _base_output(x, weights, name, _output_dtype(x, layer_lora) if has_lora else x.dtype)
    if has_lora and not layer_lora.backend.fused:
        lora = layer_lora.inputs
        lora_input = x
        if lora.dropout_rate is not None:
            lora_input = _lora_dropout(x, lora, _dropout_seed(lora, layer_lora.layer, name))
        y = layer_lora.backend.accumulate(y, lora_input, layer_lora.pool[name], lora.plan)
    return y.astype(x.dtype)


def project_group(x: jax.Array, weights: dict[str, jax.Array], names: tuple,
                  layer_lora: LayerLora | None = None, sizes: tuple[int, ...] | None = None) -> list:
    """`project` for several projections of the same x (q/k/v; gate/up): each base GEMM on its
    own, or one GEMM when `weights` hold them packed (`jaxlora.models.packed`: then `sizes` are
    their output widths); the LoRA of the projections that have adapters together
    (`LoraBackend.accumulate_group`: one grouped shrink and expand for the serving kernels).
    Training inputs (dropout, fused backends) take `project` one by one (a packed kernel: each
    projection's own columns). Returns [..., n] per name, in x's dtype."""
    packed = PACKED_PROJECTIONS.get(tuple(names))
    if packed is not None and f"{packed}.kernel" in weights:
        return _project_packed(x, weights, names, packed, sizes, layer_lora)
    grouped = [name for name in names if layer_lora is not None and name in layer_lora.pool]
    if len(grouped) < 2 or layer_lora.backend.fused or layer_lora.inputs.dropout_rate is not None:
        return [project(x, weights, name, layer_lora) for name in names]
    outputs = {name: project(x, weights, name) for name in names if name not in grouped}  # no adapters
    ys = [_base_output(x, weights, name, _output_dtype(x, layer_lora)) for name in grouped]
    pools = [layer_lora.pool[name] for name in grouped]
    for name, y in zip(grouped, layer_lora.backend.accumulate_group(ys, x, pools, layer_lora.inputs.plan)):
        outputs[name] = y.astype(x.dtype)
    return [outputs[name] for name in names]


def _project_packed(x: jax.Array, weights: dict[str, jax.Array], names: tuple, packed: str,
                    sizes: tuple[int, ...] | None, layer_lora: LayerLora | None) -> list:
    """`project_group` over the packed kernel `<packed>.kernel` [k, sum(sizes)]: one GEMM, split
    into the projections' outputs, plus the LoRA of those with adapters. Training inputs (LoRA
    dropout, fused backends) take each projection's own columns (`_unpacked`) and the separate
    projections' path."""
    if sizes is None or len(sizes) != len(names):
        raise ValueError(f"packed projections {packed} need the output width of each of {names}")
    window = _window_plan(layer_lora)
    grouped = [name for name in names if layer_lora is not None and name in layer_lora.pool]
    if grouped and window is None and (layer_lora.backend.fused or layer_lora.inputs.dropout_rate is not None):
        return project_group(x, _unpacked(weights, names, packed, sizes), names, layer_lora)
    if window is not None:
        y = _window_output(x, weights, packed, window, tuple(sizes))
    else:
        y = _base_output(x, weights, packed, _output_dtype(x, layer_lora) if grouped else x.dtype)
    cuts = np.cumsum(sizes)[:-1].tolist()  # where each projection's columns start in the packed output
    ys = dict(zip(names, jnp.split(y, cuts, axis=-1)))
    if grouped and window is None:
        pools = [layer_lora.pool[name] for name in grouped]
        plan = layer_lora.inputs.plan
        packed_y = None  # every projection with an adapter: in place on the packed output where the backend can
        if grouped == list(names):
            packed_y = layer_lora.backend.accumulate_packed(y, sizes, x, pools, plan)
        if packed_y is not None:
            ys = dict(zip(names, jnp.split(packed_y, cuts, axis=-1)))
        else:
            ys.update(zip(grouped, layer_lora.backend.accumulate_group([ys[name] for name in grouped], x, pools, plan)))
    return [ys[name].astype(x.dtype) for name in names]


def _unpacked(weights: dict[str, jax.Array], names: tuple, packed: str, sizes: tuple[int, ...]) -> dict:
    """Each projection's kernel (and bias) as its own columns of the packed ones (a slice per
    layer; the adapter window's columns left out): training inputs (LoRA dropout, the fused
    kernels) run the separate projections' programs on a packed model, with their results."""
    offsets = np.cumsum([0, *sizes]).tolist()
    out = {}
    for index, name in enumerate(names):
        for part in ("kernel", "bias"):
            if f"{packed}.{part}" in weights:
                out[f"{name}.{part}"] = weights[f"{packed}.{part}"][..., offsets[index]: offsets[index + 1]]
    return out


def _output_dtype(x: jax.Array, layer_lora: LayerLora):
    """The dtype a projection with LoRA leaves its output in for the LoRA to be added: x's where the
    backend computing this plan adds in it (`LoraBackend.adds_in_input_dtype`), else float32."""
    backend = layer_lora.backend.for_plan(layer_lora.inputs.plan)
    return x.dtype if backend.adds_in_input_dtype else jnp.float32


def _base_output(x: jax.Array, weights: dict[str, jax.Array], name: str, dtype=jnp.float32) -> jax.Array:
    """x @ W (+ bias), accumulated in float32, in `dtype` (x's: the GEMM writes x's dtype, as the
    base model's own step does after its cast); a serving kernel with the adapter window's
    columns: without them (no copy of the window's columns in any dtype)."""
    if f"{name}.window_b" not in weights:
        y = dense(x, weights[f"{name}.kernel"])
        y = y + weights[f"{name}.bias"] if f"{name}.bias" in weights else y
        return y.astype(dtype)
    y = jnp.dot(x, weights[f"{name}.kernel"], preferred_element_type=dtype)[..., : _window_width(weights, name)]
    return y + weights[f"{name}.bias"].astype(dtype) if f"{name}.bias" in weights else y


def _window_width(weights: dict[str, jax.Array], name: str) -> int:
    """The base output width of a kernel with window columns: `<name>.window_b` is [P*W*r, n]
    (block-diagonal) or [P, W*r, n_p] (one block per projection, all P of width n_p), or a
    `StackedWeight` of those."""
    window_b = weights[f"{name}.window_b"]
    return base_width(window_b.stack.shape[1:] if isinstance(window_b, StackedWeight) else window_b.shape)


def _window_plan(layer_lora: LayerLora | None) -> WindowPlan | None:
    plan = None if layer_lora is None else layer_lora.inputs.plan
    return plan if isinstance(plan, WindowPlan) else None


def _window_output(x: jax.Array, weights: dict[str, jax.Array], name: str, plan: WindowPlan,
                   widths: tuple[int, ...] | None = None) -> jax.Array:
    """x @ W (+ bias) plus each row's LoRA delta from the adapter window, in x's dtype as PEFT adds
    it (`jaxlora.models.packed.add_adapter_window`): the kernel `<name>.kernel` [k, n + P*W*r]
    gives the base output and every window slot's shrink in one GEMM; each row keeps its own
    slot's columns and those of its extra slot (`plan`: x's rows are its tokens), expanded by
    `<name>.window_b` (`pallas_kernels.window_expand`: one kernel on a GPU, in place on the GEMM's
    output). A kernel without window columns: the base output. x [..., T, k]; widths: the packed
    projections' output widths (None: one projection)."""
    if f"{name}.window_b" not in weights:
        return _base_output(x, weights, name, x.dtype).astype(x.dtype)
    y = jnp.dot(x, weights[f"{name}.kernel"], preferred_element_type=x.dtype)  # f32 accumulation
    window_b = weights[f"{name}.window_b"]
    stack, layer = window_b if isinstance(window_b, StackedWeight) else (window_b, None)
    return window_expand(y, stack, plan.token_window, plan.token_extra, plan.column_window,
                         weights.get(f"{name}.bias"), layer=layer, widths=widths)


def _dropout_seed(lora: LoraInputs, layer_index: jax.Array, name: str) -> jax.Array:
    """int32 seed of the dropout hash for one projection of one layer in this step."""
    key = jax.random.fold_in(jax.random.fold_in(lora.dropout_key, layer_index), PROJECTIONS.index(name))
    return jax.lax.bitcast_convert_type(jax.random.bits(key, (), jnp.uint32), jnp.int32)


def _grouped_rates(lora: LoraInputs) -> jax.Array:
    """[N] dropout rate of each row in grouped (plan) order; 0 for base rows."""
    slot = lora.plan.token_slot[lora.plan.perm]
    return jnp.where(slot >= 0, lora.dropout_rate[jnp.maximum(slot, 0)], 0.0)


def _lora_dropout(x: jax.Array, lora: LoraInputs, seed: jax.Array) -> jax.Array:
    """Inverted dropout of each row's LoRA input at its adapter's rate, from the counter-based hash
    of (seed, grouped row, column) that the fused kernels use, so every backend drops the same."""
    rows = x.reshape(-1, x.shape[-1])
    rates = _grouped_rates(lora)
    keep = dropout_mask(seed, rows.shape[0], rows.shape[1], rates)[lora.plan.inv_perm]
    scale = dropout_inv_keep(rates)[lora.plan.inv_perm][:, None]
    return jnp.where(keep, rows * scale, 0).astype(x.dtype).reshape(x.shape)


def _fused_project(x: jax.Array, kernel: jax.Array, name: str, layer_lora: LayerLora) -> jax.Array:
    """x @ W + LoRA in one fused kernel (training backend) on rows grouped by adapter; float32."""
    pool, lora, backend, layer_index = layer_lora
    module_pool, plan = pool[name], lora.plan
    rows = permute_rows(x.reshape(-1, x.shape[-1]), plan.perm, plan.inv_perm)
    num_slots = module_pool["a"].shape[0]
    rates = jnp.zeros(num_slots, jnp.float32) if lora.dropout_rate is None else lora.dropout_rate
    seed = jnp.int32(0) if lora.dropout_key is None else _dropout_seed(lora, layer_index, name)
    y = backend.fused_linear(rows, kernel, module_pool, plan, rates, seed)
    y = permute_rows(y, plan.inv_perm, plan.perm)
    return y.astype(jnp.float32).reshape(*x.shape[:-1], kernel.shape[-1])


@jax.custom_vjp
def permute_rows(rows: jax.Array, perm: jax.Array, inverse: jax.Array) -> jax.Array:
    """rows [N, d] -> rows[perm], for a permutation `perm` [N] with `inverse` [N] = its inverse.
    The gradient is a gather by `inverse` (plain indexing would differentiate to a scatter-add)."""
    return rows[perm]


def _permute_forward(rows, perm, inverse):
    return rows[perm], (perm, inverse)


def _permute_backward(saved, grad):
    perm, inverse = saved
    no_grad = lambda index: np.zeros(index.shape, jax.dtypes.float0)
    return grad[inverse], no_grad(perm), no_grad(inverse)


permute_rows.defvjp(_permute_forward, _permute_backward)
