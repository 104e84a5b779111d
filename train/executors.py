"""Where the training steps run: `SpmdExecutor` (one device, or GSPMD over a (data, 1, tensor)
mesh of any number of processes) and `PipelineExecutor` (the MPMD 1F1B pipeline, each stage a
(data, 1, tensor) sub-mesh). Both take a window of `StepGroup`s with their packed arrays, run the
grad steps and each completed adapter's optimizer step, and return every step's per-slot loss sums.

Both keep the same training state (adapters, gradient accumulators, optimizer states, all layers
in one tree): `state()` is what a checkpoint holds and `load()` takes it back, on any mesh."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxlora import sharding
from jaxlora.lora.trainable import apply_adapter_update, slot_params
from jaxlora.nn.axes import ShardingRules
from jaxlora.parallel import mpmd
from jaxlora.parallel.grad_step import make_grad_step
from jaxlora.scheduler.training.lemma import insert_noops
from train.config import TrainConfig
from train.groups import StepGroup
from train.microbatch import add_trees


def to_host(tree):
    """A pytree of (possibly sharded, multi-process) arrays as numpy arrays on every process."""
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in jax.tree.leaves(tree)):
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def weight_rules(config: TrainConfig) -> ShardingRules:
    """The frozen base's layout: Megatron over `tensor`, plus its model dimension over `data` (fsdp)."""
    return ShardingRules(embed="data") if config.mesh.fsdp else ShardingRules()


class SpmdExecutor:
    """Grad steps of [rows, capacity] batches on one device (mesh None) or under GSPMD on `mesh`."""

    def __init__(self, config: TrainConfig, model, trainable: dict, frozen: dict, optimizers: Sequence,
                 ranks: Sequence[int], mesh=None, image_token_id: int | None = None):
        """image_token_id: a vision-language model's (batches may then hold `image_embeds`; one device)."""
        self.mesh, self.optimizers, self.ranks = mesh, list(optimizers), list(ranks)
        if mesh is not None:
            sharding.shard_model(model, mesh, weight_rules(config))
            trainable, frozen = sharding.shard_pool(trainable, mesh), sharding.shard_pool(frozen, mesh)
        self.trainable, self.frozen = trainable, frozen
        self.grads_acc = jax.tree.map(jnp.zeros_like, trainable)
        self.opt_states = [self._commit_scalars(opt.init(slot_params(trainable, slot, rank)))
                           for slot, (opt, rank) in enumerate(zip(self.optimizers, self.ranks))]
        self.grad_step = make_grad_step(model, len(self.optimizers), config.backend,
                                        unroll_layers=config.unroll_layers, remat=config.remat,
                                        image_token_id=image_token_id)
        rates = [job.lora.lora_dropout for job in config.jobs]
        self.dropout_rate = None if not any(rates) else self._replicated(np.asarray(rates, np.float32))
        self.seed = config.seed

    def _commit_scalars(self, tree):
        """0-d leaves (optimizer step counts) replicated on the mesh, so a checkpoint restored into
        this state's shardings lands beside the adapters."""
        if self.mesh is None:
            return tree
        return jax.tree.map(lambda leaf: sharding.replicate(leaf, self.mesh) if np.ndim(leaf) == 0 else leaf, tree)

    def _replicated(self, value):
        return jnp.asarray(value) if self.mesh is None else sharding.replicate(value, self.mesh)

    def run(self, groups: Sequence[StepGroup], inputs: Sequence, steps_before=None) -> list[np.ndarray]:
        """inputs[i]: (batch, plan) host arrays of groups[i], or None (no rows: nothing to run)."""
        losses = []
        for group, item in zip(groups, inputs):
            loss = np.zeros(len(self.optimizers), np.float32)
            if item is not None:
                loss = to_host(self._grad_step(group, *item))
            for slot in group.completed:
                self.trainable, self.grads_acc, self.opt_states[slot] = apply_adapter_update(
                    self.optimizers[slot], self.trainable, self.grads_acc, slot, self.ranks[slot], self.opt_states[slot])
            losses.append(loss)
        return losses

    def _grad_step(self, group: StepGroup, batch: dict, plan):
        if self.mesh is not None:
            batch, plan = sharding.shard_batch(batch, self.mesh), sharding.shard_plan(plan, self.mesh)
        key = None
        if self.dropout_rate is not None:
            key = jax.random.fold_in(jax.random.key(self.seed), group.start)
        per_slot, grads = self.grad_step(self.trainable, self.frozen, batch, plan, self.dropout_rate, key)
        self.grads_acc = add_trees(self.grads_acc, grads)
        return per_slot

    def state(self) -> dict:
        return {"trainable": self.trainable, "grads_acc": self.grads_acc, "opt_states": list(self.opt_states)}

    def load(self, state: dict) -> None:
        """A checkpoint restored with `state()` as its template (so already placed like it)."""
        self.trainable, self.grads_acc = state["trainable"], state["grads_acc"]
        self.opt_states = list(state["opt_states"])

    def host_trainable(self) -> dict:
        return to_host(self.trainable)


class PipelineExecutor:
    """The MPMD 1F1B pipeline over `meshes` (one per stage). A window of steps is one 1F1B pass
    (drained at its end); empty steps are inserted where an adapter's next global batch would
    enter a stage before its optimizer step there (the bubble lemma with the real stage count)."""

    def __init__(self, config: TrainConfig, model, trainable: dict, frozen: dict, optimizers: Sequence,
                 ranks: Sequence[int], meshes: Sequence):
        placements = [mpmd.StagePlacement(mesh, weight_rules(config)) for mesh in meshes]
        self.pipeline = mpmd.MpmdPipeline(model, trainable, frozen, placements, list(optimizers), list(ranks),
                                          config.backend)
        self.global_batch_size = {slot: job.global_batch_size for slot, job in enumerate(config.jobs)}
        self.num_slots = len(config.jobs)

    def run(self, groups: Sequence[StepGroup], inputs: Sequence, steps_before: Sequence[int]) -> list[np.ndarray]:
        running = [i for i, item in enumerate(inputs) if item is not None]
        stream, _ = insert_noops([groups[i].samples for i in running], self.global_batch_size,
                                 self.pipeline.num_stages)
        position_of = {}  # group index -> position in the stream (no-ops fill the gaps)
        positions = iter(p for p, samples in enumerate(stream) if samples)
        for index in running:
            position_of[index] = next(positions)
        completions = {position_of[i]: list(groups[i].completed) for i in running if groups[i].completed}
        empty = frozenset(p for p, samples in enumerate(stream) if not samples)
        orders = mpmd.stage_orders([range(len(stream))], self.pipeline.num_stages, completions, empty)
        slot_of = {slot: slot for slot in range(self.num_slots)}
        mpmd.check_update_order(orders, stream, self.global_batch_size, slot_of, dict(enumerate(steps_before)))
        placed = [None] * len(stream)
        for index in running:
            placed[position_of[index]] = self.pipeline.place(*inputs[index])
        losses = self.pipeline.run(orders, placed)
        self.pipeline.wait()
        return [np.asarray(losses[position_of[i]]) if i in position_of else np.zeros(self.num_slots, np.float32)
                for i in range(len(groups))]

    def state(self) -> dict:
        return {"trainable": self.pipeline.trainable(), "grads_acc": self.pipeline.grads(),
                "opt_states": self.pipeline.opt_states()}

    def load(self, state: dict) -> None:
        self.pipeline.load(state["trainable"], state["grads_acc"], state["opt_states"])

    def host_trainable(self) -> dict:
        return self.pipeline.trainable()
