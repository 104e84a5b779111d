"""The LoRA linear op with a backend switch: delta = scale[slot] * (x @ A[slot]) @ B[slot] per row.

Backends (all compute the same function; the plan says which slot each row uses):
  "loop"       one masked dense product per pool slot (the plainest reference);
  "gather"     gather each row's A/B, then batched einsums;
  "ragged_dot" rows grouped by slot, `jax.lax.ragged_dot` (base rows use an extra zero adapter);
  "onehot"     x against every slot, then a one-hot selection;
  "pallas"     the SGMV kernels of `pallas_kernels` on the grouped rows: compiled on a GPU/TPU,
               the GPU-style kernel in interpret mode on a CPU. With a `LoraPlan` the rows are
               gathered into adapter order and back around the (differentiable) kernels; with
               the serving engine's `ServingPlan` they are already in order: SGMV on the prefill
               segments and BGMV on the one-token rows, accumulating in place (forward only);
  "pallas_gpu", "pallas_tpu"  one kernel style explicitly (interpret mode off its own backend);
  "hybrid"     serving: with a decode-only `ServingPlan` the Pallas BGMV kernels, for every other
               plan (steps with prefill chunks, training) the one-hot GEMMs. On the H200 trace
               the kernels add 2.2 ms to a 36 ms decode step but 37 ms to a 57 ms mixed step, where
               the one-hot GEMMs add 12 (bench/NOTES_serve.md);
  "fused", "fused_tpu"  training backend: the model computes x @ W + LoRA in one fused kernel
               (`pallas_kernels.fused_lora_linear`), so `lora_delta` itself is not called.

`lora_accumulate(y, x, ...)` adds the delta to a projection's float32 output: the Pallas backends
with a `ServingPlan` accumulate straight into y (no zeroed delta buffer, no add); the others add
`lora_delta` rounded to x's dtype. A module's pool is a per-layer dict or a `StackedModulePool`
(every layer's arrays and the layer to use: the serving engine's layer scan passes the stack so
the kernels index it in place and no per-layer slice of the pool is copied).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxlora.lora.plan import LoraPlan, ServingPlan
from jaxlora.models.layers import dense

FUSED_BACKENDS = ("fused", "fused_tpu")
BACKENDS = ("loop", "gather", "ragged_dot", "onehot", "pallas", "pallas_gpu", "pallas_tpu", "hybrid") + FUSED_BACKENDS
_F32 = jnp.float32


class StackedModulePool(NamedTuple):
    """One projection's pool arrays for every layer and the layer a call uses: a [L, slots, k, r],
    b [L, slots, r, n], scale [L, slots] float32, rank [L, slots] int32; layer: int32 scalar."""

    a: jax.Array
    b: jax.Array
    scale: jax.Array
    rank: jax.Array
    layer: jax.Array

    def layer_pool(self) -> dict:
        """The layer's own {"a", "b", "scale", "rank"} (a slice of each stack)."""
        return {key: getattr(self, key)[self.layer] for key in ("a", "b", "scale", "rank")}

    def entries(self):
        """(a [L*slots, k, r], b [L*slots, r, n], rank [L*slots], scale [L*slots], offset of the
        layer's first entry): the stacks flattened (no copy) for the stacked-pool kernels."""
        layers, slots = self.rank.shape
        flat = lambda array: array.reshape(layers * slots, *array.shape[2:])
        return flat(self.a), flat(self.b), flat(self.rank), flat(self.scale), self.layer * slots


def stacked_pool(pool: dict, layer: jax.Array) -> dict:
    """{module: StackedModulePool} of a whole pool ({module: {"a", "b", "scale", "rank"}}, each
    with a leading layer axis) at `layer`."""
    return {module: StackedModulePool(layer=layer, **arrays) for module, arrays in pool.items()}


def _layer_pool(module_pool) -> dict:
    return module_pool.layer_pool() if isinstance(module_pool, StackedModulePool) else module_pool


def lora_accumulate(y: jax.Array, x: jax.Array, module_pool, plan, backend: str = "gather") -> jax.Array:
    """y + the LoRA delta of each row (float32): y [..., n] float32 (the base projection's
    output), x [..., k]; module_pool: a layer's dict (see `lora_delta`) or a `StackedModulePool`.
    The Pallas backends with a `ServingPlan` run their kernels in place on y; the others add
    `lora_delta` (rounded to x's dtype, as before)."""
    backend = _route(backend, plan)
    if backend in _PALLAS_BACKENDS and isinstance(plan, ServingPlan):
        rows, out = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1]).astype(_F32)
        impl = _pallas_impl(_PALLAS_BACKENDS[backend])
        return _pallas_serving(out, rows, module_pool, plan, impl).reshape(y.shape)
    return y + lora_delta(x, _layer_pool(module_pool), plan, backend).astype(_F32)


