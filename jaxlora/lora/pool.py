"""The device adapter pool: per target module and layer, stacked adapter weights in fixed slots.

Arrays (per module): a [L, slots, k, r_max], b [L, slots, r_max, n], scale [L, slots] float32,
rank [L, slots] int32 (0 = slot empty or layer not targeted). The layer axis leads so the pool
scans with the model's stacked layer weights.

Loading a slot is one jitted update of every module's arrays with the slot as a traced argument,
so one compile serves every slot (and eviction). With `donate=True` the pool's arrays are donated
to that update and written in place: arrays taken from `pool.arrays` before a load or eviction
are then invalid (read `pool.arrays` again after each). `prepare` validates an adapter once and
keeps it compact (`PreparedAdapter`: each module at its own rank) in the pool's dtype when that is
no wider than the dtype it was stored in (a float32 adapter for a bfloat16 pool is cast once, here,
not on every write; a bfloat16 adapter for a float32 pool stays bfloat16 on the host, half the
bytes). `padded` makes a slot's arrays from it: the compact arrays themselves when they are at the
pool's max rank and dtype (no copy), else padded with zeros and cast; a module the adapter does not
target is written from one slot's zeros kept on the device (`_zeros`). So a host that holds many
adapters holds their own bytes, not max-rank copies, and a load on the serving path copies nothing
on the host for a full-rank adapter (issue 34: a per-load float32 -> bfloat16 cast of 160 MB
adapters had tripled the mixed steps of the distinct-adapter trace).

With `pinned=True` a prepared adapter's A/B are jax arrays in the device's pinned (page-locked)
host memory, and every write copies them to the device first (`to_device`): a DMA at PCIe speed
instead of a staged copy of pageable memory (H200, jax 0.11.2, 84 MB: 2.1 ms pinned against
18.4 ms from numpy; `bench/h2d.py`). A GPU server's engine turns it on (`EngineConfig.
pinned_host_adapters`); without it the arrays are numpy and the jitted update takes them as they are.

With a `mesh` the arrays are placed by their logical axes (`jaxlora.nn.axes.pool_axes`;
S-LoRA: A of row-parallel layers split by input rows, B of column-parallel layers by output
columns) and the slot update keeps that placement (its outputs are pinned to it, so donation
still writes in place); each device receives only its part of a loaded slot."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.lora.adapter import LoraAdapter, check_finite
from jaxlora.lora.adapter_config import AdapterError
from jaxlora.nn.axes import ShardingRules, pool_axes, slot_axes
from jaxlora.nn.model_config import PROJECTIONS, LlamaConfig, projection_shapes

if TYPE_CHECKING:
    from jax.sharding import Mesh


def empty_pool_arrays(base: LlamaConfig, num_slots: int, max_rank: int, modules, dtype, device=None) -> dict:
    """The pool's arrays (module doc), zeros; `device`: a sharding to create them on (committed), else
    jax's default placement."""
    shapes = projection_shapes(base)
    layers = base.num_layers
    zeros = functools.partial(jnp.zeros, device=device)
    return {
        module: {
            "a": zeros((layers, num_slots, shapes[module][0], max_rank), dtype),
            "b": zeros((layers, num_slots, max_rank, shapes[module][1]), dtype),
            "scale": zeros((layers, num_slots), jnp.float32),
            "rank": zeros((layers, num_slots), jnp.int32),
        }
        for module in modules
    }


def _write_slot_impl(arrays: dict, slot, values: dict) -> dict:
    """`arrays` with slot `slot` (axis 1) of every array replaced by `values` (same tree, no slot axis)."""
    return jax.tree.map(
        lambda pool, value: jax.lax.dynamic_update_index_in_dim(pool, value.astype(pool.dtype), slot, axis=1),
        arrays, values)


# One compile per pool layout (shapes, dtypes), whatever the slot. The donated variant writes in place.
write_slot = jax.jit(_write_slot_impl)
write_slot_donated = jax.jit(_write_slot_impl, donate_argnums=(0,))

POOL_KEYS = ("a", "b", "scale", "rank")


