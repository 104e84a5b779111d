"""The LoRA batch plan (ARCHITECTURE §3): which rows use which adapter slot, grouped by adapter.

Built once per step on the host with numpy, with static padded shapes (the number of segments is
padded to a bucket), so a new mix of adapters in the same bucket reuses the compiled step."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class LoraPlan(NamedTuple):
    """Arrays over the N flattened tokens of a batch (a pytree: pass it through jit).

    token_slot [N]: adapter slot of each token in batch order, -1 = base model only.
    perm [N]: grouped order -> batch row (rows of one slot contiguous; slots ascending, base last).
    inv_perm [N]: batch row -> grouped position.
    seg_starts [S+1], seg_slot [S]: segment i covers grouped rows seg_starts[i]:seg_starts[i+1] and
      uses slot seg_slot[i] (-1: base). Padding segments are empty, with slot -1.
    """

    token_slot: np.ndarray
    perm: np.ndarray
    inv_perm: np.ndarray
    seg_starts: np.ndarray
    seg_slot: np.ndarray


def segment_bucket(count: int, minimum: int = 4) -> int:
    return max(minimum, 1 << max(0, (count - 1).bit_length()))


def build_plan(token_slot, num_segments: int | None = None) -> LoraPlan:
    """Plan for per-token slots (any shape; flattened in C order).

    Args:
      token_slot: int array, the adapter slot of every token, -1 for the base model.
      num_segments: S, the padded number of segments (default: a power-of-two bucket).
    """
    token_slot = np.asarray(token_slot, np.int32).reshape(-1)
    sort_key = np.where(token_slot < 0, np.iinfo(np.int32).max, token_slot)
    perm = np.argsort(sort_key, kind="stable").astype(np.int32)
    inv_perm = np.empty_like(perm)
    inv_perm[perm] = np.arange(perm.size, dtype=np.int32)
    slots, counts = np.unique(token_slot[perm], return_counts=True)
    order = np.argsort(np.where(slots < 0, np.iinfo(np.int32).max, slots), kind="stable")
    slots, counts = slots[order], counts[order]
    num_segments = segment_bucket(len(slots)) if num_segments is None else num_segments
    if len(slots) > num_segments:
        raise ValueError(f"{len(slots)} distinct adapters do not fit in {num_segments} segments")
    seg_starts = np.full(num_segments + 1, token_slot.size, np.int32)
    seg_starts[0] = 0
    seg_starts[1: len(slots) + 1] = np.cumsum(counts)
    seg_slot = np.full(num_segments, -1, np.int32)
    seg_slot[: len(slots)] = slots
    return LoraPlan(token_slot, perm, inv_perm, seg_starts, seg_slot)
