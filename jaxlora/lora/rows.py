"""The paged device adapter pool (S-LoRA unified paging): adapter weights in rows, not max-rank slots.

Per target module (`jaxlora.lora.paged_ops` holds the layout and the math over it):
  a_rows [L, R, k], b_rows [L, R, n] in the pool's dtype: rank row j of an adapter is A[:, j] (a row
    of k) and B[j, :] (a row of n), at the same row id in every module and layer;
  table [L, slots, max_rank] int32: the row ids of each slot's adapter (one table, shared by the
    modules, repeated per layer so the layer scan slices it as it slices the rest);
  rank [L, slots] int32, scale [L, slots] float32 as in `jaxlora.lora.pool`.
An adapter of rank r takes exactly r rows (r = its largest rank over modules and layers), handed out
by the unified allocator (`jaxlora.scheduler.serving.unified.UnifiedPages(num_rows=R)`) from the
same budget as the KV pages; after frees they are scattered, which the kernels do not mind (they
read each row through the table). A slot is only a table entry: `num_slots` bounds the adapters
resident at once, R the rows they hold together.

Layout choice: S-LoRA's pool stores A and B rows in the KV cache's own buffers (a row of H*D, which
every target of its Llama-7B has as fan-in and fan-out). Here fan-ins and fan-outs differ per module
(GQA k/v outputs, the MLP's ffn width), so each module has an A-row and a B-row array of its own
widths, indexed by the same row ids; the byte budget is shared with KV (one allocator), the arrays
are not (one buffer for both would need one row width for KV and every module).

`RowPool` keeps `AdapterPool`'s interface for the engine (prepare, load into a slot, evict,
write_padded of `padded` arrays): the rows a slot's adapter gets come from `rows_of(slot)`, the
caller's (the engine: the allocator's rows for the slot's adapter). Its `padded` arrays are the
prepared adapter's compact ones as they are (no max-rank padding on the host: a pinned host copy
goes to the device by DMA, with no numpy copy on the engine thread); one jitted, donated update
writes a slot's rows and table entry for every module (a program per rank and module widths)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.lora.pool import AdapterPool, PreparedAdapter
from jaxlora.nn.model_config import PROJECTIONS, LlamaConfig, projection_shapes


def adapter_rank(prepared: PreparedAdapter) -> int:
    """Rows an adapter takes: its largest rank over the modules it targets (>= 1)."""
    return max([1] + [int(parts["a"].shape[2]) for parts in prepared.values.values()])


def empty_row_arrays(base: LlamaConfig, num_slots: int, max_rank: int, num_rows: int, modules, dtype, device=None):
    """({module: {"a_rows", "b_rows", "rank", "scale"}}, table [L, slots, max_rank]) all zeros; `device`:
    a sharding to create them on (committed), else jax's default placement."""
    shapes, layers = projection_shapes(base), base.num_layers
    zeros = functools.partial(jnp.zeros, device=device)
    modules = {module: {"a_rows": zeros((layers, num_rows, shapes[module][0]), dtype),
                        "b_rows": zeros((layers, num_rows, shapes[module][1]), dtype),
                        "rank": zeros((layers, num_slots), jnp.int32),
                        "scale": zeros((layers, num_slots), jnp.float32)} for module in modules}
    return modules, zeros((layers, num_slots, max_rank), jnp.int32)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def write_rows(modules: dict, table: jax.Array, slot, rows, table_row, values: dict):
    """(`modules`, `table`) with slot `slot`'s adapter written, in place (donated): rows [r] int32 its
    row ids (r: its rank, >= every module's width), table_row [max_rank] int32 the slot's table
    entry (the rows, then zeros: masked by the rank), values {module: {"a" [L, k, w], "b" [L, w, n],
    "scale" [L], "rank" [L]}} compact (`RowPool.padded`: w the module's own rank, 0 for a module
    the adapter does not target; cast to the pool's dtype here). Rows past a module's width keep
    what they held: nothing reads them (the rank masks them)."""
    out = {}
    for module, pool in modules.items():
        value = values[module]
        width = value["a"].shape[2]
        out[module] = {
            "a_rows": pool["a_rows"].at[:, rows[:width]].set(jnp.swapaxes(value["a"], 1, 2).astype(pool["a_rows"].dtype)),
            "b_rows": pool["b_rows"].at[:, rows[:width]].set(value["b"].astype(pool["b_rows"].dtype)),
            "rank": pool["rank"].at[:, slot].set(value["rank"]),
            "scale": pool["scale"].at[:, slot].set(value["scale"]),
        }
    return out, table.at[:, slot].set(table_row)


@jax.jit
def slot_view(arrays: dict, slot) -> dict:
    """Slot `slot` as a one-slot padded pool {module: {"a" [L, 1, k, w], "b" [L, 1, w, n], "scale",
    "rank" [L, 1]}} (zeros past its rank): what `jaxlora.models.packed.fill_window_slot` copies."""
    out = {}
    for module, pool in arrays.items():
        table, rank = pool["table"][:, slot], pool["rank"][:, slot]  # [L, w], [L]
        live = (jnp.arange(table.shape[1])[None, :] < rank[:, None])[..., None]  # [L, w, 1]
        gather = jax.vmap(lambda rows, ids: rows[ids])
        a = jnp.where(live, gather(pool["a_rows"], table), 0)  # [L, w, k]
        b = jnp.where(live, gather(pool["b_rows"], table), 0)
        out[module] = {"a": jnp.swapaxes(a, 1, 2)[:, None], "b": b[:, None], "scale": pool["scale"][:, slot, None],
                       "rank": rank[:, None]}
    return out


