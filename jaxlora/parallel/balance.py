"""Layers over pipeline stages by measured cost: a per-layer cost plus what the first stage (the
embedding) and the last stage (final norm, vocabulary head and loss) add, and the contiguous split
that minimizes the slowest stage.

An even split of a Llama-3.1-8B shape over 4 stages (8 layers each) leaves the last stage ~20%
slower than the others: its head ([T, d] x [d, 128256], forward plus the backward's recompute and
dX) costs about 1.7 layers. In 1F1B the slowest stage sets the period, so the others idle for the
difference (bench/NOTES_train.md, "4-stage pipeline bubble").

Costs are in seconds per op of one full microbatch, by op kind: "F" forward, "B" backward (with
the per-layer recomputation), "U" one adapter's optimizer step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

KINDS = ("F", "B", "U")


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """per_layer[kind]: seconds of one decoder layer; first[kind] / last[kind]: what the first /
    last stage adds on top of its layers (embedding; norm, head and loss)."""

    per_layer: Mapping[str, float]
    first: Mapping[str, float]
    last: Mapping[str, float]

    def stage_time(self, kind: str, num_layers: int, first: bool, last: bool) -> float:
        """Seconds of one op of `kind` on a stage of `num_layers` layers."""
        extra = (self.first.get(kind, 0.0) if first else 0.0) + (self.last.get(kind, 0.0) if last else 0.0)
        return num_layers * self.per_layer.get(kind, 0.0) + extra

    def op_seconds(self, layer_ranges: Sequence[tuple[int, int]]) -> dict[str, list[float]]:
        """{kind: [seconds per stage]} of a split ([start, stop) layer ranges), as
        `bench/pipeline.py` measures them, for `mpmd.simulate`."""
        last = len(layer_ranges) - 1
        return {kind: [self.stage_time(kind, stop - start, s == 0, s == last)
                       for s, (start, stop) in enumerate(layer_ranges)] for kind in KINDS}

    def in_layers(self) -> dict[str, float]:
        """The first / last stage's extra F+B cost in units of one layer's F+B."""
        layer = self.per_layer["F"] + self.per_layer["B"]
        return {"first": (self.first["F"] + self.first["B"]) / layer, "last": (self.last["F"] + self.last["B"]) / layer}


def costs_from_op_times(op_seconds: Mapping[str, Sequence[float]],
                        layer_ranges: Sequence[tuple[int, int]]) -> StageCosts:
    """Per-layer and first/last-stage costs from stage op times measured on a split.

    With 3+ stages the middle stages give the per-layer cost (their layers only); with 2 the first
    stage does (the embedding, a gather, taken as free); one stage has no extras to separate."""
    sizes = [stop - start for start, stop in layer_ranges]
    middle = list(range(1, len(sizes) - 1)) or [0]
    per_layer = {k: sum(op_seconds[k][s] for s in middle) / sum(sizes[s] for s in middle) for k in KINDS}
    first = {k: 0.0 for k in KINDS}
    last = {k: 0.0 for k in KINDS}
    if len(sizes) >= 3:
        first = {k: max(0.0, op_seconds[k][0] - sizes[0] * per_layer[k]) for k in ("F", "B")}
    if len(sizes) >= 2:
        last = {k: max(0.0, op_seconds[k][-1] - sizes[-1] * per_layer[k]) for k in ("F", "B")}
    return StageCosts(per_layer, {**{"U": 0.0}, **first}, {**{"U": 0.0}, **last})


def _stage_cost(costs: StageCosts, num_layers: int, first: bool, last: bool) -> float:
    return sum(costs.stage_time(kind, num_layers, first, last) for kind in ("F", "B"))


def _best_sizes(num_layers: int, num_stages: int, cost, combine) -> tuple[float, tuple[int, ...]]:
    """(value, layers per stage) minimizing value = combine(... combine(0, 0, cost(0, n_0)) ...,
    S - 1, cost(S - 1, n_last)) over contiguous splits of >= 1 layer each; combine(value, stage,
    stage cost) returns None for a stage it forbids."""
    table: list[dict[int, tuple[float, tuple[int, ...]]]] = [{0: (0.0, ())}] + [{} for _ in range(num_stages)]
    for stage in range(num_stages):
        left = num_stages - stage - 1
        for used, (value, sizes) in table[stage].items():
            sizes_here = [num_layers - used] if left == 0 else range(1, num_layers - used - left + 1)
            for size in sizes_here:
                candidate = combine(value, stage, cost(stage, size))
                entry = table[stage + 1].get(used + size)
                if candidate is not None and (entry is None or candidate < entry[0]):
                    table[stage + 1][used + size] = (candidate, sizes + (size,))
    return table[num_stages][num_layers]


def balanced_split(num_layers: int, num_stages: int, costs: StageCosts) -> list[tuple[int, int]]:
    """Contiguous [start, stop) layer ranges, at least one layer each, that minimize the slowest
    stage's F+B time; among those, the sum of squared stage times (the slack spread over stages),
    ties going to the split whose slow stages come first (later stages then have slack to absorb
    transfer latency: with the 4 x H200 costs, 4 global batches of xsum and 3 ms per transfer the
    replay gives 0.100 for 9,8,8,7, 0.124 for 8,8,9,7 and 9,9,8,6; 0.094-0.098 without).

    Dynamic programming over (stages placed, layers placed), twice: O(num_stages * num_layers^2)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"{num_stages} stages for {num_layers} layers")

    def cost(stage: int, size: int) -> float:
        return _stage_cost(costs, size, stage == 0, stage == num_stages - 1)

    slowest, _ = _best_sizes(num_layers, num_stages, cost, lambda value, stage, c: max(value, c))
    bound = slowest * (1 + 1e-9)

    def spread(value: float, stage: int, c: float) -> float | None:
        return None if c > bound else value + c * c * (1 + 1e-6 * stage)

    _, sizes = _best_sizes(num_layers, num_stages, cost, spread)
    return ranges_of(sizes)


def ranges_of(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Layers per stage -> contiguous [start, stop) ranges."""
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return [(bounds[s], bounds[s + 1]) for s in range(len(sizes))]


def parse_split(text: str, num_layers: int) -> list[tuple[int, int]]:
    """"9,8,8,7" (layers per stage) -> [(0, 9), (9, 17), (17, 25), (25, 32)]."""
    sizes = [int(part) for part in text.split(",")]
    if sum(sizes) != num_layers or min(sizes) < 1:
        raise ValueError(f"split {text!r} does not cover {num_layers} layers with >= 1 per stage")
    return ranges_of(sizes)
