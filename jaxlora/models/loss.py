"""The training loss of packed multi-adapter microbatches: weighted next-token NLL, summed per slot."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def per_slot_loss(logits, batch, token_slot, num_slots: int):
    """(sum of weighted token losses, the same per adapter slot [num_slots]).

    logits [..., vocab] float32; batch["targets"] int and batch["weights"] float, both [...];
    token_slot [...] int (-1: no adapter, counted in no slot). The NLL is logsumexp minus the
    target's logit, so no [..., vocab] log-probability array is written besides the logits."""
    target_logit = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
    nll = jax.nn.logsumexp(logits, axis=-1) - target_logit
    weighted = (nll * batch["weights"]).reshape(-1)
    slot = jnp.where(token_slot.reshape(-1) < 0, num_slots, token_slot.reshape(-1))
    per_slot = jnp.zeros(num_slots + 1, jnp.float32).at[slot].add(weighted)[:num_slots]
    return weighted.sum(), per_slot