@functools.lru_cache(maxsize=None)
def _placed_pool_fns(base: LlamaConfig, num_slots: int, max_rank: int, modules: tuple, dtype_name: str,
                     mesh: "Mesh", rules: ShardingRules, donate: bool):
    """(make the empty pool on `mesh`, the slot update that keeps its placement), jitted once per layout."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    def shardings(axes):
        return {m: {k: NamedSharding(mesh, rules.spec(axes(m, k))) for k in POOL_KEYS} for m in modules}

    pool = shardings(pool_axes)
    empty = jax.jit(lambda: empty_pool_arrays(base, num_slots, max_rank, modules, jnp.dtype(dtype_name)),
                    out_shardings=pool)
    write = jax.jit(_write_slot_impl, in_shardings=(pool, NamedSharding(mesh, P()), shardings(slot_axes)),
                    out_shardings=pool, donate_argnums=(0,) if donate else ())
    return empty, write


@dataclasses.dataclass(frozen=True)
class PreparedAdapter:
    """An adapter validated for one pool layout, compact (host arrays, no max-rank padding):
    values {module: {a [L, k, r_m], b [L, r_m, n] (r_m: the module's largest rank over layers; in
    the pool's dtype, or the adapter's stored dtype where that is narrower: `host_dtype`), scale [L]
    float32, rank [L] int32}} for the modules it targets. `AdapterPool.padded` makes the slot
    arrays from it."""

    name: str
    values: dict
    layout: tuple

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of its arrays (summed once: the host tiers ask for it every step, for every queued
        adapter, and a pinned host array's `nbytes` is a Python property: 1.6 ms a step on the
        2000-adapter trace, H200 profile of 2026-11-29)."""
        return sum(v.nbytes for parts in self.values.values() for v in parts.values())


