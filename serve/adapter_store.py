"""The adapter store: every adapter a server knows, and the disk and host tiers that hold them (S-LoRA).

Tiers (the device tier is the engine's pool slots, `jaxlora.lora.pool`):
  - disk: the folder an adapter was registered from, or `directory` (`jaxlora-serve --adapter-dir`):
    any PEFT adapter folder directly under it is served by its folder name, looked up on the first
    request that names it (no scan at start; vLLM's runtime resolver, LoRAX's just-in-time
    loading). A name that is not a plain folder name, or a folder that resolves outside the
    directory (a symlink), is refused (`AdapterError`); a name without an adapter folder
    (no `adapter_config.json`) is unknown (`LookupError`).
  - host: an LRU cache of `PreparedAdapter`s (compact: each module at its own rank, in its stored
    dtype) bounded by `max_bytes` and/or `max_adapters`. An adapter registered without a path
    (`add(name, prepared)`, e.g. a library caller's `Engine(adapters=...)`) is held for good,
    outside the bound; every other one may be evicted and is read from disk again when needed.

Reads from disk run on `readers` background threads (`read(path, name) -> PreparedAdapter`, the
engine's PEFT loader and checks; several, so that one slow read does not hold the others). The
engine calls `want(uids)` every step with the adapters its queued requests need, in queue order:
that protects those already on the host (in order, while they fit in the bound) from eviction and
starts reads for the next ones that fit, so disk reads overlap the steps and a request whose
adapter is still being read waits without holding others back (the scheduler admits only requests
whose adapter is on the host or on the device; the engine keeps the host copy it found for the
step, so an eviction meanwhile cannot take it away). An adapter larger than `max_bytes` fails
with that reason. `ensure`
reads an adapter that has never been read (the HTTP handler awaits it before submitting, so a
corrupt or mismatched adapter fails its request with the reason, before any response is sent).
A read that fails marks the entry (`error`); the engine fails the requests naming it, and the
next lookup of that name reads it from disk afresh. The end of every read calls `on_read` (the
engine's wake-up: an engine whose queue waits only for reads sleeps until then, `Engine.stalled`).

The bound holds for what the cache holds, with the reads in flight (at most `readers`) on top;
the size of an adapter not read yet is estimated from its safetensors file, so an adapter larger
than its file (PEFT `layers_to_transform`, `rank_pattern`) can exceed the bound by the difference
until the next insert evicts. Thread-safe.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import os
import re
import threading
import time
from typing import Callable

import numpy as np

from jaxlora.lora.adapter_config import AdapterError
from jaxlora.lora.peft_io import CONFIG_FILE, WEIGHTS_FILE
from jaxlora.lora.pool import AdapterPool, PreparedAdapter
from jaxlora.nn.model_config import projection_shapes

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # a folder name: no separators, no leading dot
DISK_COUNT_TTL_S = 30.0  # how long a count of the directory's adapter folders is reused (/metrics)


@dataclasses.dataclass
class Entry:
    """A known adapter. path: its folder (None: held in host memory for good, `held`); fixed: served
    from a permanent device slot (a compressed collection), never read or cached here."""

    uid: int
    name: str
    path: str | None = None
    held: PreparedAdapter | None = None
    fixed: bool = False
    from_directory: bool = False
    removed: bool = False  # unregistered; the engine drops it once no request uses it
    error: str | None = None  # why its last read failed
    read_once: bool = False  # read from disk (or given) successfully at least once
    estimated_bytes: int | None = None  # its safetensors file's size, looked up once (`_estimate`)


@dataclasses.dataclass
class TierStats:
    """Loads per tier and their seconds (disk -> host here; host -> device counted by the engine)."""

    disk_reads: int = 0
    disk_read_seconds: float = 0.0
    disk_read_max_s: float = 0.0
    disk_read_errors: int = 0
    host_evictions: int = 0

    def record_read(self, seconds: float) -> None:
        self.disk_reads += 1
        self.disk_read_seconds += seconds
        self.disk_read_max_s = max(self.disk_read_max_s, seconds)


def largest_adapter_bytes(pool: AdapterPool, dtype) -> int:
    """Host bytes of the largest adapter `pool` accepts held in `dtype`: rank `max_rank` on every
    module of the pool and every layer (A, B, per-layer float32 scale and int32 rank)."""
    layers, itemsize = pool.base.num_layers, np.dtype(dtype).itemsize
    shapes = projection_shapes(pool.base)
    return sum(layers * ((shapes[m][0] + shapes[m][1]) * pool.max_rank * itemsize + 8) for m in pool.target_modules)


class AdapterStore:
    """Names -> entries, the LRU host cache over them and the background disk reader (module doc)."""

    def __init__(self, read: Callable[[str, str], PreparedAdapter], directory: str | None = None,
                 max_bytes: int | None = None, max_adapters: int | None = None, readers: int = 4):
        for label, bound in (("max_bytes", max_bytes), ("max_adapters", max_adapters)):
            if bound is not None and bound < 1:
                raise ValueError(f"{label} must be >= 1 (or None: unbounded), got {bound}")
        if directory is not None and not os.path.isdir(directory):
            raise ValueError(f"adapter directory {directory} does not exist or is not a directory")
        self._read = read
        self.directory = None if directory is None else os.path.realpath(directory)
        self.max_bytes, self.max_adapters = max_bytes, max_adapters
        self.stats = TierStats()
        self._lock = threading.RLock()
        self._by_name: dict[str, Entry] = {}
        self._by_uid: dict[int, Entry] = {}
        self._uids = itertools.count()
        self._cache: collections.OrderedDict[int, PreparedAdapter] = collections.OrderedDict()  # LRU first
        self._cached_bytes = 0
        self._protected: set[int] = set()
        self._reads: dict[int, concurrent.futures.Future] = {}
        self._reserved: dict[int, int] = {}  # uid -> estimated bytes of a read in flight
        self._reader = concurrent.futures.ThreadPoolExecutor(readers, thread_name_prefix="jaxlora-adapter-reader")
        self._disk_count: tuple[float, int] | None = None
        self.on_read: Callable[[], None] | None = None  # called when a read ends, ok or not (the engine's wake-up)

    # ---- registry -------------------------------------------------------------------------
    def add(self, name: str, prepared: PreparedAdapter | None = None, path: str | None = None,
            fixed: bool = False) -> Entry:
        """Registers `name` (ValueError if taken): from `path` (evictable; `prepared`, if given, goes
        into the host cache now), held for good (`prepared` without a path), or `fixed`."""
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"an adapter named {name!r} is already loaded")
            entry = Entry(next(self._uids), name, path=path, held=None if path else prepared, fixed=fixed,
                          read_once=prepared is not None or fixed)
            self._register(entry)
            if path is not None and prepared is not None:
                self._insert(entry.uid, prepared)
            return entry

    def _register(self, entry: Entry) -> None:
        self._by_name[entry.name] = entry
        self._by_uid[entry.uid] = entry

    def remove(self, name: str) -> Entry:
        """Unregisters `name` (LookupError if unknown); the entry stays by uid until `drop`."""
        with self._lock:
            entry = self._by_name.pop(name, None)
            if entry is None:
                raise LookupError(name)
            entry.removed = True
            return entry

    def drop(self, uid: int) -> None:
        """Forgets a removed entry and its host copy (no request uses it any more)."""
        with self._lock:
            self._by_uid.pop(uid, None)
            self._evict(uid)

    def removed(self) -> list[Entry]:
        with self._lock:
            return [entry for entry in self._by_uid.values() if entry.removed]

    def names(self) -> list[str]:
        """Registered names (directory adapters once requested; not the whole directory)."""
        with self._lock:
            return list(self._by_name)

    def by_uid(self, uid: int) -> Entry | None:
        with self._lock:
            return self._by_uid.get(uid)

    def resolve(self, name: str) -> Entry:
        """The entry of `name`: registered, or a directory adapter registered now. LookupError if
        there is none; AdapterError for a name the directory refuses (see the module doc). An entry
        whose last read failed is replaced by a fresh one (read again when wanted)."""
        with self._lock:
            entry = self._by_name.get(name)
            if entry is not None and entry.error is not None and entry.from_directory:
                self._by_name.pop(name)
                entry.removed = True
                entry = None
            if entry is not None:
                return entry
            path = self._directory_path(name)
            entry = Entry(next(self._uids), name, path=path, from_directory=True)
            self._register(entry)
            return entry

    def _directory_path(self, name: str) -> str:
        """The adapter folder of `name` under the directory (see `resolve`)."""
        if self.directory is None:
            raise LookupError(name)
        if not NAME.fullmatch(name):
            raise AdapterError(f"{name!r} is not an adapter folder name (letters, digits, '.', '_', '-'; "
                               "no path separators, not starting with '.')")
        path = os.path.realpath(os.path.join(self.directory, name))
        if os.path.commonpath([path, self.directory]) != self.directory or path == self.directory:
            raise AdapterError(f"adapter {name!r} resolves outside the adapter directory")
        if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
            raise LookupError(name)
        return path

    def disk_count(self) -> int:
        """Adapter folders (with an adapter_config.json; not symlinks) directly under the directory;
        recounted at most every DISK_COUNT_TTL_S seconds."""
        if self.directory is None:
            return 0
        now = time.monotonic()
        if self._disk_count is None or now - self._disk_count[0] > DISK_COUNT_TTL_S:
            with os.scandir(self.directory) as items:
                count = sum(1 for item in items if item.is_dir(follow_symlinks=False) and os.path.isfile(
                    os.path.join(item.path, CONFIG_FILE)))
            self._disk_count = (now, count)
        return self._disk_count[1]

    # ---- host tier ------------------------------------------------------------------------
    def host(self, uid: int) -> PreparedAdapter | None:
        """The host copy of `uid` (marked recently used), None if it is not on the host."""
        with self._lock:
            entry = self._by_uid.get(uid)
            if entry is not None and entry.held is not None:
                return entry.held
            prepared = self._cache.get(uid)
            if prepared is not None:
                self._cache.move_to_end(uid)
            return prepared

    def on_host(self, uid: int) -> bool:
        with self._lock:
            entry = self._by_uid.get(uid)
            return entry is not None and (entry.held is not None or uid in self._cache)

    def error(self, uid: int) -> str | None:
        with self._lock:
            entry = self._by_uid.get(uid)
            return None if entry is None else entry.error

    def cached_bytes(self) -> int:
        with self._lock:
            return self._cached_bytes + sum(e.held.nbytes for e in self._by_uid.values() if e.held is not None)

    def on_host_count(self) -> int:
        with self._lock:
            return len(self._cache) + sum(1 for e in self._by_uid.values() if e.held is not None)

    def want(self, uids: list[int]) -> None:
        """The adapters queued requests need, in queue order (engine thread, every step): protects
        those on the host while they fit in the bound and starts disk reads for the next ones that
        fit (the rest wait for room)."""
        with self._lock:
            self._protected = set()
            room_bytes, room_count = self.max_bytes, self.max_adapters
            for uid in dict.fromkeys(uids):
                entry = self._by_uid.get(uid)
                if entry is None or entry.held is not None or entry.fixed or entry.error is not None:
                    continue
                size = self._cache[uid].nbytes if uid in self._cache else self._reserved.get(uid)
                size = self._estimate(entry) if size is None else size
                if self.max_bytes is not None and size > self.max_bytes:
                    entry.error = (f"adapter {entry.name!r} needs {size} bytes of host memory, more than the "
                                   f"host cache bound of {self.max_bytes} bytes")
                    continue
                if not self._fits(size, room_bytes, room_count):
                    break
                room_bytes = None if room_bytes is None else room_bytes - size
                room_count = None if room_count is None else room_count - 1
                if uid in self._cache:
                    self._protected.add(uid)
                else:
                    self._start_read(entry, size)

    @staticmethod
    def _fits(size: int, room_bytes: int | None, room_count: int | None) -> bool:
        return (room_bytes is None or size <= room_bytes) and (room_count is None or room_count >= 1)

    def ensure(self, name: str) -> concurrent.futures.Future | None:
        """A future of the first read of `name` (resolved: see `resolve`), None if it was read
        before or is held; the future raises the read's AdapterError."""
        with self._lock:
            entry = self.resolve(name)
            if entry.read_once or entry.fixed or entry.held is not None:
                return None
            return self._start_read(entry, self._reserved.get(entry.uid) or self._estimate(entry))

    def _estimate(self, entry: Entry) -> int:
        """Bytes the host copy of `entry` will take: its safetensors file's size (looked up once per
        entry: `want` asks for every queued adapter at every step)."""
        if entry.estimated_bytes is None:
            try:
                entry.estimated_bytes = os.path.getsize(os.path.join(entry.path, WEIGHTS_FILE))
            except OSError:
                return 0  # the read will fail and say why
        return entry.estimated_bytes

    def _start_read(self, entry: Entry, size: int) -> concurrent.futures.Future:
        future = self._reads.get(entry.uid)
        if future is None:
            self._reserved[entry.uid] = size
            future = self._reads[entry.uid] = self._reader.submit(self._read_entry, entry)
        return future

    def _read_entry(self, entry: Entry) -> PreparedAdapter:
        """`_read_to_cache`, then tells `on_read` (the engine may be waiting for it, `Engine.stalled`)."""
        try:
            return self._read_to_cache(entry)
        finally:
            if self.on_read is not None:
                self.on_read()

    def _read_to_cache(self, entry: Entry) -> PreparedAdapter:
        """Reads `entry` from disk into the cache (reader thread); marks it failed on AdapterError."""
        started = time.perf_counter()
        try:
            prepared = self._read(entry.path, entry.name)
        except Exception as err:
            message = str(err) if isinstance(err, AdapterError) else f"{type(err).__name__}: {err}"
            with self._lock:
                entry.error = message
                self.stats.disk_read_errors += 1
                self._finish_read(entry.uid)
            raise AdapterError(message) from err
        with self._lock:
            self.stats.record_read(time.perf_counter() - started)
            entry.read_once, entry.error = True, None
            self._finish_read(entry.uid)
            if entry.uid in self._by_uid:
                self._insert(entry.uid, prepared)
                self._protected.add(entry.uid)  # room was kept for it: wanted until the next `want`
        return prepared

    def _finish_read(self, uid: int) -> None:
        self._reads.pop(uid, None)
        self._reserved.pop(uid, None)

    def _insert(self, uid: int, prepared: PreparedAdapter) -> None:
        """Puts `prepared` in the cache, evicting least recently used unprotected adapters until it
        fits (if only protected ones are left, it goes in over the bound; the next `want` shrinks
        the protected set)."""
        self._evict(uid)
        while self._cache and not self._room_for(prepared.nbytes):
            victim = next((u for u in self._cache if u not in self._protected), None)
            if victim is None:
                break
            self._evict(victim)
            self.stats.host_evictions += 1
        self._cache[uid] = prepared
        self._cached_bytes += prepared.nbytes

    def _room_for(self, size: int) -> bool:
        return ((self.max_bytes is None or self._cached_bytes + size <= self.max_bytes)
                and (self.max_adapters is None or len(self._cache) + 1 <= self.max_adapters))

    def _evict(self, uid: int) -> None:
        prepared = self._cache.pop(uid, None)
        if prepared is not None:
            self._cached_bytes -= prepared.nbytes

    def close(self) -> None:
        """Stops the reader threads (reads in flight finish first)."""
        self._reader.shutdown(wait=True, cancel_futures=True)