class RowPool(AdapterPool):
    """Adapters as rows on one device (module doc). num_rows: R, the rows of every module's
    arrays; rows_of(slot) -> the row ids (rank order) of the adapter being written into `slot`."""

    def __init__(self, base: LlamaConfig, num_slots: int, max_rank: int, num_rows: int,
                 target_modules=PROJECTIONS, dtype=jnp.float32, rows_of=None, pinned: bool = False):
        if num_slots < 1 or max_rank < 1 or num_rows < max_rank:
            raise ValueError(f"num_slots and max_rank must be >= 1 and num_rows >= max_rank, got {num_slots}, "
                             f"{max_rank}, {num_rows}")
        self.base, self.num_slots, self.max_rank, self.num_rows = base, num_slots, max_rank, num_rows
        self.target_modules, self.dtype, self.donate, self.mesh = tuple(target_modules), dtype, True, None
        self._set_host_memory(pinned)
        self._modules, self._table = empty_row_arrays(base, num_slots, max_rank, num_rows, self.target_modules,
                                                      dtype, self._device_sharding)  # committed: `AdapterPool`'s why
        self.rows_of = rows_of
        self.slot_names: list[str | None] = [None] * num_slots
        self.slot_writes = [0] * num_slots
        self._empty: dict | None = None

    @property
    def arrays(self) -> dict:
        """{module: {"a_rows", "b_rows", "table", "rank", "scale"}} (`jaxlora.lora.paged_ops`): the
        one table in every module's dict. Read afresh after each write (writes donate the arrays)."""
        return {module: {**arrays, "table": self._table} for module, arrays in self._modules.items()}

    @property
    def row_bytes(self) -> int:
        """Device bytes of one row id: its A and B rows in every module and layer."""
        shapes = projection_shapes(self.base)
        width = sum(sum(shapes[module]) for module in self.target_modules)
        return width * self.base.num_layers * np.dtype(self.dtype).itemsize

    def padded(self, prepared: PreparedAdapter | None) -> dict:
        """One slot's arrays for every pool module, compact: {module: {a [L, k, w], b [L, w, n],
        scale [L], rank [L]}} with w the module's own width (`PreparedAdapter.values`: no max-rank
        padding, no host copy; rows hold exactly the rank), w = 0 for a module `prepared` does not
        target (None: an empty slot)."""
        values = {} if prepared is None else prepared.values
        return {module: values.get(module) or self._untargeted(module) for module in self.target_modules}

    def _untargeted(self, module: str) -> dict:
        """A module's compact arrays for an adapter that does not target it: width 0, rank 0."""
        (fan_in, fan_out), layers = projection_shapes(self.base)[module], self.base.num_layers
        dtype = np.dtype(self.dtype)
        return {"a": np.zeros((layers, fan_in, 0), dtype), "b": np.zeros((layers, 0, fan_out), dtype),
                "scale": np.zeros(layers, np.float32), "rank": np.zeros(layers, np.int32)}

    def evict(self, slot: int) -> None:
        """Empties `slot` (rank 0: nothing reads its rows, which the allocator may hand out again)."""
        self._write_rows(slot, [], self._empty_values())
        self.slot_names[slot] = None

    def _empty_values(self) -> dict:
        if self._empty is None:
            self._empty = self.padded(None)
        return self._empty

    def _write(self, slot: int, values: dict) -> None:
        """Writes `values` into the rows `rows_of(slot)` gives; none (the slot's adapter was evicted
        before a staged copy landed): the slot is emptied instead, so it never points at rows that
        another adapter may hold."""
        rows = self.rows_of(slot)
        width = max([0] + [int(parts["a"].shape[2]) for parts in values.values()])  # shapes: no device read
        if not rows:
            values = self._empty_values()
        elif len(rows) < width:
            raise ValueError(f"slot {slot}: {len(rows)} rows for an adapter of rank {width}")
        self._write_rows(slot, rows, values)

    def _write_rows(self, slot: int, rows, values: dict) -> None:
        if len(rows) > self.max_rank:
            raise ValueError(f"slot {slot}: {len(rows)} rows, more than the pool's max rank {self.max_rank}")
        table_row = np.zeros(self.max_rank, np.int32)
        table_row[:len(rows)] = rows
        if self.pinned and not self._on_device(values):
            values = self.to_device(values)
        self._modules, self._table = write_rows(self._modules, self._table, np.int32(slot),
                                                np.asarray(rows, np.int32), table_row, values)
        self.slot_writes[slot] += 1

    def window_source(self, slot: int) -> tuple[dict, int]:
        """(a padded pool holding `slot`'s adapter, its slot there), for the adapter window's copy."""
        return slot_view(self.arrays, np.int32(slot)), 0

