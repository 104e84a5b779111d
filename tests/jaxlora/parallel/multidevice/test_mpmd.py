"""The MPMD pipeline (one stage per device, 1F1B op order, per-adapter optimizer steps) against
one device running the same microbatches in order with the same updates (f32)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxlora.lora.trainable import apply_adapter_update, slot_params, split_pool
from jaxlora.parallel import mpmd
from jaxlora.parallel.grad_step import make_grad_step
from jaxlora.scheduler.training.samples import Sample, TrainingData
from jaxlora.scheduler.training.greedy import first_fit
from jaxlora.scheduler.training.schedule import SchedulerConfig, build_schedule
from tests.jaxlora.parallel.fixtures import CONFIG, random_pool, tiny_model
from train.data import TokenizedSample
from train.microbatch import device_batch, pack_microbatch

CAPACITY, RANK = 24, 8
OPTIMIZER = optax.adamw(1e-2)


def _data(num_adapters: int, samples: int, batch_size: int, seed: int = 3) -> TrainingData:
    rng = np.random.default_rng(seed)
    return TrainingData.from_lengths({a: rng.integers(3, 13, samples).tolist() for a in range(num_adapters)},
                                     batch_size)


def _arrays(data: TrainingData, microbatches, num_slots: int, seed: int = 4):
    """Packed (batch, plan) per microbatch (None for no-ops), random tokens, 1/target-token weights."""
    rng = np.random.default_rng(seed)
    tokens = {(a, i): rng.integers(0, CONFIG.vocab_size, n).astype(np.int32)
              for a in data.adapters for i, n in enumerate(data.lengths[a])}
    out = []
    for mb in microbatches:
        if not mb:
            out.append(None)
            continue
        entries = []
        for s in mb:
            size = data.global_batch_size[s.adapter_id]
            batch = s.sample_index // size
            targets = sum(n - 1 for n in data.lengths[s.adapter_id][batch * size:(batch + 1) * size])
            t = tokens[(s.adapter_id, s.sample_index)]
            entries.append((s.adapter_id, TokenizedSample(t, np.ones(len(t), bool), "x"), 1.0 / targets))
        out.append(device_batch(pack_microbatch(entries, CAPACITY, num_slots), num_slots))
    return out


def _reference(model, trainable, frozen, arrays, completions, num_slots):
    """One device: every microbatch in order, each completion's optimizer step right after it."""
    grad_step = make_grad_step(model, num_slots, "onehot")
    trainable = jax.tree.map(jnp.copy, trainable)
    acc = jax.tree.map(jnp.zeros_like, trainable)
    states = {s: OPTIMIZER.init(slot_params(trainable, s, RANK)) for s in range(num_slots)}
    losses = {}
    for index, item in enumerate(arrays):
        if item is not None:
            batch, plan = item
            losses[index], grads = grad_step(trainable, frozen, batch, plan, None, None)
            acc = jax.tree.map(jnp.add, acc, grads)
        for slot in completions.get(index, ()):
            trainable, acc, states[slot] = apply_adapter_update(OPTIMIZER, trainable, acc, slot, RANK, states[slot])
    return jax.device_get(trainable), jax.device_get(acc), losses


def _relative(actual, expected) -> float:
    a = np.concatenate([np.ravel(x) for x in jax.tree.leaves(actual)])
    e = np.concatenate([np.ravel(x) for x in jax.tree.leaves(expected)])
    return float(np.linalg.norm(a - e) / np.linalg.norm(e))


def _pipeline(model, trainable, frozen, num_stages):
    return mpmd.MpmdPipeline(model, trainable, frozen, jax.devices()[:num_stages], OPTIMIZER, RANK)


@pytest.mark.parametrize("num_stages,threaded,num_adapters", [(2, False, 3), (4, False, 3), (4, True, 3),
                                                               (4, False, 1)])
def test_multi_adapter_stream_matches_one_device(num_stages, threaded, num_adapters):
    config = dataclasses.replace(CONFIG, num_layers=4)
    model = tiny_model(config)
    trainable, frozen = split_pool(random_pool(config))
    num_slots = next(iter(trainable.values()))["a"].shape[1]
    data = _data(num_adapters=num_adapters, samples=8, batch_size=2)
    schedule = build_schedule(data, SchedulerConfig(capacity=CAPACITY, num_stages=num_stages, padding_multiple=1,
                                                    use_milp=False))
    microbatches = list(schedule.microbatches)
    slot_of = {a: a for a in data.adapters}
    completions = mpmd.completions_of(microbatches, data.global_batch_size, slot_of)
    empty = frozenset(i for i, mb in enumerate(microbatches) if not mb)
    orders = mpmd.stage_orders([range(len(microbatches))], num_stages, completions, empty)
    mpmd.check_update_order(orders, microbatches, data.global_batch_size, slot_of)
    arrays = _arrays(data, microbatches, num_slots)
    expected_params, expected_acc, expected_losses = _reference(model, trainable, frozen, arrays, completions,
                                                                num_slots)

    pipeline = _pipeline(model, trainable, frozen, num_stages)
    inputs = [None if item is None else pipeline.place(*item) for item in arrays]
    losses = pipeline.run(orders, inputs, threaded=threaded)
    pipeline.wait()
    assert sum(len(c) for c in completions.values()) == sum(data.num_batches(a) for a in data.adapters)
    for index, loss in losses.items():
        np.testing.assert_allclose(np.asarray(loss), np.asarray(expected_losses[index]), rtol=1e-5, atol=1e-7)
    assert set(losses) == {i for i, mb in enumerate(microbatches) if mb}
    assert _relative(pipeline.trainable(), expected_params) <= 1e-5
    initial = jax.device_get(trainable)
    moved = jax.tree.map(np.subtract, pipeline.trainable(), initial)
    assert _relative(moved, jax.tree.map(np.subtract, expected_params, initial)) <= 1e-4
    assert np.linalg.norm(np.concatenate([np.ravel(x) for x in jax.tree.leaves(moved)])) > 0


