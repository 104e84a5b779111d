"""Which adapter sits in which device pool slot, with LRU eviction (host bookkeeping, no JAX).

Adapters are identified by a key (any hashable; the engine uses a unique id per registered
adapter). A slot is *pinned* while running requests use its adapter: pinned slots are never
evicted. The caller does the actual device copy for every `(slot, key)` this class hands out.
A *fixed* key (`fix`) lives at a permanent slot outside the N (a compressed collection's adapter,
always on the device): it is never placed, loaded, pinned or evicted.
"""

from __future__ import annotations

import itertools


class AdapterSlots:
    """N slots; `acquire` places an adapter (free slot first, else the least recently used unpinned one)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.keys: list = [None] * num_slots  # written only here (`_set`), with `_slot_by_key`
        self._slot_by_key: dict = {}
        self._pins = [0] * num_slots
        self._last_used = [0] * num_slots
        self._clock = itertools.count(1)
        self.fixed: dict = {}

    def fix(self, key, slot: int) -> None:
        """Makes `key` permanently resident at `slot` (>= num_slots: outside the LRU slots)."""
        if slot < self.num_slots or slot in self.fixed.values():
            raise ValueError(f"fixed slot {slot} overlaps the LRU slots (0..{self.num_slots - 1}) or another key")
        self.fixed[key] = slot

    def slot_of(self, key) -> int | None:
        if key in self.fixed:
            return self.fixed[key]
        return self._slot_by_key.get(key)

    def _placed(self, key) -> int:
        """The slot of a placed key; ValueError if it has none."""
        slot = self._slot_by_key.get(key)
        if slot is None:
            raise ValueError(f"adapter {key!r} has no slot")
        return slot

    def _set(self, slot: int, key) -> None:
        """Puts `key` (None: nothing) in `slot`, keeping the key -> slot map."""
        old = self.keys[slot]
        if old is not None:
            del self._slot_by_key[old]
        self.keys[slot] = key
        if key is not None:
            self._slot_by_key[key] = slot

    def resident(self) -> list:
        return [key for key in self.keys if key is not None] + list(self.fixed)

    def victim(self, protect=()) -> int | None:
        """The slot to fill next: a free one, else the LRU unpinned one whose key is not in `protect`."""
        if len(self._slot_by_key) < self.num_slots:
            return self.keys.index(None)
        candidates = [s for s in range(self.num_slots) if self._pins[s] == 0 and self.keys[s] not in protect]
        return min(candidates, key=lambda s: self._last_used[s]) if candidates else None

    def can_place(self, key) -> bool:
        return self.slot_of(key) is not None or self.victim() is not None

    def place(self, key, protect=()) -> tuple[int, bool] | None:
        """(slot, whether it must be loaded) for `key`, without pinning; None if no slot can be had."""
        slot = self.slot_of(key)
        if slot is not None:
            return slot, False
        slot = self.victim(protect)
        if slot is None:
            return None
        self._set(slot, key)
        self._last_used[slot] = next(self._clock)
        return slot, True

    def pin(self, key) -> int:
        if key in self.fixed:
            return self.fixed[key]
        slot = self._placed(key)
        self._pins[slot] += 1
        self.touch(key)
        return slot

    def unpin(self, key) -> None:
        if key in self.fixed:
            return
        slot = self._placed(key)
        if self._pins[slot] == 0:
            raise ValueError(f"adapter {key!r} is not pinned")
        self._pins[slot] -= 1

    def touch(self, key) -> None:
        if key in self.fixed:
            return
        self._last_used[self._placed(key)] = next(self._clock)

    def pinned(self, key) -> bool:
        if key in self.fixed:
            return False
        slot = self.slot_of(key)
        return slot is not None and self._pins[slot] > 0

    def drop(self, key) -> int | None:
        """Forgets an unpinned adapter (its slot becomes free); returns the slot, or None if absent
        or fixed (a fixed key is forgotten; its slot holds nothing to evict)."""
        if self.fixed.pop(key, None) is not None:
            return None
        slot = self.slot_of(key)
        if slot is None:
            return None
        if self._pins[slot]:
            raise ValueError(f"adapter {key!r} is in use by running requests")
        self._set(slot, None)
        return slot
