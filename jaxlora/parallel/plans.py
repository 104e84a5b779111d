"""LoRA plans per data shard: under shard_map every data shard groups its own rows by adapter, so
the plan's permutation and segments are local (built on the host, stacked on a leading axis)."""

from __future__ import annotations

import numpy as np

from jaxlora.lora.plan import LoraPlan, build_plan


def local_plans(token_slot, data_shards: int, num_segments: int) -> LoraPlan:
    """token_slot [..., B, T] -> a LoraPlan whose leaves are [..., data_shards, per-shard size].

    The B rows split into `data_shards` contiguous blocks (as a batch sharded on `data` does);
    leading axes (e.g. microbatches) are kept."""
    token_slot = np.asarray(token_slot, np.int32)
    *lead, batch, length = token_slot.shape
    if batch % data_shards:
        raise ValueError(f"batch {batch} does not split over {data_shards} data shards")
    blocks = token_slot.reshape(-1, data_shards, batch // data_shards, length)
    plans = [[build_plan(shard, num_segments) for shard in group] for group in blocks]
    fields = [np.stack([np.stack([plan[i] for plan in group]) for group in plans]) for i in range(len(LoraPlan._fields))]
    return LoraPlan(*(field.reshape(*lead, data_shards, *field.shape[2:]) for field in fields))
