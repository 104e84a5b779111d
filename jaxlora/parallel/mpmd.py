"""An MPMD pipeline for multi-adapter LoRA training: each stage's layers are jitted programs on
that stage's own device, and a Python driver issues their forward, backward and optimizer ops in
1F1B order (LoRAFusion's multi-adapter stream, or one adapter drained per global batch).

Unlike the SPMD GPipe loop of `layer_stack.pipeline_stack`, where every stage runs every step in
lockstep, each device here runs only its own ops, queued in program order on its stream. An op
whose input comes from a neighbour waits for that transfer (`jax.device_put` between devices is
asynchronous), so a device really idles in the bubbles and the wall clock shows them.

Ops of one stage (`stage_orders`): ("F", m) forward of microbatch m, ("B", m) its backward (which
adds the adapter gradients into the stage's accumulator), ("U", a) the optimizer step of adapter
slot a on this stage's layers, placed right after the backward that completes a's global batch.
Empty microbatches (the bubble lemma's no-ops) keep their place in the 1F1B order but run nothing.

Memory: a forward keeps only each layer's input ([L_stage, B, T, d]); the backward recomputes one
layer at a time under `jax.vjp` (activation recomputation, as Megatron and MaxText do at this
size), so a backward costs about three forwards.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
import time
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxlora import sharding
from jaxlora.lora.plan import LoraPlan
from jaxlora.nn.axes import ShardingRules, weight_axes
from jaxlora.nn.model_config import LlamaConfig
from jaxlora.lora import backends
from jaxlora.lora.backends import LoraBackend
from jaxlora.lora.project import layer_lora
from jaxlora.lora.trainable import apply_adapter_update, join_pool, slot_params
from jaxlora.models.llama import (Llama, LoraInputs, PackedAttention, _packed_mask, decoder_layer, embed_tokens,
                                  final_logits)
from jaxlora.models.loss import per_slot_loss
from jaxlora.parallel.bubble import stage_order
from jaxlora.scheduler.training.samples import Microbatch
from jaxlora.scheduler.training.lemma import batches_in


@dataclasses.dataclass(frozen=True)
class Op:
    kind: str  # "F" forward, "B" backward, "U" optimizer step
    index: int  # microbatch index (F, B) or adapter slot (U)


# ----------------------------------------------------------------------------------------------
# Op orders


def stage_orders(segments: Sequence[Sequence[int]], num_stages: int, completions: Mapping[int, Sequence[int]],
                 empty: frozenset[int] = frozenset()) -> list[list[Op]]:
    """Per stage, the ops of a run made of `segments` (lists of microbatch indices), each segment
    one 1F1B pass (one segment: a continuous stream; one per global batch: a drained pipeline).

    completions[m]: adapter slots whose global batch completes with microbatch m (their "U" ops
    follow ("B", m)); `empty`: no-op microbatches (no F/B, place kept)."""
    orders: list[list[Op]] = []
    for stage in range(num_stages):
        ops: list[Op] = []
        for segment in segments:
            for kind, position in stage_order(stage, num_stages, len(segment)):
                micro = segment[position]
                if micro not in empty:
                    ops.append(Op(kind, micro))
                if kind == "B":
                    ops.extend(Op("U", slot) for slot in completions.get(micro, ()))
        orders.append(ops)
    return orders


def check_update_order(orders: Sequence[Sequence[Op]], microbatches: Sequence[Microbatch],
                       global_batch_size: Mapping[int, int], slot_of: Mapping[int, int],
                       steps_before: Mapping[int, int] | None = None) -> None:
    """Raises ValueError if on some stage a forward uses an adapter whose previous global batch
    has not had its optimizer step there yet (the bubble lemma, checked on the real op order).

    steps_before: optimizer steps each slot took before these orders (a run issued in pieces)."""
    for stage, ops in enumerate(orders):
        updates = {slot: (steps_before or {}).get(slot, 0) for slot in slot_of.values()}
        for op in ops:
            if op.kind == "U":
                updates[op.index] += 1
            elif op.kind == "F":
                for adapter, batch in batches_in(microbatches[op.index], global_batch_size).items():
                    if updates[slot_of[adapter]] != batch:
                        raise ValueError(f"stage {stage}: microbatch {op.index} runs adapter {adapter}'s global "
                                         f"batch {batch} after {updates[slot_of[adapter]]} optimizer steps")


def completions_of(microbatches: Sequence[Microbatch], global_batch_size: Mapping[int, int],
                   slot_of: Mapping[int, int]) -> dict[int, list[int]]:
    """microbatch index -> slots whose global batch's last sample is in it."""
    seen: dict[int, int] = {}
    out: dict[int, list[int]] = {}
    for index, microbatch in enumerate(microbatches):
        for sample in microbatch:
            seen[sample.adapter_id] = seen.get(sample.adapter_id, 0) + 1
        for adapter in sorted({s.adapter_id for s in microbatch}):
            if seen[adapter] % global_batch_size[adapter] == 0:
                out.setdefault(index, []).append(slot_of[adapter])
    return out


