"""The shared-basis LoRA backend (Compress-then-Serve): adapters of a compressed collection
computed from their cluster's shared bases and their own tiny core, mixed in one batch with
ordinary adapters of the device pool.

A compressed adapter j of cluster c has, per layer and module, ΔW_j = P_c Σ_j Q_c (P_c [k, r],
Q_c [r, n], Σ_j [r, r] or its diagonal [r]; scales folded in; see `jaxlora.compress`). Its rows
carry slot `slots + j` in the plan, past the pool's own slots, so one `LoraPlan` names both kinds.
Per projection:

  ordinary rows:    the pool's one-hot GEMMs (`ops.onehot_delta`), compressed rows masked out;
  compressed rows:  x @ [P_1 .. P_C] once for all rows (one GEMM, each cluster's shrink shared by
                    all its rows), each row keeps its cluster's r columns, times its own Σ_j
                    (a batched r x r product, or a scale for diagonal cores), placed back in its
                    cluster's columns, then @ [Q_1; ..; Q_C] (one GEMM).

Every cluster's shrink is computed for every row: static shapes, no per-step gathers of bases;
the bases are C*r columns, few next to a projection's width for the handful of clusters a
collection has. The arrays live in the pool dict next to each module's own
({"compressed_in" [L, k, C*r], "compressed_out" [L, C*r, n], "compressed_sigma" [L, M, r, r] or
[L, M, r] float32, "compressed_cluster" [L, M] int32}), so they scan with the layers and stay on
the device: nothing is loaded per request."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.lora import ops
from jaxlora.lora.plan import LoraPlan
from jaxlora.nn.layers import dense

KEYS = ("compressed_in", "compressed_out", "compressed_sigma", "compressed_cluster")
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class SharedBasisSet:
    """A compressed collection as the server holds it (host arrays): adapter names [M] in index
    order, their cluster [M], and per module {"basis_in" [L, C, k, r], "basis_out" [L, C, r, n],
    "sigma" [L, M, r, r] or [L, M, r]}."""

    names: tuple[str, ...]
    cluster: np.ndarray
    modules: dict

    def shapes(self) -> dict[str, tuple[int, int, int]]:
        """{module: (layers, in, out)} of the ΔW the set reconstructs."""
        return {m: (t["basis_in"].shape[0], t["basis_in"].shape[2], t["basis_out"].shape[3])
                for m, t in self.modules.items()}

    def device_arrays(self, dtype) -> dict:
        """{module: the four `KEYS` arrays} on the device, bases in `dtype` (the model's)."""
        layers = len(next(iter(self.modules.values()))["basis_in"])
        cluster = jnp.asarray(np.broadcast_to(self.cluster.astype(np.int32), (layers, len(self.cluster))))
        arrays = {}
        for module, tensors in self.modules.items():
            basis_in, basis_out = tensors["basis_in"], tensors["basis_out"]
            layers, clusters, k, r = basis_in.shape
            arrays[module] = {
                "compressed_in": jnp.asarray(np.transpose(basis_in, (0, 2, 1, 3)).reshape(layers, k, clusters * r), dtype),
                "compressed_out": jnp.asarray(basis_out.reshape(layers, clusters * r, -1), dtype),
                "compressed_sigma": jnp.asarray(tensors["sigma"], _F32),
                "compressed_cluster": cluster,
            }
        return arrays


def with_compressed(pool_arrays: dict, compressed: dict) -> dict:
    """The pool's arrays with each module's compressed arrays added (ValueError for a module the
    pool does not hold: its rows would have no projection to add to)."""
    missing = sorted(set(compressed) - set(pool_arrays))
    if missing:
        raise ValueError(f"the compressed adapters target {missing}, which the adapter pool does not hold")
    return {module: {**arrays, **compressed.get(module, {})} for module, arrays in pool_arrays.items()}


def compressed_delta(rows: jax.Array, module_pool: dict, plan: LoraPlan) -> jax.Array:
    """[N, n] float32 LoRA of rows [N, k]: ordinary pool slots and compressed adapters (slot
    `slots + j`) in one batch (see the module doc). module_pool: one layer's dict."""
    slots = module_pool["a"].shape[0]
    ordinary = plan._replace(token_slot=jnp.where(plan.token_slot < slots, plan.token_slot, -1))
    delta = ops.onehot_delta(rows, module_pool, ordinary)
    if "compressed_in" in module_pool:
        delta = delta + shared_basis_delta(rows, module_pool, plan.token_slot - slots)
    return delta


def shared_basis_delta(rows: jax.Array, module_pool: dict, index: jax.Array) -> jax.Array:
    """[N, n] float32: row t's P_c Σ_j Q_c applied for its compressed adapter j = index[t]
    (negative: none, zero delta)."""
    basis_in, basis_out = module_pool["compressed_in"], module_pool["compressed_out"]
    sigma, cluster = module_pool["compressed_sigma"], module_pool["compressed_cluster"]
    rank = sigma.shape[-1]
    clusters = basis_in.shape[-1] // rank
    valid = index >= 0
    adapter = jnp.where(valid, index, 0)
    row_cluster = jnp.where(valid, cluster[adapter], -1)
    in_cluster = (row_cluster[:, None] == jnp.arange(clusters)).astype(_F32)  # [N, C]; zero rows: none
    shrunk = dense(rows, basis_in).reshape(-1, clusters, rank)  # every cluster's x @ P_c
    picked = jnp.einsum("ncr,nc->nr", shrunk, in_cluster)
    core = sigma[adapter]
    mixed = picked * core if core.ndim == 2 else jnp.einsum("nr,nrs->ns", picked, core)
    placed = (in_cluster[:, :, None] * mixed[:, None, :]).reshape(-1, clusters * rank)
    return dense(placed.astype(basis_out.dtype), basis_out)
