"""Per-adapter optimizers: each job has its own optax AdamW and learning-rate schedule, over its own
slice of the adapter pool, and steps only when its own global batch is complete."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from train.config import JobConfig


def learning_rate_schedule(job: JobConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up, then constant, linear decay or cosine decay to 0 at `total_steps`."""
    warmup = min(job.warmup_steps, max(total_steps - 1, 0))
    decay_steps = max(total_steps - warmup, 1)
    if job.schedule == "cosine":
        after = optax.cosine_decay_schedule(job.learning_rate, decay_steps)
    elif job.schedule == "linear":
        after = optax.linear_schedule(job.learning_rate, 0.0, decay_steps)
    else:
        after = optax.constant_schedule(job.learning_rate)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, job.learning_rate, warmup), after], [warmup])


def make_optimizer(job: JobConfig, total_steps: int) -> optax.GradientTransformation:
    return optax.adamw(learning_rate_schedule(job, total_steps), b1=0.9, b2=0.999, eps=1e-8,
                       weight_decay=job.weight_decay)


def slot_params(trainable: dict, slot: int, rank: int) -> dict:
    """One adapter's parameters {module: {a [L, k, r], b [L, r, n]}} out of the pool."""
    return {m: {"a": v["a"][:, slot, :, :rank], "b": v["b"][:, slot, :rank, :]} for m, v in trainable.items()}


@functools.partial(jax.jit, static_argnums=(0, 3, 4), donate_argnums=(1, 2))
def apply_adapter_update(optimizer, trainable, grads_acc, slot: int, rank: int, opt_state):
    """One optimizer step of the adapter in `slot` from its accumulated gradient; clears that gradient.

    Returns (trainable, grads_acc, opt_state) with only `slot` changed."""
    params = slot_params(trainable, slot, rank)
    grads = slot_params(grads_acc, slot, rank)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    trainable = {m: {"a": v["a"].at[:, slot, :, :rank].set(params[m]["a"]),
                     "b": v["b"].at[:, slot, :rank, :].set(params[m]["b"])} for m, v in trainable.items()}
    grads_acc = {m: {k: x.at[:, slot].set(0) for k, x in v.items()} for m, v in grads_acc.items()}
    return trainable, grads_acc, opt_state


def init_lora_a(trainable: dict, slot: int, ranks: dict, seed: int) -> dict:
    """PEFT's default init for one slot: A ~ U(-1/sqrt(k), 1/sqrt(k)) on the used ranks, B = 0."""
    rng = np.random.default_rng(seed)
    out = {}
    for module, arrays in trainable.items():
        layers, fan_in, _ = arrays["a"].shape[0], arrays["a"].shape[2], arrays["a"].shape[3]
        a = np.zeros(arrays["a"].shape[:1] + arrays["a"].shape[2:], np.float32)
        for layer in range(layers):
            rank = int(ranks[module][layer])
            a[layer, :, :rank] = rng.uniform(-fan_in**-0.5, fan_in**-0.5, (fan_in, rank))
        out[module] = {"a": arrays["a"].at[:, slot].set(jnp.asarray(a, arrays["a"].dtype)),
                       "b": arrays["b"].at[:, slot].set(0)}
    return out
