"""Which adapter each slot of the serving engine's adapter window holds (host bookkeeping).

The window (`jaxlora.models.packed.add_adapter_window`) is a small cache over the adapter pool:
W slots whose adapters' A sit in extra columns of the packed base kernels and whose B sit in a
block-diagonal matrix per group, so a step whose rows use only window adapters needs no LoRA
kernel. A window slot holds a copy of one pool slot's contents as they were when copied, so an
entry is keyed by (pool slot, that slot's write count): a pool slot written again (another adapter
loaded, or evicted) no longer matches and its stale window entry is replaced in time.
"""

from __future__ import annotations


class WindowSlots:
    """Assigns window slots to the pool slots a step needs: keeps those already there, fills the
    others into free or least recently used slots not needed by the step."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"an adapter window needs at least one slot, got {num_slots}")
        self.entries: list[tuple[int, int] | None] = [None] * num_slots  # (pool slot, write count)
        self._last_used = [0] * num_slots
        self._clock = 0

    @property
    def num_slots(self) -> int:
        return len(self.entries)

    def assign(self, wanted: list[tuple[int, int]]) -> tuple[dict[int, int], list[tuple[int, int]]] | None:
        """For the (pool slot, write count) pairs `wanted` (distinct pool slots): ({pool slot:
        window slot}, [(window slot, pool slot) to copy into the window now]); None if they are
        more than the window holds (the step runs the LoRA kernels instead)."""
        if len(wanted) > self.num_slots:
            return None
        self._clock += 1
        placed, fills = {}, []
        held = {entry: w for w, entry in enumerate(self.entries) if entry is not None}
        for key in wanted:
            if key in held:
                placed[key[0]] = held[key]
        keep = set(placed.values())
        for key in wanted:
            if key[0] in placed:
                continue
            w = self._victim(keep)
            self.entries[w] = key
            placed[key[0]] = w
            keep.add(w)
            fills.append((w, key[0]))
        for w in keep:
            self._last_used[w] = self._clock
        return placed, fills

    def _victim(self, keep: set[int]) -> int:
        """A free window slot, else the least recently used one outside `keep`."""
        free = [w for w, entry in enumerate(self.entries) if entry is None and w not in keep]
        if free:
            return free[0]
        return min((w for w in range(self.num_slots) if w not in keep), key=lambda w: self._last_used[w])