class AdapterPool:
    """Fixed slots of adapter weights on the device, and which adapter holds which slot.

    donate: write loads and evictions in place (see the module doc); only for owners that read
    `pool.arrays` afresh after every load (the serving engine), not for holders of old arrays.
    mesh, rules: place the arrays on `mesh` by `rules` (default `ShardingRules()`; see the module doc)."""

    def __init__(self, base: LlamaConfig, num_slots: int, max_rank: int,
                 target_modules=PROJECTIONS, dtype=jnp.float32, donate: bool = False,
                 mesh: "Mesh | None" = None, rules: ShardingRules | None = None, pinned: bool = False):
        if num_slots < 1 or max_rank < 1:
            raise ValueError(f"num_slots and max_rank must be >= 1, got {num_slots}, {max_rank}")
        self.base = base
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.target_modules = tuple(target_modules)
        self.dtype = dtype
        self.donate = donate
        self.mesh = mesh
        self._set_host_memory(pinned)
        if mesh is None:  # committed to the device from the start, like every write's outputs: the slot update
            # that `Engine.warmup` compiles (an eviction) is then the one serving's writes call (issue 34)
            self.arrays = empty_pool_arrays(base, num_slots, max_rank, self.target_modules, dtype,
                                            self._device_sharding)
            self._update = write_slot_donated if donate else write_slot
        else:
            empty, self._update = _placed_pool_fns(base, num_slots, max_rank, self.target_modules,
                                                   np.dtype(dtype).name, mesh, rules or ShardingRules(), donate)
            self.arrays = empty()
        self.slot_names: list[str | None] = [None] * num_slots
        self.slot_writes = [0] * num_slots  # loads and evictions of each slot (copies of it go stale)
        self._empty: dict | None = None
        self._zero_slots: dict[str, dict] = {}  # module -> one slot's zeros, on the device (`_zeros`)

    def _set_host_memory(self, pinned: bool) -> None:
        """Where prepared adapters live on the host (module doc): `pinned` needs a pool on one device."""
        if pinned and self.mesh is not None:
            raise ValueError("pinned host adapters need a pool on one device (no mesh)")
        self.pinned = pinned
        device = jax.local_devices()[0]  # this process's first device (in a multi-process job jax.devices()[0]
        # may be another process's: arrays committed there would be unreachable, e.g. the trainer's pool)
        self._device_sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=device.default_memory().kind)
        self._host_sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host") if pinned else None

    def reserve_host(self, nbytes: int) -> int:
        """With pinned host copies, grows the pinned host allocator by `nbytes` now (one block
        allocated and freed: XLA's host allocator keeps the region it grew for later arrays), so
        adapters read while steps run do not grow it. Each growth is a `cuMemHostAlloc` of a region
        twice the last, ~0.1-0.8 s on an H200 at 0.1-1 GB, and it held up the engine thread's CUDA
        calls: the disk tier's trace lost ~2 s of its first steps to seven of them
        (bench/NOTES_serve.md, eighteenth session). Returns the bytes reserved (0 without pinned
        copies). The block's source is numpy zeros (untouched pages: no device memory, no fill)."""
        if self._host_sharding is None or nbytes <= 0:
            return 0
        block = jax.device_put(np.zeros(nbytes, np.uint8), self._host_sharding)
        block.block_until_ready()
        del block
        return nbytes

    def to_device(self, values: dict) -> dict:
        """`padded` slot arrays copied to the pool's device (asynchronously; pinned ones by DMA)."""
        return jax.device_put(values, self._device_sharding)

    def _hold(self, arrays: dict) -> dict:
        """A prepared adapter's A/B ({module: {"a", "b"}}) as the host holds them: numpy, or copies
        in pinned memory (one `device_put` for all: a reader thread beside the busy engine thread
        pays per call that releases the GIL, `jaxlora.lora.safetensors_io`)."""
        return arrays if self._host_sharding is None else jax.device_put(arrays, self._host_sharding)

    @property
    def layout(self) -> tuple:
        """What a PreparedAdapter must match to be loaded here without checks (not the dtype: one
        held in another dtype is cast when written)."""
        return (self.base, self.max_rank, self.target_modules)

    def slot_of(self, name: str) -> int | None:
        return self.slot_names.index(name) if name in self.slot_names else None

    def free_slot(self) -> int | None:
        return self.slot_of(None) if None in self.slot_names else None

    def prepare(self, adapter: LoraAdapter, check: bool = True) -> PreparedAdapter:
        """Validates `adapter` for this pool (AdapterError naming the problem) and keeps its arrays
        compact (own rank), cast once to `host_dtype` (not copied when already in it), ready for
        any number of `load`s. check=False skips the validation, for callers that ran equivalent
        checks themselves."""
        if check:
            self._validate(adapter)
        dtypes = {module: self.host_dtype(w.a.dtype) for module, w in adapter.modules.items()}
        held = self._hold({module: {"a": np.asarray(w.a, dtypes[module]), "b": np.asarray(w.b, dtypes[module])}
                           for module, w in adapter.modules.items()})
        values = {module: {**held[module], "scale": np.asarray(w.scale, np.float32),
                           "rank": np.asarray(w.rank, np.int32)} for module, w in adapter.modules.items()}
        return PreparedAdapter(adapter.name, values, self.layout)

    def host_dtype(self, stored) -> np.dtype:
        """The dtype a prepared adapter's A/B stored in `stored` are held in on the host: the pool's
        when it is no wider (cast once at `prepare`, none per write), else `stored` (narrower: fewer
        host bytes; cast when written)."""
        pool, stored = np.dtype(self.dtype), np.dtype(stored)
        return pool if pool.itemsize <= stored.itemsize else stored

    def padded(self, prepared: PreparedAdapter | None) -> dict:
        """One slot's arrays for every pool module from `prepared` (None: an empty slot): {module:
        {a [L, k, r_max], b [L, r_max, n] in the pool's dtype, scale [L], rank [L]}}, zeros past each
        module's rank and for modules it does not target. A module already at the max rank and in the
        pool's dtype is passed as it is (no host copy); one at a lower rank or in another dtype is
        padded on the host per write; a module it does not target is one slot's zeros kept on the
        device (`_zeros`), so a load ships no zeros from the host."""
        values = {} if prepared is None else prepared.values
        return {module: self._slot_values(values[module], module) if module in values else self._zeros(module)
                for module in self.target_modules}

    def _zeros(self, module: str) -> dict:
        """One slot's arrays of `module` for an adapter that does not target it (or an empty slot):
        zeros, made once per module and kept in device memory (~1-19 MB a module at the 8B shape and
        rank 16), so that writing them copies nothing from the host. A q/v adapter in a pool of all
        seven projections had shipped ~70 MB of pageable host zeros per load: ~11 ms of the engine
        thread a load in Compress-then-Serve's uncompressed run (H200, 2026-11-29,
        bench/NOTES_serve.md). Under a mesh: host zeros (the placed update splits host arrays itself)."""
        zeros = self._zero_slots.get(module)
        if zeros is None:
            zeros = self._slot_values(None, module)
            if self.mesh is None:
                zeros = jax.device_put(zeros, self._device_sharding)
            self._zero_slots[module] = zeros
        return zeros

    def load(self, adapter: LoraAdapter | PreparedAdapter, slot: int | None = None) -> int:
        """Puts `adapter` (or one `prepare`d for this pool) in `slot` (default: a free one) and
        returns the slot.

        Everything is checked before anything is written: on error the pool is unchanged."""
        slot = self._choose_slot(adapter, slot)
        if isinstance(adapter, PreparedAdapter):
            if adapter.layout != self.layout:
                raise AdapterError(f"adapter {adapter.name!r} was prepared for another pool layout")
            prepared = adapter
        else:
            prepared = self.prepare(adapter)
        self.write_padded(slot, prepared.name, self.padded(prepared))
        return slot

    def write_padded(self, slot: int, name: str, values: dict) -> None:
        """Writes `values` (`padded`'s arrays, on the host or already on the device) into `slot`
        under `name`, unchecked: for callers that padded a prepared adapter themselves (a
        background copy to the device)."""
        self._write(slot, values)
        self.slot_names[slot] = name

    def evict(self, slot: int) -> None:
        """Empties `slot` (rank 0, zero weights)."""
        if not 0 <= slot < self.num_slots:
            raise AdapterError(f"slot {slot} is outside the pool (0..{self.num_slots - 1})")
        if self._empty is None:
            self._empty = self.padded(None)
        self._write(slot, self._empty)
        self.slot_names[slot] = None

    def window_source(self, slot: int) -> tuple[dict, int]:
        """(a pool holding `slot`'s adapter, its slot there) for the adapter window's copy: this one."""
        return self.arrays, slot

    def _on_device(self, values: dict) -> bool:
        """Whether every leaf of `values` is a jax array in the pool's device memory already (a
        prefetched copy, `serve.adapter_copies`): written as it is, with no second `device_put`."""
        kind = self._device_sharding.memory_kind
        return all(isinstance(leaf, jax.Array) and leaf.sharding.memory_kind == kind
                   for leaf in jax.tree.leaves(values))

    def _write(self, slot: int, values: dict) -> None:
        # Without a mesh every write takes device arrays (committed, as the pool's are): one compiled
        # update whatever mix of host, pinned and device-resident (`_zeros`) arrays `values` holds.
        if self.mesh is None and not self._on_device(values):
            values = self.to_device(values)
        self.arrays = self._update(self.arrays, np.int32(slot), values)
        self.slot_writes[slot] += 1

    def _choose_slot(self, adapter, slot: int | None) -> int:
        if slot is None:
            slot = self.slot_of(adapter.name)
            slot = self.free_slot() if slot is None else slot
            if slot is None:
                raise AdapterError(f"adapter pool is full ({self.num_slots} slots): evict one first")
        if not 0 <= slot < self.num_slots:
            raise AdapterError(f"slot {slot} is outside the pool (0..{self.num_slots - 1})")
        return slot

    def _validate(self, adapter: LoraAdapter) -> None:
        extra = sorted(set(adapter.modules) - set(self.target_modules))
        if extra:
            raise AdapterError(f"adapter {adapter.name!r} targets {extra}, which this pool does not hold")
        if adapter.max_rank > self.max_rank:
            raise AdapterError(f"adapter {adapter.name!r} has rank {adapter.max_rank} > the pool's max rank "
                               f"{self.max_rank}")
        shapes = projection_shapes(self.base)
        for module, weights in adapter.modules.items():
            fan_in, fan_out = shapes[module]
            if weights.a.shape[:2] != (self.base.num_layers, fan_in) or weights.b.shape[::2] != (
                    self.base.num_layers, fan_out):
                raise AdapterError(f"adapter {adapter.name!r}: {module} weights have shapes {weights.a.shape} / "
                                   f"{weights.b.shape}, which do not fit the base model")
        check_finite(adapter, f"adapter {adapter.name!r}")

    def _slot_values(self, compact: dict | None, module: str) -> dict:
        """One slot's host arrays for `module` from its compact arrays (`PreparedAdapter.values[
        module]`; None: zeros), padded to the pool's max rank in the pool's dtype."""
        layers, shapes = self.base.num_layers, projection_shapes(self.base)[module]
        dtype = np.dtype(self.dtype)
        if compact is not None and compact["a"].shape[2] == self.max_rank and compact["a"].dtype == dtype \
                and compact["b"].dtype == dtype:
            return compact
        a = np.zeros((layers, shapes[0], self.max_rank), dtype)
        b = np.zeros((layers, self.max_rank, shapes[1]), dtype)
        scale = np.zeros(layers, np.float32)
        rank = np.zeros(layers, np.int32)
        if compact is not None:
            width = compact["a"].shape[2]
            a[:, :, :width], b[:, :width] = np.asarray(compact["a"]), np.asarray(compact["b"])
            scale, rank = compact["scale"], compact["rank"]
        return {"a": a, "b": b, "scale": scale, "rank": rank}