def _ready(op: Op, stage: int, num_stages: int, activations: Mapping, cotangents: Mapping) -> bool:
    if op.kind == "F":
        return stage == 0 or (op.index, stage) in activations
    if op.kind == "B":
        return stage == num_stages - 1 or (op.index, stage) in cotangents
    return True


def dispatch_order(orders: Sequence[Sequence[Op]]) -> list[tuple[int, Op]]:
    """(stage, op) in an order that issues every op after the ops it depends on and keeps each
    stage's own order: round robin over stages, each as far as its dependencies allow."""
    num_stages = len(orders)
    position = [0] * num_stages
    activations: set = set()
    cotangents: set = set()
    out: list[tuple[int, Op]] = []
    while any(position[s] < len(orders[s]) for s in range(num_stages)):
        progressed = False
        for stage in range(num_stages):
            while position[stage] < len(orders[stage]):
                op = orders[stage][position[stage]]
                if not _ready(op, stage, num_stages, activations, cotangents):
                    break
                if op.kind == "F" and stage + 1 < num_stages:
                    activations.add((op.index, stage + 1))
                if op.kind == "B" and stage > 0:
                    cotangents.add((op.index, stage - 1))
                out.append((stage, op))
                position[stage] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline op orders deadlock")
    return out


def simulate(orders: Sequence[Sequence[Op]], durations: Mapping[str, Sequence[float]],
             transfer: float = 0.0, hold: float = 0.0) -> tuple[float, list[float]]:
    """(makespan, busy time per stage) of the orders with op times durations[kind][stage].

    transfer: seconds from an op's end to its output being usable on the neighbour (copy and the
    host's reaction). hold: seconds a stage stays idle after each op that sends to a neighbour
    before its next op can start (a driver that waits for the op and its copy before issuing the
    next, as the driver before 2026-11-27 did; 0 for the current one)."""
    num_stages = len(orders)
    free = [0.0] * num_stages
    busy = [0.0] * num_stages
    finished: dict = {}
    for stage, op in dispatch_order(orders):
        ready = 0.0
        if op.kind == "F" and stage > 0:
            ready = finished[("F", op.index, stage - 1)] + transfer
        elif op.kind == "B" and stage < num_stages - 1:
            ready = finished[("B", op.index, stage + 1)] + transfer
        end = max(free[stage], ready) + durations[op.kind][stage]
        sends = (op.kind == "F" and stage < num_stages - 1) or (op.kind == "B" and stage > 0)
        free[stage] = end + (hold if sends else 0.0)
        busy[stage] += durations[op.kind][stage]
        finished[(op.kind, op.index, stage)] = end
    return max(finished.values(), default=0.0), busy


# ----------------------------------------------------------------------------------------------
# Stage programs


def split_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) layer ranges, sizes differing by at most one."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"{num_stages} stages for {num_layers} layers")
    bounds = np.linspace(0, num_layers, num_stages + 1).round().astype(int)
    return [(int(bounds[s]), int(bounds[s + 1])) for s in range(num_stages)]


