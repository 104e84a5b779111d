"""Training step (per-slot loss and adapter gradients) with the decoder layers under shard_map:
embedding, unembedding and loss stay GSPMD (jit with sharded inputs), the layers run in
`tensor_parallel_stack` or, with microbatches on a `stage` mesh, `pipeline_stack`."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxlora.models.llama import Llama, _packed_mask
from jaxlora.parallel.layer_stack import pipeline_stack, tensor_parallel_stack
from jaxlora.models.loss import per_slot_loss
from jaxlora.sharding import ShardingRules


def make_grad_step(model: Llama, mesh: Mesh, num_slots: int, lora_backend: str = "gather",
                   rules: ShardingRules = ShardingRules(), pipeline: bool = False):
    """Jitted (model state, trainable, frozen, batch, plans) -> (per-slot loss, grads of trainable).

    batch: tokens, positions, segment_ids, targets, weights, token_slot, each [B, T] (pipeline:
    [M, B, T], M microbatches); plans from `jaxlora.parallel.plans.local_plans` with the mesh's
    data size. Place the model with `shard_model(model, mesh, rules)` (`rules.pipelined()` for a
    pipeline); the same loss as `train.step.make_grad_step` summed over the microbatches."""
    graphdef, _ = nnx.split(model)
    stack_fn = pipeline_stack if pipeline else tensor_parallel_stack
    stack = stack_fn(model.config, mesh, rules, lora_backend)

    def loss_fn(trainable, state, frozen, batch, plans):
        model = nnx.merge(graphdef, state)
        pool = {m: {**trainable[m], **frozen[m]} for m in trainable}
        tokens = batch["tokens"]
        mask = _packed_mask(tokens.reshape(-1, tokens.shape[-1]).shape,  # GSPMD: no custom-call kernels
                            batch["segment_ids"].reshape(-1, tokens.shape[-1]), model.config.head_dim, "masked")
        mask = mask.reshape(*tokens.shape, tokens.shape[-1])
        hidden = stack(model.embed(tokens), batch["positions"], mask, model.layer_weights(), pool, plans)
        return per_slot_loss(model.unembed(hidden), batch, batch["token_slot"], num_slots)

    @jax.jit
    def grad_step(state, trainable, frozen, batch, plans):
        grads, per_slot = jax.grad(loss_fn, has_aux=True)(trainable, state, frozen, batch, plans)
        return per_slot, grads

    return grad_step
