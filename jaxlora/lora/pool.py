"""The device adapter pool: per target module and layer, stacked adapter weights in fixed slots.

Arrays (per module): a [L, slots, k, r_max], b [L, slots, r_max, n], scale [L, slots] float32,
rank [L, slots] int32 (0 = slot empty or layer not targeted). The layer axis leads so the pool
scans with the model's stacked layer weights."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxlora.lora.adapter import LoraAdapter, check_finite
from jaxlora.lora.config import AdapterError
from jaxlora.models.config import LlamaConfig
from jaxlora.models.llama import PROJECTIONS, projection_shapes


def empty_pool_arrays(base: LlamaConfig, num_slots: int, max_rank: int, modules, dtype) -> dict:
    shapes = projection_shapes(base)
    layers = base.num_layers
    return {
        module: {
            "a": jnp.zeros((layers, num_slots, shapes[module][0], max_rank), dtype),
            "b": jnp.zeros((layers, num_slots, max_rank, shapes[module][1]), dtype),
            "scale": jnp.zeros((layers, num_slots), jnp.float32),
            "rank": jnp.zeros((layers, num_slots), jnp.int32),
        }
        for module in modules
    }


class AdapterPool:
    """Fixed slots of adapter weights on the device, and which adapter holds which slot."""

    def __init__(self, base: LlamaConfig, num_slots: int, max_rank: int,
                 target_modules=PROJECTIONS, dtype=jnp.float32):
        if num_slots < 1 or max_rank < 1:
            raise ValueError(f"num_slots and max_rank must be >= 1, got {num_slots}, {max_rank}")
        self.base = base
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.target_modules = tuple(target_modules)
        self.dtype = dtype
        self.arrays = empty_pool_arrays(base, num_slots, max_rank, self.target_modules, dtype)
        self.slot_names: list[str | None] = [None] * num_slots

    def slot_of(self, name: str) -> int | None:
        return self.slot_names.index(name) if name in self.slot_names else None

    def free_slot(self) -> int | None:
        return self.slot_of(None) if None in self.slot_names else None

    def load(self, adapter: LoraAdapter, slot: int | None = None) -> int:
        """Puts `adapter` in `slot` (default: a free one) and returns the slot.

        Everything is checked before anything is written: on error the pool is unchanged."""
        slot = self._choose_slot(adapter, slot)
        self._validate(adapter)
        new_arrays = {}
        for module in self.target_modules:
            a, b, scale, rank = self._slot_values(adapter, module)
            current = self.arrays[module]
            new_arrays[module] = {
                "a": current["a"].at[:, slot].set(a),
                "b": current["b"].at[:, slot].set(b),
                "scale": current["scale"].at[:, slot].set(scale),
                "rank": current["rank"].at[:, slot].set(rank),
            }
        self.arrays = new_arrays
        self.slot_names[slot] = adapter.name
        return slot

    def evict(self, slot: int) -> None:
        """Empties `slot` (rank 0, zero weights)."""
        for module, arrays in self.arrays.items():
            self.arrays[module] = {key: value.at[:, slot].set(0) for key, value in arrays.items()}
        self.slot_names[slot] = None

    def _choose_slot(self, adapter: LoraAdapter, slot: int | None) -> int:
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

    def _slot_values(self, adapter: LoraAdapter, module: str):
        layers, shapes = self.base.num_layers, projection_shapes(self.base)[module]
        a = np.zeros((layers, shapes[0], self.max_rank), np.float32)
        b = np.zeros((layers, self.max_rank, shapes[1]), np.float32)
        scale = np.zeros(layers, np.float32)
        rank = np.zeros(layers, np.int32)
        if module in adapter.modules:
            weights = adapter.modules[module]
            width = weights.a.shape[2]
            a[:, :, :width], b[:, :width] = weights.a, weights.b
            scale, rank = weights.scale, weights.rank
        return (jnp.asarray(a, self.dtype), jnp.asarray(b, self.dtype),
                jnp.asarray(scale), jnp.asarray(rank))

