"""Per-adapter optimizers: each job has its own optax AdamW and learning-rate schedule, over its own
slice of the adapter pool, and steps only when its own global batch is complete (the step itself:
`jaxlora.lora.trainable.apply_adapter_update`)."""

from __future__ import annotations

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