def check_layer_ranges(ranges: Sequence[tuple[int, int]], num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """`ranges` as a list if they are `num_stages` contiguous non-empty ranges covering every
    layer in order; raises ValueError otherwise."""
    ranges = [(int(a), int(b)) for a, b in ranges]
    starts = [0] + [b for _, b in ranges[:-1]]
    if len(ranges) != num_stages or [a for a, _ in ranges] != starts or ranges[-1][1] != num_layers or \
            any(b <= a for a, b in ranges):
        raise ValueError(f"layer ranges {ranges} are not {num_stages} contiguous non-empty ranges "
                         f"of {num_layers} layers")
    return ranges


def _layer_call(config, backend: LoraBackend, weights, trainable, frozen, hidden, batch, plan, mask, index):
    pool = join_pool(trainable, frozen)
    hidden, _ = decoder_layer(config, weights, hidden, batch["positions"], index, PackedAttention(mask),
                              layer_lora(LoraInputs(pool, plan), pool, backend, index))
    return hidden


def _head_loss(config: LlamaConfig, head: dict, hidden, batch, token_slot, num_slots: int):
    """(weighted nll sum, per-slot sums [num_slots]) of the last stage's output."""
    matrix = head["embed_tokens"].T if config.tie_word_embeddings else head["lm_head"]
    logits = final_logits(config, head["norm"], matrix, hidden)
    return per_slot_loss(logits, batch, token_slot, num_slots)


@dataclasses.dataclass(frozen=True)
class StageProgram:
    """The jitted forward and backward of one stage. `first`/`last`: holds the embedding / head."""

    config: LlamaConfig
    first: bool
    last: bool
    first_layer: int
    num_slots: int
    backend: LoraBackend

    def _layers(self):
        return functools.partial(_layer_call, self.config, self.backend)

    @functools.partial(jax.jit, static_argnums=0)
    def forward(self, weights, trainable, frozen, x, batch, plan):
        """x: tokens [B, T] (first stage) or hidden [B, T, d]. Returns (output, saved): output is
        the hidden [B, T, d] for the next stage, or on the last stage the per-slot loss sums."""
        hidden = embed_tokens(self.config, weights["head"]["embed_tokens"], x) if self.first else x
        mask = _packed_mask(batch["segment_ids"].shape, batch["segment_ids"], self.config)
        layer = self._layers()

        def step(hidden, per_layer):
            w, t, f, index = per_layer
            return layer(w, t, f, hidden, batch, plan, mask, index), hidden

        indices = self.first_layer + jnp.arange(next(iter(weights["layers"].values())).shape[0])
        out, inputs = jax.lax.scan(step, hidden, (weights["layers"], trainable, frozen, indices))
        if self.last:
            _, per_slot = _head_loss(self.config, weights["head"], out, batch, plan.token_slot, self.num_slots)
            return per_slot, (inputs, out)
        return out, (inputs, None)

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=(5,))
    def backward(self, weights, trainable, frozen, saved, grads_acc, cotangent, batch, plan):
        """saved from `forward`; cotangent: d loss / d output (None on the last stage). Returns
        (grads_acc + this microbatch's adapter gradients, d loss / d input hidden or None)."""
        inputs, out = saved
        if self.last:
            cotangent = jax.grad(lambda h: _head_loss(self.config, weights["head"], h, batch, plan.token_slot,
                                                      self.num_slots)[0])(out)
        mask = _packed_mask(batch["segment_ids"].shape, batch["segment_ids"], self.config)
        layer = self._layers()

        def step(cotangent, per_layer):
            w, t, f, x, index = per_layer
            _, vjp = jax.vjp(lambda t, x: layer(w, t, f, x, batch, plan, mask, index), t, x)
            grad_t, grad_x = vjp(cotangent.astype(x.dtype))
            return grad_x, grad_t

        indices = self.first_layer + jnp.arange(inputs.shape[0])
        grad_in, grads = jax.lax.scan(step, cotangent, (weights["layers"], trainable, frozen, inputs, indices),
                                      reverse=True)
        grads_acc = jax.tree.map(lambda acc, g: acc + g.astype(acc.dtype), grads_acc, grads)
        return grads_acc, (None if self.first else grad_in)


def _slice_layers(tree, start: int, stop: int):
    return jax.tree.map(lambda leaf: jnp.copy(leaf[start:stop]), tree)  # never the caller's buffer (donated later)


def stage_weights(model: Llama, start: int, stop: int, first: bool, last: bool) -> dict:
    """{"layers": layer weights [start:stop], "head": embedding (first stage, or tied head) and
    final norm / lm_head (last stage)}."""
    head = {}
    if first or (last and model.config.tie_word_embeddings):
        head["embed_tokens"] = model.weights["embed_tokens"][...]
    if last:
        head["norm"] = model.weights["norm"][...]
        if not model.config.tie_word_embeddings:
            head["lm_head"] = model.weights["lm_head"][...]
    return {"layers": _slice_layers(model.layer_weights(), start, stop), "head": head}