def lora_accumulate_group(ys, x: jax.Array, module_pools, plan, backend: str = "gather") -> tuple:
    """`lora_accumulate` for several projections of one input x [..., k] (q/k/v, gate/up): ys are
    their float32 outputs [..., n_g], module_pools their pools. With a Pallas backend and a
    `ServingPlan`, the one-token rows of all of them go through one grouped BGMV shrink and one
    expand (x read once, 2 launches instead of 2 per projection); prefill segments through SGMV
    per projection. Otherwise one `lora_accumulate` each."""
    backend = _route(backend, plan)
    if not (backend in _PALLAS_BACKENDS and isinstance(plan, ServingPlan)):
        return tuple(lora_accumulate(y, x, pool, plan, backend) for y, pool in zip(ys, module_pools))
    import pallas_kernels

    impl = _pallas_impl(_PALLAS_BACKENDS[backend])
    rows = x.reshape(-1, x.shape[-1])
    outs, entries = [], [_entries(pool) for pool in module_pools]
    for y, (a, b, rank, scale, offset) in zip(ys, entries):
        out = y.reshape(-1, y.shape[-1]).astype(_F32)
        if plan.seg_starts is not None:
            out = pallas_kernels.sgmv_lora_stacked(out, rows, a, b, plan.seg_starts, plan.seg_slot, rank, scale,
                                                   offset, impl=impl)
        outs.append(out)
    lora_as, lora_bs, ranks, scales = ([e[i] for e in entries] for i in range(4))
    outs = pallas_kernels.bgmv_lora_grouped(outs, rows, lora_as, lora_bs, plan.decode_slot, ranks, scales,
                                            entries[0][4], impl=impl)
    return tuple(out.reshape(y.shape) for out, y in zip(outs, ys))


def _route(backend: str, plan) -> str:
    """The backend a "hybrid" call runs: "pallas" for a decode-only `ServingPlan`, else "onehot"."""
    if backend != "hybrid":
        return backend
    return "pallas" if isinstance(plan, ServingPlan) and plan.seg_starts is None else "onehot"


def _entries(module_pool):
    """(a [P, k, r], b [P, r, n], rank [P], scale [P], int32 offset of the layer's first entry) of
    a `StackedModulePool` (flattened, no copy) or of a layer's dict (offset 0)."""
    if isinstance(module_pool, StackedModulePool):
        a, b, rank, scale, offset = module_pool.entries()
    else:
        a, b, rank, scale, offset = module_pool["a"], module_pool["b"], module_pool["rank"], module_pool["scale"], 0
    return a, b, rank, scale, jnp.asarray(offset, jnp.int32)


def lora_delta(x: jax.Array, module_pool: dict, plan: LoraPlan, backend: str = "gather") -> jax.Array:
    """LoRA output of one projection of one layer.

    Args:
      x: [..., k] activations in batch order (N rows once flattened).
      module_pool: {"a": [slots, k, r], "b": [slots, r, n], "scale": [slots], "rank": [slots]}
        (or a `StackedModulePool`, sliced here to its layer).
      plan: the batch's `LoraPlan` (or the serving engine's `ServingPlan`) over the same N rows.
      backend: one of BACKENDS ("ragged_dot" needs a `LoraPlan`).

    Returns:
      [..., n] in x's dtype; zero for rows whose slot is -1.
    """
    if backend not in BACKENDS or backend in FUSED_BACKENDS:
        raise ValueError(f"unknown LoRA backend {backend!r}; choose from {BACKENDS}")
    backend = _route(backend, plan)
    lead_shape = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    delta = _BACKEND_FNS[backend](rows, _layer_pool(module_pool), plan)
    return delta.reshape(*lead_shape, delta.shape[-1]).astype(x.dtype)


def _row_scale(module_pool: dict, token_slot: jax.Array) -> jax.Array:
    """[N] scale of each row's adapter, 0 for base rows."""
    return jnp.where(token_slot >= 0, module_pool["scale"][jnp.maximum(token_slot, 0)], 0.0)


def _loop(rows, module_pool, plan):
    a, b, scale = module_pool["a"], module_pool["b"], module_pool["scale"]
    delta = jnp.zeros((rows.shape[0], b.shape[-1]), _F32)
    for slot in range(a.shape[0]):
        shrunk = jnp.dot(rows, a[slot], preferred_element_type=_F32)
        expanded = jnp.dot(shrunk, b[slot].astype(_F32), preferred_element_type=_F32)
        delta = delta + jnp.where((plan.token_slot == slot)[:, None], scale[slot] * expanded, 0.0)
    return delta


def _gather(rows, module_pool, plan):
    slot = jnp.maximum(plan.token_slot, 0)
    shrunk = jnp.einsum("nk,nkr->nr", rows, module_pool["a"][slot], preferred_element_type=_F32)
    shrunk = shrunk * _row_scale(module_pool, plan.token_slot)[:, None]
    return jnp.einsum("nr,nrm->nm", shrunk, module_pool["b"][slot].astype(_F32), preferred_element_type=_F32)


