"""The LoRA computations over a paged adapter pool (`jaxlora.lora.rows.RowPool`, S-LoRA unified
paging): adapter weights as rows found through a row table instead of max-rank slots.

A paged module pool (one projection) is a dict with a leading layer axis:
  a_rows [L, R, k], b_rows [L, R, n]: rank row j of an adapter is A[:, j] as a row and B[j, :];
  table [L, slots, w] int32: slot s's rows (live for j < rank; the same in every layer);
  rank [L, slots] int32 (0: empty slot or layer not targeted), scale [L, slots] float32.
The engine's ServingPlan backends get it whole with the layer (`PagedModulePool`, the kernels read
the stack in place); the XLA backends get one layer's slice of it (the scan), made into the
padded slot view the delta functions of `jaxlora.lora.ops` take (`padded_view`: the rows of every
slot gathered, zeros past each rank; a transient per layer, not a second pool).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.paged_lora import bgmv_lora_paged, sgmv_lora_paged

PAGED_KEYS = ("a_rows", "b_rows", "table", "rank", "scale")


class PagedModulePool(NamedTuple):
    """One projection's paged pool for every layer (module doc) and the layer a call uses."""

    a_rows: jax.Array
    b_rows: jax.Array
    table: jax.Array
    rank: jax.Array
    scale: jax.Array
    layer: jax.Array

    def layer_pool(self) -> dict:
        """The layer's padded slot view (`padded_view`)."""
        return padded_view({key: getattr(self, key)[self.layer] for key in PAGED_KEYS})

    def flat(self):
        """(a_rows [L*R, k], b_rows [L*R, n], table [L*slots, w], rank [L*slots], scale [L*slots],
        row_offset, entry_offset) for the kernels: the stacks flattened (no copy)."""
        layers, rows = self.a_rows.shape[:2]
        slots = self.rank.shape[1]
        flat = lambda array: array.reshape(layers * array.shape[1], *array.shape[2:])
        return (flat(self.a_rows), flat(self.b_rows), flat(self.table), flat(self.rank), flat(self.scale),
                self.layer * rows, self.layer * slots)


def is_paged(arrays) -> bool:
    """Whether a module pool (dict or stacked record) is paged."""
    return isinstance(arrays, PagedModulePool) or (isinstance(arrays, dict) and "a_rows" in arrays)


def padded_view(layer_pool: dict) -> dict:
    """A layer's paged module pool as padded slots: {"a" [slots, k, w], "b" [slots, w, n], "scale",
    "rank" [slots]} with zeros past each slot's rank (the layout `jaxlora.lora.ops` computes on)."""
    table, rank = layer_pool["table"], layer_pool["rank"]
    live = jnp.arange(table.shape[1])[None, :] < rank[:, None]  # [slots, w]
    a = jnp.where(live[:, :, None], layer_pool["a_rows"][table], 0)  # [slots, w, k]
    b = jnp.where(live[:, :, None], layer_pool["b_rows"][table], 0)  # [slots, w, n]
    return {"a": jnp.swapaxes(a, 1, 2), "b": b, "scale": layer_pool["scale"], "rank": rank}


def sgmv(y, rows, module_pool: PagedModulePool, plan, style: str):
    """y [N, n] float32 plus the LoRA of the prefill segments of a `ServingPlan` with segments
    (rows [N, k] in its order), reading the adapters' rows through the table (paged SGMV,
    `pallas_kernels.paged_lora`); the one-token rows are `bgmv`'s."""
    a_rows, b_rows, table, rank, scale, row_offset, entry_offset = module_pool.flat()
    return sgmv_lora_paged(y, rows, a_rows, b_rows, plan.seg_starts, plan.seg_slot, table, rank, scale,
                           row_offset, entry_offset, impl=_impl(style))


def bgmv(y, rows, module_pool: PagedModulePool, row_slot, style: str):
    """y [N, n] float32 plus the LoRA of the rows whose slot `row_slot` [N] is >= 0 (paged BGMV)."""
    a_rows, b_rows, table, rank, scale, row_offset, entry_offset = module_pool.flat()
    return bgmv_lora_paged(y, rows, a_rows, b_rows, row_slot, table, rank, scale, row_offset, entry_offset,
                           impl=_impl(style))


def _impl(style: str) -> str:
    return "reference" if style == "tpu" else style  # no Mosaic kernel reads paged rows yet


def window_entries(module_pool: PagedModulePool, entry: jax.Array):
    """(a [L, w, k, r], b [L, w, r, n], rank [L, w], scale [L, w]) of slots `entry` [w] for every
    layer: their rows gathered through the table, zeros past each rank (the segment GEMM's window,
    `jaxlora.lora.ops._segment_window_arrays`)."""
    table = module_pool.table[:, entry]  # [L, w, r]
    rank = module_pool.rank[:, entry]
    live = (jnp.arange(table.shape[-1]) < rank[..., None])[..., None]  # [L, w, r, 1]
    gather = jax.vmap(lambda rows, ids: rows[ids])  # per layer: [R, d], [w, r] -> [w, r, d]
    a = jnp.where(live, gather(module_pool.a_rows, table), 0)
    b = jnp.where(live, gather(module_pool.b_rows, table), 0)
    return jnp.swapaxes(a, 2, 3), b, rank, module_pool.scale[:, entry]


def stacked(arrays: dict, layer: jax.Array) -> PagedModulePool:
    """A paged module pool dict (leading layer axes) at `layer`."""
    return PagedModulePool(layer=layer, **{key: arrays[key] for key in PAGED_KEYS})
