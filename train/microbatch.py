"""One microbatch: packing scheduled samples into the arrays of the grad step
(`jaxlora.parallel.grad_step.make_grad_step`), and adding up its gradients.

Every microbatch is one row of `capacity` tokens holding whole samples of any adapters (segment ids
keep attention inside each sample). Token weights are 1 / (target tokens of that adapter's global
batch), so summing the gradients of a global batch's microbatches gives each adapter exactly the
gradient of its mean loss over its global batch, whatever else shared those microbatches."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.buckets import bucket
from jaxlora.lora.plan import LoraPlan, build_plan
from jaxlora.scheduler.core import TRAIN, TokenCapacity, WorkItem


@dataclasses.dataclass
class MicrobatchArrays:
    """Arrays of one microbatch, each [1, capacity]; `adapter_tokens[slot]` counts real tokens;
    pixels [N, C, H, W]: its samples' images in the order of their image tokens (None: none)."""

    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    targets: np.ndarray
    weights: np.ndarray
    token_slot: np.ndarray
    adapter_tokens: np.ndarray
    pixels: np.ndarray | None = None


def pack_microbatch(entries, capacity: int, num_slots: int) -> MicrobatchArrays:
    """entries: (slot, TokenizedSample, weight per target token) for each sample, in order."""
    tokens = np.zeros((1, capacity), np.int32)
    positions, segment_ids, targets = (np.zeros_like(tokens) for _ in range(3))
    weights = np.zeros((1, capacity), np.float32)
    token_slot = np.full((1, capacity), -1, np.int32)
    adapter_tokens = np.zeros(num_slots, np.int64)
    TokenCapacity(capacity).check([WorkItem(TRAIN, slot, len(sample.tokens)) for slot, sample, _ in entries])
    offset = 0
    for segment, (slot, sample, weight) in enumerate(entries, start=1):
        length = len(sample.tokens)
        span = slice(offset, offset + length)
        tokens[0, span], positions[0, span] = sample.tokens, np.arange(length)
        segment_ids[0, span], token_slot[0, span] = segment, slot
        targets[0, offset: offset + length - 1] = sample.tokens[1:]
        weights[0, offset: offset + length - 1] = np.where(sample.loss_mask[1:], weight, 0.0)
        adapter_tokens[slot] += length
        offset += length
    return MicrobatchArrays(tokens, positions, segment_ids, targets, weights, token_slot, adapter_tokens,
                            _pixels(sample for _, sample, _ in entries))


def _pixels(samples) -> np.ndarray | None:
    """The samples' pixel values concatenated in order [N, C, H, W], None if none has images."""
    parts = [sample.pixels for sample in samples if sample.pixels is not None]
    return np.concatenate(parts) if parts else None


def pack_rows(rows, capacity: int, num_slots: int) -> MicrobatchArrays:
    """rows: one entries list (as for `pack_microbatch`) per row; arrays [len(rows), capacity]
    (an empty list is an empty row: no tokens, zero weights, slot -1)."""
    packed = [pack_microbatch(entries, capacity, num_slots) for entries in rows]
    fields = {f.name: np.concatenate([getattr(p, f.name) for p in packed]) for f in dataclasses.fields(MicrobatchArrays)
              if f.name not in ("adapter_tokens", "pixels")}
    return MicrobatchArrays(**fields, adapter_tokens=sum(p.adapter_tokens for p in packed),
                            pixels=_pixels(packed))


def device_batch(arrays: MicrobatchArrays, num_slots: int) -> tuple[dict, LoraPlan]:
    """The jit inputs of a microbatch ([B, T] arrays and the plan over their B*T tokens); the
    plan's segment count is fixed by the pool size."""
    batch = {"tokens": arrays.tokens, "positions": arrays.positions, "segment_ids": arrays.segment_ids,
             "targets": arrays.targets, "weights": arrays.weights}
    return batch, build_plan(arrays.token_slot, num_segments=bucket(num_slots + 1, 4))


@functools.partial(jax.jit, donate_argnums=(0,))
def add_trees(accumulator, update):
    return jax.tree.map(jnp.add, accumulator, update)
