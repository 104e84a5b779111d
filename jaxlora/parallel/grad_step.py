"""The one training grad step: per-slot loss and adapter gradients of packed multi-adapter rows,
in four modes over one loss (`per_slot_loss` of the model's logits, token slots from the plan):

  * one device (no mesh): the model's own forward under jit;
  * GSPMD (no mesh, inputs placed by `jaxlora.sharding`'s `shard_model`, `shard_pool`,
    `shard_batch`, `shard_plan`): the same program; XLA partitions it by the inputs' shardings
    and inserts the collectives (backends GSPMD can partition: not the Pallas kernels);
  * shard_map (`mesh`): embedding, unembedding and loss under GSPMD, the decoder layers in
    `tensor_parallel_stack` (any backend, Pallas kernels included);
  * pipeline (`mesh`, `pipeline=True`): the layers in `pipeline_stack` (GPipe over `stage`), the
    rows split in microbatches [M, B, T], the loss summed over them.

The MPMD pipeline (`jaxlora.parallel.mpmd`) computes the same loss stage by stage."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxlora.lora import backends
from jaxlora.lora.backends import LoraBackend
from jaxlora.lora.trainable import join_pool
from jaxlora.nn.axes import ShardingRules
from jaxlora.nn.model_config import LlamaConfig
from jaxlora.models.llama import Llama, LoraInputs, _packed_mask
from jaxlora.models.loss import per_slot_loss
from jaxlora.parallel.layer_stack import pipeline_stack, tensor_parallel_stack
from jaxlora.vision.llava import embed_with_images


def make_grad_step(model: Llama, num_slots: int, lora_backend: LoraBackend | str = backends.DEFAULT, *,
                   mesh: Mesh | None = None, rules: ShardingRules = ShardingRules(), pipeline: bool = False,
                   attention: str = "auto", unroll_layers: bool = False, remat: str = "none",
                   image_token_id: int | None = None):
    """A jitted (trainable, frozen, batch, plan, dropout_rate=None, dropout_key=None) ->
    (per-slot loss sums [num_slots], grads of trainable) over `model`'s current weights.

    trainable {module: {a [L, S, k, r], b [L, S, r, n]}} and frozen {module: {scale, rank [L, S]}}
    from `jaxlora.lora.trainable.split_pool`; batch: tokens, positions, segment_ids, targets,
    weights, each [B, T] ([M, B, T] with `pipeline`); plan: the `LoraPlan` of the B*T tokens, or
    with a mesh the per-data-shard plans of `jaxlora.parallel.plans.local_plans`. Without a mesh:
    LoRA dropout (rate [S], key), the model's packed `attention`, `unroll_layers` and `remat`
    (see `Llama`), and images: with `image_token_id` (a vision-language model's language model),
    a batch may hold `image_embeds` [M, d], the frozen tower's rows written at the image tokens
    in row-major order (`jaxlora.vision.llava.embed_with_images`, as the inference forward does).
    lora_backend: a `LoraBackend` of `jaxlora.lora.backends`, or its name (resolved
    here, once).
    With a mesh: place the model with `shard_model(model, mesh, rules)` (`rules.pipelined()` for
    a pipeline). The base weights enter the jitted function as an argument, not as captured
    constants (those would be embedded in the program: gigabytes for an 8B model, a slow compile)."""
    if mesh is not None and remat != "none":
        raise ValueError("remat applies to the model's own layer scan: make the grad step without a mesh")
    backend = backends.get(lora_backend)
    graphdef, state = nnx.split(model)
    if mesh is None:
        forward = _model_forward(backend, attention, unroll_layers, remat, image_token_id)
    else:
        forward = _stack_forward(model.config, mesh, rules, backend, pipeline)

    def loss_fn(trainable, frozen, state, batch, plan, dropout_rate, dropout_key):
        model = nnx.merge(graphdef, state)
        logits = forward(model, join_pool(trainable, frozen), batch, plan, dropout_rate, dropout_key)
        return per_slot_loss(logits, batch, plan.token_slot, num_slots)

    @jax.jit
    def jitted_step(state, trainable, frozen, batch, plan, dropout_rate, dropout_key):
        grads, per_slot = jax.grad(loss_fn, has_aux=True)(trainable, frozen, state, batch, plan,
                                                           dropout_rate, dropout_key)
        return per_slot, grads

    def grad_step(trainable, frozen, batch, plan, dropout_rate=None, dropout_key=None):
        if mesh is not None and dropout_rate is not None:
            raise ValueError("LoRA dropout needs the unmapped model: make the grad step without a mesh")
        return jitted_step(state, trainable, frozen, batch, plan, dropout_rate, dropout_key)

    def compile_ahead(trainable, frozen, batch, plan, dropout_rate=None, dropout_key=None) -> None:
        """Compiles the step for these arguments' shapes without running it: it reads no weight
        values (a server's weights may be replaced meanwhile by another thread), and the first
        real call finds the compiled program."""
        jitted_step.lower(state, trainable, frozen, batch, plan, dropout_rate, dropout_key).compile()

    grad_step.compile_ahead = compile_ahead
    return grad_step


def _model_forward(backend: LoraBackend, attention: str, unroll_layers: bool, remat: str,
                   image_token_id: int | None = None):
    """(model, pool, batch, plan, dropout rate, key) -> logits [B, T, vocab] of the whole model
    (a batch with `image_embeds`: those rows at the image tokens)."""

    def forward(model, pool, batch, plan, dropout_rate, dropout_key):
        embeds = None
        if batch.get("image_embeds") is not None:
            if image_token_id is None:
                raise ValueError("a batch with image_embeds needs make_grad_step(image_token_id=)")
            embeds = embed_with_images(model, batch["tokens"], image_token_id, batch["image_embeds"])
        logits, _ = model(batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"],
                          lora=LoraInputs(pool, plan, dropout_rate, dropout_key), lora_backend=backend,
                          attention=attention, unroll_layers=unroll_layers, remat=remat, embeds=embeds)
        return logits

    return forward


def _stack_forward(config: LlamaConfig, mesh: Mesh, rules: ShardingRules, backend: LoraBackend, pipeline: bool):
    """(model, pool, batch, plans, -, -) -> logits [(M,) B, T, vocab]: embedding and unembedding
    under GSPMD, the decoder layers under shard_map."""
    stack = (pipeline_stack if pipeline else tensor_parallel_stack)(config, mesh, rules, backend)

    def forward(model, pool, batch, plans, dropout_rate, dropout_key):
        tokens = batch["tokens"]
        rows = tokens.reshape(-1, tokens.shape[-1]).shape
        mask = _packed_mask(rows, batch["segment_ids"].reshape(rows), config, "masked")  # GSPMD: no kernels
        mask = mask.reshape(*tokens.shape, tokens.shape[-1])
        hidden = stack(model.embed(tokens), batch["positions"], mask, model.layer_weights(), pool, plans)
        return model.unembed(hidden)

    return forward
