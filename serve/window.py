"""The serving engine's adapter window: which adapter each slot holds (host bookkeeping,
`WindowSlots`) and the copies of pool slots into it (on the device, `WindowFill`).

The window (`jaxlora.models.packed.add_adapter_window`) is a small cache over the adapter pool:
W slots whose adapters' A sit in extra columns of the packed base kernels and whose B sit in a
block-diagonal matrix per group, so a step whose rows use only window adapters needs no LoRA
kernel. A window slot holds a copy of one pool slot's contents as they were when copied, so an
entry is keyed by (pool slot, that slot's write count): a pool slot written again (another adapter
loaded, or evicted) no longer matches and its stale window entry is replaced in time.
"""

from __future__ import annotations

import threading

import numpy as np

from jaxlora.lora.pool import AdapterPool
from jaxlora.models.packed import AdapterWindow, fill_window_slot, window_keys
from serve.placement import abstract_state
from serve.stats import EngineStats


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


class WindowFill:
    """The engine's adapter window on the device: places a step's adapters in it, copying those
    not there yet out of the pool into the model's weights (`fill_window_slot`, in place).

    layout: the window's layout (`jaxlora.models.packed.window_layout`); num_slots: its slots;
    state: the engine's weight Variables (`nnx.State`; the window's kernels are written there);
    mixed_adapters: `EngineConfig.window_mixed_adapters`."""

    def __init__(self, layout: AdapterWindow, num_slots: int, pool: AdapterPool, state, stats: EngineStats,
                 mixed_adapters: int | None, split_layers: int = 0):
        self.layout = layout
        self.split_layers = split_layers  # the model's layers with weights of their own (`split_layers`), or 0
        self.keys = window_keys(layout, split_layers)  # the weights a fill writes
        self.window_slots = WindowSlots(num_slots)  # which pool slot each window slot holds
        self.pool = pool
        self.state = state
        self.stats = stats
        self.mixed_adapters = mixed_adapters
        self._program = None  # `fill_window_slot`, compiled by `program` (`Engine.warmup` or first use)
        self._compiling = threading.Lock()  # `program` on the start-up's thread and the engine's

    def place(self, slots: list[int], extra: tuple | None = None, prefill: bool = False) -> dict[int, int] | None:
        """{pool slot: window slot} for a step whose rows use the pool slots `slots` (and the window
        key `extra`: a mixed step's -ΔW branch, `EngineModes.delora_key`), copying the adapters not
        in the window yet into it (on the device, before the step); None when the step has no
        adapter, more adapters than the window holds, or (`prefill`: a step with a prefill row)
        more than `mixed_adapters`."""
        limit = self.mixed_adapters
        if prefill and extra is None and limit is not None and len(slots) > limit:
            return None
        wanted = [(slot, self.pool.slot_writes[slot]) for slot in slots] + ([] if extra is None else [extra])
        if not wanted:
            return None
        assigned = self.window_slots.assign(wanted)
        if assigned is None:
            if extra is not None:
                raise RuntimeError("a mixed step's adapters and -ΔW branch exceed the adapter window")
            return None
        placed, fills = assigned
        for window_slot, pool_slot in fills:
            self.fill(window_slot, pool_slot)
        return placed

    def fill(self, window_slot: int, pool_slot: int) -> None:
        """Copies pool slot `pool_slot` into window slot `window_slot` of the model's weights (in
        place: `fill_window_slot` donates them); a negative `pool_slot` -1 - s: slot s with its
        scale negated (the -ΔW branch of mixed steps, `serve.modes`)."""
        weights = self.state["weights"]
        args = self.fill_args(window_slot, pool_slot if pool_slot >= 0 else -1 - pool_slot)
        if pool_slot < 0:  # the -ΔW branch: the pool's scales negated
            args = (args[0], {name: {**arrays, "scale": -arrays["scale"]} for name, arrays in args[1].items()}, *args[2:])
        filled = self.program()(*args)
        for key in self.keys:
            weights[key].set_value(filled[key])
        self.stats.window_fills += 1

    def fill_args(self, window_slot: int, pool_slot: int) -> tuple:
        """`fill_window_slot`'s dynamic arguments: the window's weights, the pool, the two slots."""
        weights = self.state["weights"]
        pool, pool_slot = self.pool.window_source(pool_slot)
        return ({key: weights[key][...] for key in self.keys}, pool, np.int32(window_slot), np.int32(pool_slot))

    def program(self):
        """`fill_window_slot` compiled for this window (once, lowered over the arguments' shapes:
        `Warmup.start` compiles it beside the first step programs while the weights are written;
        a second caller waits for the first's compile)."""
        if self._program is not None:  # every fill after the first: no lock
            return self._program
        with self._compiling:
            if self._program is None:
                weights, pool, *slots = self.fill_args(0, 0)
                self._program = fill_window_slot.lower(self.layout, *abstract_state((weights, pool)), *slots,
                                                       split_layers=self.split_layers).compile()
            return self._program
