"""One microbatch: packing scheduled samples into arrays, and the jitted loss/gradient of the adapters.

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
from flax import nnx

from jaxlora.buckets import bucket
from jaxlora.lora.plan import LoraPlan, build_plan
from jaxlora.models.llama import Llama, LoraInputs
from jaxlora.models.loss import per_slot_loss


@dataclasses.dataclass
class MicrobatchArrays:
    """Arrays of one microbatch, each [1, capacity]; `adapter_tokens[slot]` counts real tokens."""

    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    targets: np.ndarray
    weights: np.ndarray
    token_slot: np.ndarray
    adapter_tokens: np.ndarray


def pack_microbatch(entries, capacity: int, num_slots: int) -> MicrobatchArrays:
    """entries: (slot, TokenizedSample, weight per target token) for each sample, in order."""
    tokens = np.zeros((1, capacity), np.int32)
    positions, segment_ids, targets = (np.zeros_like(tokens) for _ in range(3))
    weights = np.zeros((1, capacity), np.float32)
    token_slot = np.full((1, capacity), -1, np.int32)
    adapter_tokens = np.zeros(num_slots, np.int64)
    offset = 0
    for segment, (slot, sample, weight) in enumerate(entries, start=1):
        length = len(sample.tokens)
        if offset + length > capacity:
            raise ValueError(f"microbatch overflows its capacity of {capacity} tokens")
        span = slice(offset, offset + length)
        tokens[0, span], positions[0, span] = sample.tokens, np.arange(length)
        segment_ids[0, span], token_slot[0, span] = segment, slot
        targets[0, offset: offset + length - 1] = sample.tokens[1:]
        weights[0, offset: offset + length - 1] = np.where(sample.loss_mask[1:], weight, 0.0)
        adapter_tokens[slot] += length
        offset += length
    return MicrobatchArrays(tokens, positions, segment_ids, targets, weights, token_slot, adapter_tokens)


def split_pool(pool_arrays: dict) -> tuple[dict, dict]:
    """(trainable {module: {a, b}}, frozen {module: {scale, rank}}) from an AdapterPool's arrays."""
    trainable = {m: {"a": v["a"], "b": v["b"]} for m, v in pool_arrays.items()}
    frozen = {m: {"scale": v["scale"], "rank": v["rank"]} for m, v in pool_arrays.items()}
    return trainable, frozen


def make_grad_step(model: Llama, num_slots: int, lora_backend: str, attention: str = "auto",
                   unroll_layers: bool = False):
    """A (trainable, frozen, batch arrays, plan, dropout rate, key) -> (per-slot loss, grads) step.
    `attention`: the model's packed attention ("auto": the flash kernel on GPU/TPU, masked on CPU);
    `unroll_layers`: unroll the layer scan (faster steps on GPU, longer compile; see `Llama`).

    The frozen base weights enter the jitted function as an argument, not as captured constants:
    constants would be embedded in the compiled program (gigabytes for an 8B model, a slow compile)."""
    graphdef, state = nnx.split(model)

    def loss_fn(trainable, frozen, state, batch, plan: LoraPlan, dropout_rate, dropout_key):
        pool = {m: {**trainable[m], **frozen[m]} for m in trainable}
        lora = LoraInputs(pool, plan, dropout_rate, dropout_key)
        logits, _ = nnx.merge(graphdef, state)(
            batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"], lora=lora,
            lora_backend=lora_backend, attention=attention, unroll_layers=unroll_layers,
        )
        return per_slot_loss(logits, batch, plan.token_slot, num_slots)

    grad_fn = jax.grad(loss_fn, has_aux=True)  # d/d trainable only

    @jax.jit
    def jitted_step(state, trainable, frozen, batch, plan, dropout_rate, dropout_key):
        grads, per_slot = grad_fn(trainable, frozen, state, batch, plan, dropout_rate, dropout_key)
        return per_slot, grads

    def grad_step(trainable, frozen, batch, plan, dropout_rate, dropout_key):
        return jitted_step(state, trainable, frozen, batch, plan, dropout_rate, dropout_key)

    return grad_step


def device_batch(arrays: MicrobatchArrays, num_slots: int) -> tuple[dict, LoraPlan]:
    """The jit inputs of a microbatch; the plan's segment count is fixed by the pool size."""
    batch = {"tokens": arrays.tokens, "positions": arrays.positions, "segment_ids": arrays.segment_ids,
             "targets": arrays.targets, "weights": arrays.weights}
    return batch, build_plan(arrays.token_slot, num_segments=bucket(num_slots + 1, 4))


@functools.partial(jax.jit, donate_argnums=(0,))
def add_trees(accumulator, update):
    return jax.tree.map(jnp.add, accumulator, update)
