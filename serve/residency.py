"""Adapter residency for the serving engine (S-LoRA's tiers): which adapters it knows and where each one
is, on disk, on the host or in a device slot.

`serve.adapter_store.AdapterStore` knows every adapter by name and holds the disk and host tiers:
adapters registered with a path or found in `EngineConfig.adapter_dir` on first request are read
by a background thread into a host cache bounded by `max_host_adapter_bytes` / `max_host_adapters`
(LRU; compact `PreparedAdapter`s: own rank, stored dtype), and read again when evicted; adapters
given without a path are held. Each step the engine tells the store which adapters the queued
requests need (`Residency.want`: disk reads overlap the steps) and the scheduler admits a request
only once its adapter is on the host or on the device (`Residency.ready`), so one whose adapter is
still being read waits without holding others back; a failed read ends the requests naming it
(finish reason "adapter_error"). The device `AdapterPool` holds N adapters and writes a slot in
place (one donated jitted update serves every slot), padding the host copy to its max rank only
for that write; with `EngineConfig.unified_paging` it is a `RowPool` instead: each adapter in
exactly its rank of device rows that the scheduler's unified allocator hands out
(`jaxlora.lora.rows`; the LoRA kernels read them through a row table). Adapters the scheduler
places are copied into their slots now (`load`) or prefetched on a background thread while a step
runs (`stage`, `serve.adapter_copies`), written into their slots at a step boundary (`commit_staged`).

`Residency` is owned by the `Engine` (`serve.engine`), which wires it to the scheduler (`ready`,
`adapter_pages`, `adapter_rows`). It never calls back into the engine: `want` returns the queued
sequences it refuses (their adapter failed to read) for the engine to end.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import jax
import numpy as np

from jaxlora.lora import backends
from jaxlora.lora.backends import LoraBackend
from jaxlora.lora.adapter import LoraAdapter, check_finite
from jaxlora.lora.compressed import SharedBasisSet, with_compressed
from jaxlora.lora.adapter_config import AdapterError
from jaxlora.lora.head import TaskHead, load_head
from jaxlora.lora.peft_io import load_peft_adapter
from jaxlora.lora.pool import AdapterPool, PreparedAdapter
from jaxlora.lora.rows import RowPool, adapter_rank
from jaxlora.nn.model_config import PROJECTIONS, projection_shapes
from jaxlora.scheduler.serving import Sequence, ServingScheduler, adapter_pages

from serve.adapter_copies import StagedCopies
from serve.adapter_store import AdapterStore
from serve.engine_config import EngineConfig, NoTaskHead, UnknownAdapter
from serve.stats import EngineStats


def adapter_pool(model, config: EngineConfig, mesh, compressed: SharedBasisSet | None,
                 rows_of: Callable[[int], list[int]]) -> AdapterPool:
    """The device adapter pool of an engine serving `model`: max-rank slots, or with unified paging
    rows (`RowPool`, whose rows for a slot are `rows_of(slot)`: those the scheduler's allocator
    gave the slot's adapter, `slot_rows`)."""
    targets = config.lora_target_modules or PROJECTIONS
    pinned = config.pinned_host_adapters
    if pinned is None:
        pinned = mesh is None and jax.default_backend() == "gpu"
    if not config.unified_paging:
        return AdapterPool(model.config, config.max_adapters_on_device, config.max_lora_rank, targets,
                           dtype=model.dtype, donate=True, mesh=mesh, pinned=pinned)
    if mesh is not None or compressed is not None:
        raise ValueError("unified_paging (adapters in device rows) serves on one device without a compressed "
                         "collection")
    rows = config.adapter_rows or config.max_adapters_on_device * config.max_lora_rank
    return RowPool(model.config, config.max_adapters_on_device, config.max_lora_rank, rows, targets,
                   dtype=model.dtype, rows_of=rows_of, pinned=pinned)


def slot_rows(scheduler: ServingScheduler, slot: int) -> list[int]:
    """The device rows the allocator gave the adapter now placed in `slot` (`RowPool.rows_of`); []
    when none is (a prefetched adapter evicted before its staged copy was written)."""
    key, pages = scheduler.slots.keys[slot], scheduler.pages
    return pages.rows_of(key) if key is not None and pages.holds(key) else []


def place_compressed(compressed: SharedBasisSet | None, mesh, backend: LoraBackend, model_config, dtype,
                     pool: AdapterPool) -> dict | None:
    """The compressed collection's device arrays, checked against the model, pool and backend."""
    if compressed is None:
        return None
    if not backend.shared_basis:
        raise ValueError(f"serving a compressed collection needs a shared-basis LoRA backend "
                         f"({', '.join(backends.names(shared_basis=True))}), not {backend.name!r}")
    if mesh is not None:
        raise ValueError("a compressed collection is served on one device (no tensor parallel)")
    shapes = projection_shapes(model_config)
    for module, shape in compressed.shapes().items():
        if shape != (model_config.num_layers, *shapes[module]):
            raise AdapterError(f"the compressed collection's {module} has (layers, in, out) {shape}, the base "
                               f"model {(model_config.num_layers, *shapes[module])}")
    arrays = compressed.device_arrays(dtype)
    with_compressed(pool.arrays, arrays)  # ValueError for a module the pool does not hold
    return arrays


class Residency:
    """The engine's adapters across disk, host and device (see the module doc).

    pool: the device pool (`adapter_pool`); compressed: the compressed collection's device arrays
    (`place_compressed`, None: none); page_bytes: bytes of one KV page on one device (unified
    paging counts adapters in KV pages); background_prefetch: prefetched copies run on a background
    thread (a device apart from the host and a pool without a mesh)."""

    def __init__(self, config: EngineConfig, model_config, dtype, pool: AdapterPool, compressed: dict | None,
                 scheduler: ServingScheduler, stats: EngineStats, page_bytes: int, tensor_parallel: int,
                 background_prefetch: bool):
        self.config = config
        self.model_config = model_config
        # reads an adapter folder (path, name) -> LoraAdapter, stored dtype kept (a VLM: `serve.vision`)
        self.load_adapter = lambda path, name: load_peft_adapter(path, self.model_config, name, keep_dtype=True,
                                                                 host_dtype=self.pool.host_dtype)
        self.dtype = dtype
        self.pool = pool
        self.compressed = compressed
        self.scheduler = scheduler
        self.stats = stats
        self.page_bytes = page_bytes
        self.tensor_parallel = tensor_parallel
        self.background_prefetch = background_prefetch
        self.store = AdapterStore(self.read, config.adapter_dir, config.max_host_adapter_bytes,
                                  config.max_host_adapters)
        self.copies = StagedCopies(pool, stats)  # prefetched adapters on their way to the device
        self._host_copies: dict = {}  # uid -> host copy of an adapter found ready this step
        self._heads: dict[int, TaskHead | None] = {}  # adapter uid -> its task head, once looked up
        self._lock = threading.Lock()

    # ---- the catalog (any thread) ---------------------------------------------------------------
    def add(self, name: str, adapter: LoraAdapter, path: str | None = None, head: TaskHead | None = None) -> None:
        """`Engine.add_adapter`: registers `adapter` under `name` (ValueError if taken, AdapterError if
        the pool cannot hold it)."""
        if name in self.store.names():
            raise ValueError(f"an adapter named {name!r} is already loaded")
        if head is not None:
            self.check_head(head)
        entry = self.store.add(name, self.prepare(adapter), path)
        if head is not None:
            with self._lock:
                self._heads[entry.uid] = head

    def register_compressed(self, name: str, index: int) -> None:
        """Registers adapter `index` of the compressed collection under `name`, in its fixed slot."""
        entry = self.store.add(name, fixed=True)
        self.scheduler.slots.fix(entry.uid, self.config.max_adapters_on_device + index)

    def task_head(self, name: str) -> TaskHead:
        """The task head of adapter `name` (read from its folder on first use): UnknownAdapter,
        AdapterError (a malformed head), or NoTaskHead."""
        entry = self.resolve(name)
        with self._lock:
            known = entry.uid in self._heads
            head = self._heads.get(entry.uid)
        if not known:
            head = None if entry.path is None else load_head(entry.path, self.model_config.hidden_size)
            if head is not None:
                self.check_head(head)
            with self._lock:
                self._heads[entry.uid] = head
        if head is None:
            raise NoTaskHead(f"the adapter {name!r} has no task head (no head_config.json in its folder)")
        return head

    def check_head(self, head: TaskHead) -> None:
        """AdapterError unless `head`'s weights [num_labels, hidden] and bias [num_labels] fit the model."""
        if head.weight.shape != (head.num_labels, self.model_config.hidden_size) or head.bias.shape != (head.num_labels,):
            raise AdapterError(f"task head weights {head.weight.shape}/{head.bias.shape} do not fit {head.num_labels} "
                               f"labels and hidden size {self.model_config.hidden_size}")

    def remove(self, name: str) -> None:
        """Forgets `name` (UnknownAdapter if absent); `drop_removed` frees it once no request uses it."""
        try:
            entry = self.store.remove(name)
        except LookupError:
            raise UnknownAdapter(name) from None
        with self._lock:
            self._heads.pop(entry.uid, None)

    def resolve(self, name: str):
        """The store entry of `name` (a directory adapter is registered now): UnknownAdapter if there
        is none, AdapterError for a name the directory refuses (`AdapterStore.resolve`)."""
        try:
            return self.store.resolve(name)
        except LookupError:
            raise UnknownAdapter(name) from None

    def read(self, path: str, name: str) -> PreparedAdapter:
        """Reads and checks one adapter folder for the store's reader thread (stored dtype kept;
        `load_peft_adapter` has checked that its weights are finite)."""
        adapter = self.load_adapter(path, name)
        self.check(adapter, finite=False)
        return self.pool.prepare(adapter, check=False)

    def check(self, adapter: LoraAdapter, finite: bool = True) -> None:
        """AdapterError unless `adapter` fits the pool (modules, rank, shapes; finite weights unless
        `finite` is False, for a caller that checked them)."""
        extra = sorted(set(adapter.modules) - set(self.pool.target_modules))
        if extra:
            raise AdapterError(f"adapter targets {extra}, which the pool does not hold")
        if adapter.max_rank > self.config.max_lora_rank:
            raise AdapterError(f"adapter rank {adapter.max_rank} exceeds the server's max LoRA rank "
                               f"{self.config.max_lora_rank}")
        shapes = projection_shapes(self.model_config)
        for module, weights in adapter.modules.items():
            fan_in, fan_out = shapes[module]
            layers = self.model_config.num_layers
            if weights.a.shape[:2] != (layers, fan_in) or weights.b.shape[::2] != (layers, fan_out):
                raise AdapterError(f"{module} weights {weights.a.shape}/{weights.b.shape} do not fit the base model")
        if finite:
            check_finite(adapter, "adapter")

    def prepare(self, adapter: LoraAdapter) -> PreparedAdapter:
        """`check`, then the adapter as the pool loads it (compact host arrays)."""
        self.check(adapter)
        return self.pool.prepare(adapter, check=False)  # check covers the pool's checks

    HOST_RESERVE_CAP = 4 << 30

    def reserve_host(self) -> int:
        """For an engine that reads adapters from a directory while it serves (`adapter_dir`) into
        pinned host copies: grows the pinned host allocator before the first step
        (`AdapterPool.reserve_host`) by the host tier's bound, else the device pool's bytes, at most
        HOST_RESERVE_CAP. Returns the bytes reserved (0: none)."""
        if self.config.adapter_dir is None or not self.pool.pinned:
            return 0
        bound = self.config.max_host_adapter_bytes
        if bound is None:
            bound = sum(leaf.nbytes for leaf in jax.tree.leaves(self.pool.arrays))
        return self.pool.reserve_host(min(bound, self.HOST_RESERVE_CAP))

    # ---- what a step reads (engine thread) --------------------------------------------------------
    def lora_arrays(self) -> dict:
        """The LoRA arrays a step reads: the pool's (read afresh: loads replace them), plus the
        compressed collection's."""
        return self.pool.arrays if self.compressed is None else with_compressed(self.pool.arrays, self.compressed)

    def adapter_pages(self, uid) -> int:
        """Unified paging (the scheduler's `adapter_pages`): pages of adapter `uid` at its own rank in
        the pool's dtype (r rows of A and of B per target module and layer; in a `RowPool` its r
        rows in every module the pool holds), in units of a KV page."""
        prepared = self.host_copy(uid)
        if isinstance(self.pool, RowPool):  # the rows it takes on the device, in every module of the pool
            return adapter_pages(adapter_rank(prepared) * self.pool.row_bytes, self.page_bytes)
        rows = sum(parts["a"].size + parts["b"].size for parts in prepared.values.values())
        return adapter_pages(rows * np.dtype(self.dtype).itemsize // self.tensor_parallel, self.page_bytes)

    def adapter_rows(self, uid) -> int:
        """The device rows adapter `uid` takes in a `RowPool` (its rank; the scheduler's `adapter_rows`)."""
        return adapter_rank(self.host_copy(uid))

    # ---- moving adapters between tiers (engine thread) ------------------------------------------------
    def new_step(self) -> None:
        """Forgets the last step's host copies (copied to the device by now)."""
        self._host_copies.clear()

    def want(self) -> list[tuple[Sequence, str]]:
        """Tells the store which adapters the queued requests need (queue order, those not on the
        device: it starts their disk reads); returns the queued sequences whose adapter failed to
        read, with the read's message, for the engine to end (finish reason "adapter_error")."""
        slots, store = self.scheduler.slots, self.store
        wanted = [seq.adapter for seq in self.scheduler.waiting
                  if seq.adapter is not None and slots.slot_of(seq.adapter) is None]
        store.want(wanted)
        errors = {uid: error for uid in set(wanted) if (error := store.error(uid)) is not None}
        if not errors:
            return []
        return [(seq, errors[seq.adapter]) for seq in self.scheduler.waiting if seq.adapter in errors]

    def ready(self, uid) -> bool:
        """The scheduler's `is_ready`: whether `uid` is on the host; if so its host copy is kept for
        this step (`host_copy`), so a reader thread evicting it meanwhile cannot take it away
        between admission and the copy to the device."""
        prepared = self.store.host(uid)
        if prepared is not None:
            self._host_copies[uid] = prepared
        return prepared is not None

    def host_copy(self, uid) -> PreparedAdapter:
        """The host copy of an adapter the scheduler placed this step (admitted or prefetched only
        when `ready`)."""
        prepared = self._host_copies.get(uid) or self.store.host(uid)
        if prepared is None:
            raise RuntimeError(f"adapter uid {uid} was placed in a device slot but is not on the host")
        return prepared

    def load(self, loads) -> None:
        """Copies the adapters of `loads` [(slot, uid)] into their slots now (synchronously)."""
        for slot, uid in loads:
            self.copies.drop(slot)
            started = time.perf_counter()
            self.pool.load(self.host_copy(uid), slot=slot)
            self.stats.record_device_load(time.perf_counter() - started)

    def stage(self, loads) -> None:
        """Prefetch: starts the host -> device copies of the adapters of `loads` [(slot, uid)]
        (`serve.adapter_copies`); `commit_staged` writes them into their slots. Without
        `background_prefetch` (a CPU backend, or a mesh: the placed pool's slot update splits the
        host arrays itself): `load`."""
        if not self.background_prefetch:
            self.load(loads)
            return
        self.copies.stage(loads, self.host_copy)

    def commit_staged(self, needed) -> None:
        """Writes prefetched adapters into their slots: those copied, and those of the slots in
        `needed` (the step's rows use them); see `StagedCopies.commit`."""
        self.copies.commit(needed)

    def drop_removed(self) -> None:
        """Frees the slots and host copies of removed adapters that no request still uses."""
        removed = self.store.removed()
        if not removed:
            return
        in_use = {s.adapter for s in self.scheduler.running + self.scheduler.waiting}
        for entry in removed:
            if entry.uid in in_use or self.scheduler.slots.pinned(entry.uid):  # pinned: an unfinished step reads it
                continue
            slot = self.scheduler.drop_adapter(entry.uid)
            if slot is not None:
                self.copies.drop(slot)
                self.pool.evict(slot)
            self.store.drop(entry.uid)

    def slot_adapters(self) -> list[str | None]:
        """The name of the adapter in each device pool slot (None: free), as the scheduler last
        placed them (read without stopping the engine; may be one step stale)."""
        entries = [None if key is None else self.store.by_uid(key) for key in list(self.scheduler.slots.keys)]
        return [None if entry is None else entry.name for entry in entries]