# ----------------------------------------------------------------------------------------------
# The driver


class _RunState:
    """Values in flight between stages: activations / cotangents keyed (microbatch, stage that
    consumes them), still on the producing stage's device, each stage's saved forward residuals,
    and the last stage's losses."""

    def __init__(self, timeline: list | None = None, producer_copies: bool = False):
        self.activations, self.cotangents, self.saved, self.losses = {}, {}, {}, {}
        self.timeline, self.producer_copies = timeline, producer_copies
        self._changed = threading.Condition()

    def put(self, table: dict, key, value) -> None:
        with self._changed:
            table[key] = value
            self._changed.notify_all()

    def take(self, table: dict, key, wait: bool):
        with self._changed:
            if wait:
                self._changed.wait_for(lambda: key in table)
            return table.pop(key)


@dataclasses.dataclass(frozen=True)
class StagePlacement:
    """Where one stage lives: one device, or a (data, 1, tensor) sub-mesh on which its programs run
    under GSPMD (batch rows split on `data`; weights and adapters in the Megatron / S-LoRA layout of
    `jaxlora.sharding`, the frozen weights by `weight_rules`, e.g. `embed` on `data` for FSDP)."""

    target: jax.Device | Mesh
    weight_rules: ShardingRules = ShardingRules()

    def _put(self, tree, axes_of):
        if isinstance(self.target, jax.Device):
            return jax.device_put(tree, self.target)
        return {name: sharding.put(value, self.target, self.weight_rules.spec(axes_of(name)))
                for name, value in tree.items()}

    def weights(self, tree: dict) -> dict:
        """`stage_weights`' {"layers": ..., "head": ...} placed."""
        return {"layers": self._put(tree["layers"], lambda name: weight_axes(f"layers.{name}")),
                "head": self._put(tree["head"], weight_axes)}

    def pool(self, tree: dict) -> dict:
        if isinstance(self.target, jax.Device):
            return jax.device_put(tree, self.target)
        return sharding.shard_pool(tree, self.target)

    def rows(self, value) -> jax.Array:
        """An array with leading batch rows [B, ...] (tokens, activations, their gradients)."""
        if isinstance(self.target, jax.Device):
            return jax.device_put(value, self.target)
        return sharding.put(value, self.target, P("data"))

    def scalars(self, tree):
        """`tree` with its 0-d leaves (e.g. optimizer step counts) committed to this stage."""
        target = self.target if isinstance(self.target, jax.Device) else NamedSharding(self.target, P())
        return jax.tree.map(lambda leaf: jax.device_put(leaf, target) if np.ndim(leaf) == 0 else leaf, tree)

    def microbatch(self, batch: dict, plan: LoraPlan) -> tuple:
        """(tokens, batch, plan) on this stage: rows on `data`, the plan's grouping replicated."""
        if isinstance(self.target, jax.Device):
            return jax.device_put((batch["tokens"], batch, plan), self.target)
        placed = sharding.shard_batch(batch, self.target)
        return placed["tokens"], placed, sharding.shard_plan(plan, self.target)


@dataclasses.dataclass
class Stage:
    placement: StagePlacement
    program: StageProgram
    weights: dict
    trainable: dict
    frozen: dict
    grads_acc: dict
    opt_states: dict  # slot -> optax state


