"""Pipeline bubble ratio from stage times, by simulating a 1F1B pipeline op by op.

Each stage runs its ops in 1F1B order (S - 1 - s warm-up forwards, then one forward / one
backward, then the remaining backwards); an op starts when its stage is free and its input is
ready (F(m, s) after F(m, s - 1); B(m, s) after B(m, s + 1), or after F(m, S - 1) on the last
stage). bubble ratio = idle stage time / (S * makespan).

  (a) our multi-adapter schedule: one continuous stream of microbatches of several adapters, with
      the bubble lemma's no-ops (`jaxlora.scheduler.training.lemma`) making each adapter's next
      global batch enter only after its previous one left stage 0 (checked here), so the pipeline
      never drains between global batches;
  (b) 1F1B with one adapter: the pipeline fills and drains for every global batch, since the
      optimizer step needs all of that batch's backwards before the next batch's forwards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from jaxlora.scheduler.training.samples import Microbatch, Sample, batch_index, real_tokens
from jaxlora.scheduler.training.lemma import insert_noops


@dataclass(frozen=True)
class PipelineRun:
    """Times of one simulated run: makespan, busy stage time, and every op's (start, end)."""

    makespan: float
    busy: float
    num_stages: int
    forward: dict  # (microbatch, stage) -> (start, end)
    backward: dict

    @property
    def bubble_ratio(self) -> float:
        return 1.0 - self.busy / (self.num_stages * self.makespan) if self.makespan > 0 else 0.0


def stage_order(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """1F1B op order of one stage: [("F" or "B", microbatch), ...]."""
    warmup = min(num_stages - 1 - stage, num_microbatches)
    order = [("F", m) for m in range(warmup)]
    for m in range(num_microbatches - warmup):
        order += [("F", warmup + m), ("B", m)]
    return order + [("B", m) for m in range(num_microbatches - warmup, num_microbatches)]


def simulate_1f1b(forward_times: Sequence[Sequence[float]], backward_times: Sequence[Sequence[float]]) -> PipelineRun:
    """forward_times[m][s], backward_times[m][s]: time of microbatch m's ops on stage s."""
    num_microbatches, num_stages = len(forward_times), len(forward_times[0]) if forward_times else 0
    orders = [stage_order(s, num_stages, num_microbatches) for s in range(num_stages)]
    position, free = [0] * num_stages, [0.0] * num_stages
    done = {"F": {}, "B": {}}
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for stage in range(num_stages):
            while position[stage] < len(orders[stage]):
                kind, micro = orders[stage][position[stage]]
                if kind == "F":
                    dep = None if stage == 0 else ("F", stage - 1)
                    duration = forward_times[micro][stage]
                else:
                    dep = ("F", stage) if stage == num_stages - 1 else ("B", stage + 1)
                    duration = backward_times[micro][stage]
                if dep is not None and (micro, dep[1]) not in done[dep[0]]:
                    break
                ready = 0.0 if dep is None else done[dep[0]][(micro, dep[1])][1]
                start = max(free[stage], ready)
                done[kind][(micro, stage)] = (start, start + duration)
                free[stage] = start + duration
                position[stage] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("1F1B simulation deadlocked")
    busy = sum(f[m][s] + b[m][s] for f, b in [(forward_times, backward_times)]
               for m in range(num_microbatches) for s in range(num_stages))
    return PipelineRun(max(free, default=0.0), busy, num_stages, done["F"], done["B"])


def microbatch_times(microbatches: Sequence[Microbatch], stage_forward: Sequence[float],
                     stage_backward: Sequence[float], capacity: int):
    """Per-op times: a microbatch's stage time scales with its real tokens / capacity (no-op: 0)."""
    fractions = [real_tokens(mb) / capacity for mb in microbatches]
    return ([[f * t for t in stage_forward] for f in fractions], [[f * t for t in stage_backward] for f in fractions])


def multi_adapter_run(microbatches: Sequence[Microbatch], global_batch_size: Mapping[int, int],
                      stage_forward: Sequence[float], stage_backward: Sequence[float], capacity: int) -> PipelineRun:
    """(a): one 1F1B stream of a multi-adapter schedule (no-ops included). Raises if an adapter's
    global batch enters stage 0 before its previous batch's last backward has left it."""
    run = simulate_1f1b(*microbatch_times(microbatches, stage_forward, stage_backward, capacity))
    last: dict[int, tuple[int, int]] = {}  # adapter -> (global batch, last microbatch)
    for index, mb in enumerate(microbatches):
        for sample in mb:
            batch = batch_index(sample, global_batch_size)
            previous = last.get(sample.adapter_id)
            if previous and previous[0] < batch and previous[1] != index:
                if run.forward[(index, 0)][0] < run.backward[(previous[1], 0)][1]:
                    raise ValueError(f"adapter {sample.adapter_id}: batch {batch} enters before batch "
                                     f"{previous[0]}'s backward left stage 0")
            last[sample.adapter_id] = (batch, index)
    return run


def single_adapter_run(num_global_batches: int, microbatches_per_batch: int, stage_forward: Sequence[float],
                       stage_backward: Sequence[float]) -> PipelineRun:
    """(b): 1F1B with one adapter, full microbatches, the pipeline drained for every global batch."""
    one = simulate_1f1b([list(stage_forward)] * microbatches_per_batch, [list(stage_backward)] * microbatches_per_batch)
    return PipelineRun(one.makespan * num_global_batches, one.busy * num_global_batches, one.num_stages, {}, {})


def round_robin_schedule(num_adapters: int, num_global_batches: int, microbatches_per_batch: int,
                         capacity: int, num_stages: int) -> tuple[list[Microbatch], dict[int, int]]:
    """Full microbatches (one sample of `capacity` tokens each) of every adapter, interleaved
    adapter by adapter, with the lemma's no-ops inserted for `num_stages`."""
    stream = [(Sample(adapter, batch * microbatches_per_batch + k, capacity),)
              for batch in range(num_global_batches) for k in range(microbatches_per_batch)
              for adapter in range(num_adapters)]
    sizes = {adapter: microbatches_per_batch for adapter in range(num_adapters)}
    fixed, _ = insert_noops(stream, sizes, num_stages)
    return fixed, sizes


def compare_bubbles(stage_forward: Sequence[float], stage_backward: Sequence[float] | None = None,
                    num_adapters: int = 4, num_global_batches: int = 4, microbatches_per_batch: int = 4,
                    capacity: int = 4096) -> dict[str, float]:
    """Bubble ratios of (a) the multi-adapter schedule with `num_adapters` adapters and (b) 1F1B
    with one adapter, for the same work per adapter; backward defaults to 2x forward per stage."""
    stage_backward = [2.0 * t for t in stage_forward] if stage_backward is None else stage_backward
    num_stages = len(stage_forward)
    schedule, sizes = round_robin_schedule(num_adapters, num_global_batches, microbatches_per_batch, capacity,
                                           num_stages)
    multi = multi_adapter_run(schedule, sizes, stage_forward, stage_backward, capacity)
    single = single_adapter_run(num_global_batches, microbatches_per_batch, stage_forward, stage_backward)
    return {"multi_adapter": multi.bubble_ratio, "single_adapter_1f1b": single.bubble_ratio,
            "multi_adapter_noops": sum(1 for mb in schedule if not mb)}
