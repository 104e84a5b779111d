"""Host -> device copies of prefetched adapters (S-LoRA's prefetch of queued requests' adapters).

The scheduler places the adapters of queued requests in device slots ahead of their first step
(`prefetch`); `StagedCopies` copies them to the device while steps run and writes each into its
slot at the start of a later step: every copy that is done, and those the step's rows need.

Two ways to copy, chosen once from the pool:
- pinned host copies (a GPU server's default, `AdapterPool.pinned`): the copy is a DMA that
  `jax.device_put` starts and returns from at once, so it is issued on the engine thread, with no
  helper thread. A needed copy is written into its slot without waiting on the host: the slot
  update runs on the device after the DMA (stream order), so the host never blocks on it.
  (A helper thread here had the copies wait for the GIL behind the engine thread's dispatch:
  ~8 ms a copy in the distinct-adapter trace against 2.1 ms of DMA, and 0.3 s of a 4.7 s run
  spent in `commit` waiting for them; bench/NOTES_serve.md, issue 34.)
- pageable numpy host copies: `device_put` stages the bytes on the calling thread, so those copies
  run on one background thread (`_prefetch_thread`) and a needed one is waited for.

Copies issued but not yet written into their slots hold device memory: at most `max_bytes` of
them are in flight (at least one copy), the rest wait in queue order."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import time
from typing import Callable

import jax

log = logging.getLogger(__name__)

# Device bytes that issued, not yet written copies may hold: 12 adapters of the 8B shape at r=16
# (~26 ms of DMA on an H200), enough for the new adapters of a 2048-token mixed step (at most 16,
# ~9 in the distinct trace) to be on their way during the step before it; copies are issued only
# between steps (the engine thread waits for each step's tokens), so a smaller bound left the
# next mixed step waiting for its copies on the device.
DEFAULT_MAX_BYTES = 1 << 30


class _DeviceCopy:
    """A copy started with `jax.device_put` (asynchronous): done once every array is on the device."""

    def __init__(self, values: dict):
        self._values = values

    def done(self) -> bool:
        return all(leaf.is_ready() for leaf in jax.tree.leaves(self._values) if isinstance(leaf, jax.Array))

    def result(self) -> dict:
        return self._values


class _FailedCopy:
    """A copy that could not start: done, and its result raises (the slot is loaded from the host)."""

    def __init__(self, error: Exception):
        self._error = error

    def done(self) -> bool:
        return True

    def result(self) -> dict:
        raise self._error


@dataclasses.dataclass
class Staged:
    """One prefetched adapter: its uid, host copy (`PreparedAdapter`), the copy to its device slot
    (None until issued: `_DeviceCopy` or a Future of the slot's device arrays) and when it began."""

    uid: object
    prepared: object
    copy: object = None
    issued: float = 0.0


def start_copy(pool, prepared, stats) -> object:
    """Starts copying `prepared`'s slot arrays (`pool.padded`) to the pool's device: a `_DeviceCopy`
    for a pinned pool (the DMA runs while this returns), else a Future on the prefetch thread; a
    `_FailedCopy` when it cannot start."""
    try:
        if pool.pinned:
            return _DeviceCopy(pool.to_device(pool.padded(prepared)))
        return _prefetch_thread().submit(_to_device, pool, prepared, stats)
    except Exception as err:
        log.exception("starting a prefetch copy failed")
        return _FailedCopy(err)


class StagedCopies:
    """The slots whose prefetched adapters are on their way to the device (module doc).

    pool: the engine's `AdapterPool` (or `RowPool`); stats: `EngineStats` (copy times); max_bytes:
    the bound on issued copies not yet written into their slots."""

    def __init__(self, pool, stats, max_bytes: int = DEFAULT_MAX_BYTES):
        self.pool, self.stats, self.max_bytes = pool, stats, max_bytes
        self.staged: dict[int, Staged] = {}

    def __contains__(self, slot: int) -> bool:
        return slot in self.staged

    def stage(self, loads, host_copy: Callable) -> None:
        """Queues the copies of `loads` [(slot, uid)] (host copies from `host_copy(uid)`) and issues
        as many as the bound allows."""
        for slot, uid in loads:
            self.staged[slot] = Staged(uid, host_copy(uid))
        self.issue()

    def drop(self, slot: int) -> None:
        """Forgets `slot`'s copy (its adapter left the slot, or it is loaded directly)."""
        self.staged.pop(slot, None)

    def in_flight_bytes(self) -> int:
        return sum(entry.prepared.nbytes for entry in self.staged.values() if entry.copy is not None)

    def issue(self) -> None:
        """Starts the queued copies, in queue order, while the in-flight bytes stay within
        `max_bytes` (one copy always may start)."""
        in_flight = self.in_flight_bytes()
        for entry in self.staged.values():
            if entry.copy is not None:
                continue
            size = entry.prepared.nbytes
            if in_flight and in_flight + size > self.max_bytes:
                break
            entry.copy, entry.issued = start_copy(self.pool, entry.prepared, self.stats), time.perf_counter()
            in_flight += size

    def commit(self, needed) -> None:
        """Writes staged adapters into their slots: every copy that is done, and those of the slots in
        `needed` (the step's rows use them; a pinned copy is written without waiting on the host, a
        thread's copy is waited for, one not issued yet is copied now). A failed copy: the host
        arrays are loaded instead. Then issues the queued copies the freed bytes allow."""
        ready = [slot for slot, entry in self.staged.items()
                 if slot in needed or (entry.copy is not None and entry.copy.done())]
        for slot in ready:
            entry = self.staged.pop(slot)
            try:
                if entry.copy is None:
                    entry.copy, entry.issued = start_copy(self.pool, entry.prepared, self.stats), time.perf_counter()
                values = entry.copy.result()
                self.pool.write_padded(slot, entry.prepared.name, values)
                if isinstance(entry.copy, _DeviceCopy):  # issue -> written: the thread's copies time themselves
                    self.stats.record_device_load(time.perf_counter() - entry.issued)
            except Exception:
                log.exception("prefetch copy failed; loading from host memory")
                self.pool.load(entry.prepared, slot=slot)
        if ready:
            self.issue()


@functools.lru_cache(maxsize=1)
def _prefetch_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread (shared by engines, first come first served) that copies pageable adapters."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxlora-prefetch")


def _to_device(pool, adapter, stats) -> dict:
    """`adapter`'s slot arrays (`pool.padded`) copied to the pool's device (on the prefetch thread)."""
    started = time.perf_counter()
    values = jax.block_until_ready(pool.to_device(pool.padded(adapter)))
    stats.record_device_load(time.perf_counter() - started)
    return values