class MpmdPipeline:
    """A model's layers split over `devices` (one stage each: a device, or a `StagePlacement`
    such as a sub-mesh), with the adapters of a pool.

    trainable {module: {a [L, slots, k, r], b [L, slots, r, n]}}, frozen {module: {scale, rank}}
    (see `jaxlora.lora.trainable.split_pool`); optimizer: an optax transformation applied per slot
    with `jaxlora.lora.trainable.apply_adapter_update` (its state per stage and slot), or a list
    of one per slot; rank: the rank every slot trains, or one per slot; layer_ranges: each stage's
    [start, stop) layers (default `split_layers`, even; `jaxlora.parallel.balance.balanced_split`
    balances them by measured cost)."""

    def __init__(self, model: Llama, trainable: dict, frozen: dict, devices: Sequence[jax.Device | StagePlacement],
                 optimizer, rank: int | list[int], backend: LoraBackend | str = backends.TRAINING_DEFAULT,
                 layer_ranges: Sequence[tuple[int, int]] | None = None):
        num_slots = next(iter(trainable.values()))["a"].shape[1]
        lora_backend = backends.get(backend)  # resolved once; the stages' programs take the object
        # One optimizer (an optax NamedTuple, itself a sequence) for all slots, or a list of them.
        self.optimizers = list(optimizer) if isinstance(optimizer, list) else [optimizer] * num_slots
        self.ranks = list(rank) if isinstance(rank, (list, tuple)) else [rank] * num_slots
        placements = [d if isinstance(d, StagePlacement) else StagePlacement(d) for d in devices]
        self.devices = [p.target for p in placements]
        self.layer_ranges = check_layer_ranges(layer_ranges or split_layers(model.config.num_layers, len(placements)),
                                               model.config.num_layers, len(placements))
        self.stages: list[Stage] = []
        for index, (placement, (start, stop)) in enumerate(zip(placements, self.layer_ranges)):
            first, last = index == 0, index == len(placements) - 1
            program = StageProgram(model.config, first, last, start, num_slots, lora_backend)
            weights = placement.weights(stage_weights(model, start, stop, first, last))
            own = placement.pool(_slice_layers(trainable, start, stop))
            opt_states = {slot: placement.scalars(self.optimizers[slot].init(slot_params(own, slot, self.ranks[slot])))
                          for slot in range(num_slots)}
            self.stages.append(Stage(placement, program, weights, own,
                                     placement.pool(_slice_layers(frozen, start, stop)),
                                     jax.tree.map(jnp.zeros_like, own), opt_states))

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def place(self, batch: dict, plan: LoraPlan) -> list[tuple]:
        """A microbatch's (tokens, batch, plan) on every stage's device."""
        return [stage.placement.microbatch(batch, plan) for stage in self.stages]

    def run(self, orders: Sequence[Sequence[Op]], inputs: Sequence[Sequence[tuple]],
            threaded: bool = False, timeline: list | None = None,
            producer_copies: bool = False) -> dict[int, jax.Array]:
        """Issues every op; inputs[m] from `place`. Returns the per-slot loss sums of each
        microbatch (on the last device; block on them, or call `wait`, to time the run).

        threaded=False: one thread issues all ops in `dispatch_order` (asynchronously, so the
        GPUs run ahead of it). threaded=True: one thread per stage issues that stage's ops, each
        waiting only for its own inputs (for runtimes where a cross-device copy blocks its caller).

        A stage hands its output over on its own device as soon as the op is issued; the stage
        that consumes it copies it (`placement.rows`) right before the op that needs it. So where
        a copy blocks its caller until the source is computed, only the consumer's thread waits
        (its device still busy with the ops queued before), never the producer's: each stage's
        thread issues its next op while the previous one runs, and its device idles only where an
        input really is late (before, the producer copied its output and waited for it, leaving its
        device idle after every op that sends; bench/NOTES_train.md).

        timeline: a list to append (stage, kind, index, reached, input ready, issued) to for every
        op, in host `time.perf_counter()` seconds: when its thread reached it, when its input was
        there (taken and copied), and when the op had been dispatched. producer_copies=True: the
        producing stage copies its output to the consumer before handing it over (the driver before
        2026-11-27, kept to measure the difference)."""
        state = _RunState(timeline, producer_copies)
        if not threaded:
            for stage_index, op in dispatch_order(orders):
                self._issue(stage_index, op, inputs, state)
            return state.losses

        def stage_loop(stage_index):
            for op in orders[stage_index]:
                self._issue(stage_index, op, inputs, state, wait=True)

        with concurrent.futures.ThreadPoolExecutor(self.num_stages) as pool:
            for future in [pool.submit(stage_loop, s) for s in range(self.num_stages)]:
                future.result()
        return state.losses

    def _issue(self, stage_index: int, op: Op, inputs, state: "_RunState", wait: bool = False) -> None:
        """Issues one op of one stage; its input comes from `state` (wait=True: blocks until a
        neighbour's thread has put it there), copied to this stage here."""
        stage = self.stages[stage_index]
        reached = ready = time.perf_counter()
        if op.kind == "U":
            stage.trainable, stage.grads_acc, stage.opt_states[op.index] = apply_adapter_update(
                self.optimizers[op.index], stage.trainable, stage.grads_acc, op.index, self.ranks[op.index],
                stage.opt_states[op.index])
        elif op.kind == "F":
            ready = self._forward(stage_index, op.index, inputs[op.index][stage_index], state, wait)
        else:
            ready = self._backward(stage_index, op.index, inputs[op.index][stage_index], state, wait)
        if state.timeline is not None:
            state.timeline.append((stage_index, op.kind, op.index, reached, ready, time.perf_counter()))

    def _forward(self, stage_index: int, micro: int, placed: tuple, state: "_RunState", wait: bool) -> float:
        """Issues the forward of microbatch `micro` on a stage; returns when its input was there."""
        stage, (tokens, batch, plan), key = self.stages[stage_index], placed, (micro, stage_index)
        x = tokens if stage_index == 0 else stage.placement.rows(state.take(state.activations, key, wait))
        ready = time.perf_counter()
        out, state.saved[key] = stage.program.forward(stage.weights, stage.trainable, stage.frozen, x, batch, plan)
        if stage_index == self.num_stages - 1:
            state.losses[micro] = out
        else:
            state.put(state.activations, (micro, stage_index + 1), self._hand_over(out, stage_index + 1, state))
        return ready

    def _backward(self, stage_index: int, micro: int, placed: tuple, state: "_RunState", wait: bool) -> float:
        """Issues the backward of microbatch `micro` on a stage; returns when its input was there."""
        stage, (_, batch, plan), key = self.stages[stage_index], placed, (micro, stage_index)
        cotangent = None if stage_index == self.num_stages - 1 else stage.placement.rows(
            state.take(state.cotangents, key, wait))
        ready = time.perf_counter()
        stage.grads_acc, grad_in = stage.program.backward(
            stage.weights, stage.trainable, stage.frozen, state.saved.pop(key), stage.grads_acc, cotangent, batch, plan)
        if stage_index > 0:
            state.put(state.cotangents, (micro, stage_index - 1), self._hand_over(grad_in, stage_index - 1, state))
        return ready

    def _hand_over(self, value: jax.Array, consumer: int, state: "_RunState") -> jax.Array:
        """`value` as put for the consumer: as it is, or copied there now (producer_copies)."""
        return self.stages[consumer].placement.rows(value) if state.producer_copies else value

    def wait(self) -> None:
        jax.block_until_ready([(s.trainable, s.grads_acc, s.opt_states) for s in self.stages])

    def trainable(self) -> dict:
        """The adapters' current A/B, all layers (gathered on the host)."""
        parts = [jax.device_get(s.trainable) for s in self.stages]
        return jax.tree.map(lambda *leaves: np.concatenate(leaves), *parts)

    def grads(self) -> dict:
        parts = [jax.device_get(s.grads_acc) for s in self.stages]
        return jax.tree.map(lambda *leaves: np.concatenate(leaves), *parts)

    def opt_states(self) -> list:
        """Each slot's optimizer state over all layers (host): per-layer leaves joined in layer
        order, scalars (step counts, the same on every stage) taken from the first stage."""
        return [_join_layers([jax.device_get(s.opt_states[slot]) for s in self.stages])
                for slot in range(len(self.optimizers))]

    def load(self, trainable: dict, grads: dict, opt_states: Sequence) -> None:
        """Replaces adapters, gradient accumulators and optimizer states with all-layer values
        (as `trainable()`, `grads()` and `opt_states()` return them), split over the stages."""
        for stage, (start, stop) in zip(self.stages, self.layer_ranges):
            place = stage.placement.pool
            stage.trainable, stage.grads_acc = place(_slice_layers(trainable, start, stop)), place(
                _slice_layers(grads, start, stop))
            stage.opt_states = {slot: jax.tree.map(lambda new, old: place_like(new, old, start, stop), state,
                                                   stage.opt_states[slot])
                                for slot, state in enumerate(opt_states)}


def _join_layers(parts: Sequence):
    return jax.tree.map(lambda *leaves: leaves[0] if np.ndim(leaves[0]) == 0 else np.concatenate(leaves), *parts)


def place_like(value, like: jax.Array, start: int, stop: int) -> jax.Array:
    """`value` (all layers, or a scalar) cut to layers [start, stop) and placed as `like` is."""
    value = np.asarray(value)
    return jax.device_put(value if value.ndim == 0 else value[start:stop], like.sharding)