def test_gradients_without_updates_match_one_device():
    config = dataclasses.replace(CONFIG, num_layers=3)  # 3 layers over 2 stages: uneven split
    model = tiny_model(config)
    trainable, frozen = split_pool(random_pool(config))
    num_slots = next(iter(trainable.values()))["a"].shape[1]
    data = _data(num_adapters=4, samples=3, batch_size=3)
    samples = [Sample(a, i, n) for a in data.adapters for i, n in enumerate(data.lengths[a])]
    microbatches = first_fit(samples, CAPACITY, 1)
    arrays = _arrays(data, microbatches, num_slots)
    _, expected_acc, _ = _reference(model, trainable, frozen, arrays, {}, num_slots)
    pipeline = _pipeline(model, trainable, frozen, 2)
    orders = mpmd.stage_orders([range(len(microbatches))], 2, {})
    pipeline.run(orders, [pipeline.place(*item) for item in arrays])
    pipeline.wait()
    assert _relative(pipeline.grads(), expected_acc) <= 1e-5


def test_drained_single_adapter_orders_and_lemma_check():
    # One adapter, global batches of 2 microbatches, each batch drained: every stage's ops of
    # batch k+1 come after its update of batch k.
    microbatches = [(Sample(0, i, 5),) for i in range(6)]
    gbs = {0: 2}
    completions = mpmd.completions_of(microbatches, gbs, {0: 0})
    assert completions == {1: [0], 3: [0], 5: [0]}
    orders = mpmd.stage_orders([[0, 1], [2, 3], [4, 5]], 3, completions)
    mpmd.check_update_order(orders, microbatches, gbs, {0: 0})
    for ops in orders:
        assert [op for op in ops if op.kind == "U"] == [mpmd.Op("U", 0)] * 3
    # The same stream as one continuous 1F1B segment breaks the lemma on the early stages.
    stream = mpmd.stage_orders([range(6)], 3, completions)
    with pytest.raises(ValueError, match="optimizer steps"):
        mpmd.check_update_order(stream, microbatches, gbs, {0: 0})
    # The simulator: a drained run of 3 batches x 2 microbatches on 3 stages, F=1, B=2, U=0.
    makespan, busy = mpmd.simulate(orders, {"F": [1, 1, 1], "B": [2, 2, 2], "U": [0, 0, 0]})
    assert busy == [18, 18, 18]
    assert makespan == 3 * (2 + 3 - 1) * (1 + 2)  # per batch (M + S - 1)(F + B)


@pytest.mark.parametrize("threaded,producer_copies", [(False, False), (True, False), (True, True)])
def test_uneven_split_stream_matches_one_device(threaded, producer_copies):
    """A split by cost (3, 1, 1, 1 layers), the stream of 3 adapters: losses, the gradients left
    over and every adapter's updates equal one device, with either driver, the consumer copying
    each output (default) or the producer (the old driver)."""
    config = dataclasses.replace(CONFIG, num_layers=6)
    model = tiny_model(config)
    trainable, frozen = split_pool(random_pool(config))
    num_slots = next(iter(trainable.values()))["a"].shape[1]
    data = _data(num_adapters=3, samples=8, batch_size=2, seed=5)
    schedule = build_schedule(data, SchedulerConfig(capacity=CAPACITY, num_stages=4, padding_multiple=1,
                                                    use_milp=False))
    microbatches = list(schedule.microbatches)
    slot_of = {a: a for a in data.adapters}
    completions = mpmd.completions_of(microbatches, data.global_batch_size, slot_of)
    orders = mpmd.stage_orders([range(len(microbatches))], 4, completions,
                               frozenset(i for i, mb in enumerate(microbatches) if not mb))
    mpmd.check_update_order(orders, microbatches, data.global_batch_size, slot_of)
    arrays = _arrays(data, microbatches, num_slots)
    expected_params, expected_acc, expected_losses = _reference(model, trainable, frozen, arrays, completions,
                                                                num_slots)
    pipeline = mpmd.MpmdPipeline(model, trainable, frozen, jax.devices()[:4], OPTIMIZER, RANK,
                                 layer_ranges=[(0, 3), (3, 4), (4, 5), (5, 6)])
    assert [s.weights["layers"]["q_proj.kernel"].shape[0] for s in pipeline.stages] == [3, 1, 1, 1]
    losses = pipeline.run(orders, [None if item is None else pipeline.place(*item) for item in arrays],
                          threaded=threaded, producer_copies=producer_copies)
    pipeline.wait()
    for index, loss in losses.items():
        np.testing.assert_allclose(np.asarray(loss), np.asarray(expected_losses[index]), rtol=1e-5, atol=1e-7)
    assert _relative(pipeline.trainable(), expected_params) <= 1e-5
    initial = jax.device_get(trainable)
    for slot in range(3):  # each adapter's own update
        def delta(params):
            return jax.tree.map(lambda x, y: np.asarray(x)[:, slot] - np.asarray(y)[:, slot], params, initial)

        assert _relative(delta(pipeline.trainable()), delta(expected_params)) <= 1e-4
    for got, want in zip(jax.tree.leaves(pipeline.grads()), jax.tree.leaves(expected_acc)):
        np.testing.assert_allclose(got, want, atol=1e-6)  # every global batch stepped: cleared
    with pytest.raises(ValueError, match="layer ranges"):
        mpmd.MpmdPipeline(model, trainable, frozen, jax.devices()[:2], OPTIMIZER, RANK, layer_ranges=[(0, 3), (4, 6)])