def _ragged_dot(rows, module_pool, plan):
    if not isinstance(plan, LoraPlan):
        raise ValueError("the ragged_dot backend needs a LoraPlan (build_plan), not a ServingPlan")
    a, b = module_pool["a"], module_pool["b"]
    num_slots = a.shape[0]
    group = jnp.where(plan.token_slot < 0, num_slots, plan.token_slot)
    group_sizes = jnp.bincount(group, length=num_slots + 1).astype(jnp.int32)
    a_ext = jnp.concatenate([a, jnp.zeros_like(a[:1])])
    b_ext = jnp.concatenate([b, jnp.zeros_like(b[:1])]).astype(_F32)
    grouped = rows[plan.perm]
    shrunk = jax.lax.ragged_dot(grouped, a_ext, group_sizes, preferred_element_type=_F32)
    shrunk = shrunk * _row_scale(module_pool, plan.token_slot[plan.perm])[:, None]
    expanded = jax.lax.ragged_dot(shrunk, b_ext, group_sizes, preferred_element_type=_F32)
    return expanded[plan.inv_perm]


def _onehot(rows, module_pool, plan):
    """Two GEMMs over every slot at once: [N, k] @ [k, S*r] -> keep each row's own slot (scaled),
    -> [N, S*r] @ [S*r, n]. Both through `dense` (inputs in the pool's dtype, float32 accumulation,
    bf16 backward GEMMs): float32 operands here made XLA run them as float32 GEMMs without tensor
    cores (11 ms of a 90 ms H200 training step, bench/NOTES_train.md)."""
    a, b = module_pool["a"], module_pool["b"]
    slots, k, r = a.shape
    selector = (plan.token_slot[:, None] == jnp.arange(slots)).astype(_F32)
    selector = selector * module_pool["scale"][None, :]
    shrunk_all = dense(rows, jnp.swapaxes(a, 0, 1).reshape(k, slots * r)).reshape(-1, slots, r)
    picked = (shrunk_all * selector[:, :, None]).reshape(-1, slots * r).astype(b.dtype)
    return dense(picked, b.reshape(slots * r, b.shape[-1]))


def _slot_rank_scale(module_pool: dict, slot: jax.Array):
    """(rank int32, scale float32) of each entry of `slot` (segments or rows); 0 where slot < 0."""
    valid, clamped = slot >= 0, jnp.maximum(slot, 0)
    rank = jnp.where(valid, module_pool["rank"][clamped], 0).astype(jnp.int32)
    return rank, jnp.where(valid, module_pool["scale"][clamped], 0.0).astype(_F32)


def _pallas_impl(impl: str | None) -> str:
    """The kernel style: `impl`, or the device's ("gpu"-style interpret mode on a CPU)."""
    if impl is None:
        impl = jax.default_backend() if jax.default_backend() in ("gpu", "tpu") else "gpu"
    return impl


def _pallas(rows, module_pool, plan, impl=None):
    impl = _pallas_impl(impl)
    if isinstance(plan, ServingPlan):
        delta = jnp.zeros((rows.shape[0], module_pool["b"].shape[-1]), _F32)
        return _pallas_serving(delta, rows, module_pool, plan, impl)
    import pallas_kernels

    seg_rank, seg_scale = _slot_rank_scale(module_pool, plan.seg_slot)
    grouped = rows[plan.perm]
    delta = pallas_kernels.sgmv_lora_delta(
        grouped, module_pool["a"], module_pool["b"], plan.seg_starts, plan.seg_slot, seg_rank, seg_scale,
        impl=impl,
    )
    return delta.astype(_F32)[plan.inv_perm]


def _pallas_serving(y, rows, module_pool, plan: ServingPlan, impl: str):
    """y [N, n] float32 plus the LoRA of rows [N, k] already in the plan's order: SGMV over the
    prefill segments (none in a decode-only step), then BGMV over the one-token rows, both in
    place on y (2 or 4 kernel launches, no gathers, no per-call rank/scale lookups: the kernels
    read them by slot; forward only: no VJP). module_pool: a layer's dict or a StackedModulePool."""
    import pallas_kernels

    a, b, rank, scale, offset = _entries(module_pool)
    if plan.seg_starts is not None:
        y = pallas_kernels.sgmv_lora_stacked(y, rows, a, b, plan.seg_starts, plan.seg_slot, rank, scale, offset,
                                             impl=impl)
    return pallas_kernels.bgmv_lora_stacked(y, rows, a, b, plan.decode_slot, rank, scale, offset, impl=impl)


_PALLAS_BACKENDS = {"pallas": None, "pallas_gpu": "gpu", "pallas_tpu": "tpu"}
_BACKEND_FNS = {
    "loop": _loop, "gather": _gather, "ragged_dot": _ragged_dot, "onehot": _onehot, "pallas": _pallas,
    "pallas_gpu": functools.partial(_pallas, impl="gpu"), "pallas_tpu": functools.partial(_pallas, impl="tpu"),
}
