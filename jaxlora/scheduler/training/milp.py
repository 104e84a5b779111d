"""The two MILPs of LoRAFusion §4.2.4, solved with HiGHS (`highspy`) under a time limit.

Variables, for samples s (sorted longest first), adapters a and microbatches ("bins") b:
x[s,b] in {0,1} (s goes to b), k[a,b] integer (a's padded tokens in b, in units of P),
z[b] in {0,1} (b is used; stage 1 only).

Stage 1 (min_bins): minimise sum_b z[b] subject to sum_b x[s,b] = 1,
sum_{s of a} len(s) x[s,b] <= P k[a,b], sum_a P k[a,b] <= C z[b], z[b+1] <= z[b].
Stage 2 (min_smallest): with B bins fixed, the same constraints with z = 1, minimise the
padded tokens of the last bin. Bins are interchangeable, so minimising one designated bin is
minimising the smallest one, with no extra min/max variables.

Symmetry breaking (valid because bins can be relabelled): sample i (i-th longest) may only
go to bins 0..i; in stage 2 the designated last bin is open to every sample. Both stages
start from a known solution (greedy, or stage 1's), so a timed-out solve is never worse.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import highspy
import numpy as np

from jaxlora.scheduler.training.samples import Microbatch, Sample, padded_tokens, round_up
from jaxlora.scheduler.training.greedy import decreasing


@dataclass(frozen=True)
class MilpOutcome:
    """A solve's microbatches (None when HiGHS found no solution), status and wall time."""

    microbatches: tuple[Microbatch, ...] | None
    status: str
    seconds: float


@dataclass(frozen=True)
class _Layout:
    """Column indices of x, k and z in the HiGHS model."""

    num_samples: int
    num_adapters: int
    num_bins: int
    with_used: bool

    def x(self, s: int, b: int) -> int:
        return s * self.num_bins + b

    def k(self, a: int, b: int) -> int:
        return (self.num_samples + a) * self.num_bins + b

    def z(self, b: int) -> int:
        return (self.num_samples + self.num_adapters) * self.num_bins + b

    @property
    def num_cols(self) -> int:
        groups = self.num_samples + self.num_adapters + int(self.with_used)
        return groups * self.num_bins


class _Rows:
    """Accumulates sparse constraint rows lower <= sum(values * cols) <= upper."""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.starts: list[int] = []
        self.indices: list[int] = []
        self.values: list[float] = []

    def add(self, cols: Sequence[int], values: Sequence[float], lower: float, upper: float):
        self.starts.append(len(self.indices))
        self.indices.extend(cols)
        self.values.extend(values)
        self.lower.append(lower)
        self.upper.append(upper)

    def push(self, highs: highspy.Highs) -> None:
        highs.addRows(
            len(self.lower),
            np.array(self.lower, dtype=np.float64),
            np.array(self.upper, dtype=np.float64),
            len(self.indices),
            np.array(self.starts, dtype=np.int32),
            np.array(self.indices, dtype=np.int32),
            np.array(self.values, dtype=np.float64),
        )


@dataclass(frozen=True)
class _Instance:
    """Samples sorted longest first, their local adapter index, capacity and multiple."""

    samples: tuple[Sample, ...]
    adapter_of: tuple[int, ...]
    num_adapters: int
    capacity: int
    multiple: int

    @classmethod
    def build(cls, samples: Sequence[Sample], capacity: int, multiple: int) -> _Instance:
        ordered = tuple(decreasing(samples))
        adapters = sorted({s.adapter_id for s in ordered})
        local = {a: i for i, a in enumerate(adapters)}
        adapter_of = tuple(local[s.adapter_id] for s in ordered)
        return cls(ordered, adapter_of, len(adapters), capacity, multiple)


def _symmetry_open(layout: _Layout, s: int, b: int, stage2: bool) -> bool:
    if stage2 and b == layout.num_bins - 1:
        return True
    return b <= s


def _add_columns(highs: highspy.Highs, inst: _Instance, layout: _Layout, stage2: bool) -> None:
    upper = np.ones(layout.num_cols)
    for s in range(layout.num_samples):
        for b in range(layout.num_bins):
            upper[layout.x(s, b)] = float(_symmetry_open(layout, s, b, stage2))
    for a in range(inst.num_adapters):
        for b in range(layout.num_bins):
            upper[layout.k(a, b)] = inst.capacity // inst.multiple
    highs.addVars(layout.num_cols, np.zeros(layout.num_cols), upper)
    cols = np.arange(layout.num_cols, dtype=np.int32)
    integral = np.full(layout.num_cols, highspy.HighsVarType.kInteger.value, dtype=np.uint8)
    highs.changeColsIntegrality(layout.num_cols, cols, integral)


def _add_rows(highs: highspy.Highs, inst: _Instance, layout: _Layout) -> None:
    rows, bins = _Rows(), range(layout.num_bins)
    for s in range(layout.num_samples):
        rows.add([layout.x(s, b) for b in bins], [1.0] * layout.num_bins, 1.0, 1.0)
    for a in range(inst.num_adapters):
        own = [s for s in range(layout.num_samples) if inst.adapter_of[s] == a]
        for b in bins:
            cols = [layout.x(s, b) for s in own] + [layout.k(a, b)]
            vals = [float(inst.samples[s].num_tokens) for s in own] + [-float(inst.multiple)]
            rows.add(cols, vals, -np.inf, 0.0)
    for b in bins:
        cols = [layout.k(a, b) for a in range(inst.num_adapters)]
        vals = [float(inst.multiple)] * inst.num_adapters
        if layout.with_used:
            rows.add(cols + [layout.z(b)], vals + [-float(inst.capacity)], -np.inf, 0.0)
        else:
            rows.add(cols, vals, -np.inf, float(inst.capacity))
    if layout.with_used:
        for b in range(layout.num_bins - 1):
            rows.add([layout.z(b + 1), layout.z(b)], [1.0, -1.0], -np.inf, 0.0)
    rows.push(highs)


def _set_costs(highs: highspy.Highs, inst: _Instance, layout: _Layout) -> None:
    if layout.with_used:
        cols = [layout.z(b) for b in range(layout.num_bins)]
        costs = [1.0] * layout.num_bins
    else:
        last = layout.num_bins - 1
        cols = [layout.k(a, last) for a in range(inst.num_adapters)]
        costs = [float(inst.multiple)] * inst.num_adapters
    highs.changeColsCost(len(cols), np.array(cols, dtype=np.int32), np.array(costs))


def _canonical_bins(inst: _Instance, bins: Sequence[Microbatch], stage2: bool) -> list[list[int]]:
    """Sample positions per bin, relabelled to satisfy the symmetry-breaking bounds."""
    position = {sample: i for i, sample in enumerate(inst.samples)}
    groups = [sorted(position[s] for s in mb) for mb in bins if mb]
    if stage2:
        loads = [padded_tokens([inst.samples[j] for j in g], inst.multiple) for g in groups]
        smallest = loads.index(min(loads))
        last = groups.pop(smallest)
        return sorted(groups) + [last]
    return sorted(groups)


def _start_vector(
    inst: _Instance, layout: _Layout, bins: Sequence[Microbatch], stage2: bool
) -> np.ndarray:
    values = np.zeros(layout.num_cols)
    for b, members in enumerate(_canonical_bins(inst, bins, stage2)):
        for s in members:
            values[layout.x(s, b)] = 1.0
        for a in range(inst.num_adapters):
            tokens = sum(inst.samples[s].num_tokens for s in members if inst.adapter_of[s] == a)
            values[layout.k(a, b)] = round_up(tokens, inst.multiple) // inst.multiple
        if layout.with_used:
            values[layout.z(b)] = 1.0
    return values


def _read_bins(inst: _Instance, layout: _Layout, values: Sequence[float]) -> tuple[Microbatch, ...]:
    bins: list[list[Sample]] = [[] for _ in range(layout.num_bins)]
    for s, sample in enumerate(inst.samples):
        row = [values[layout.x(s, b)] for b in range(layout.num_bins)]
        bins[int(np.argmax(row))].append(sample)
    return tuple(tuple(mb) for mb in bins if mb)


def _feasible(inst: _Instance, bins: Sequence[Microbatch]) -> bool:
    placed = sorted(s for mb in bins for s in mb)
    fits = all(padded_tokens(mb, inst.multiple) <= inst.capacity for mb in bins)
    return fits and placed == sorted(inst.samples)


def _solve(
    inst: _Instance, layout: _Layout, start: Sequence[Microbatch], time_limit_s: float
) -> MilpOutcome:
    began = time.perf_counter()
    stage2 = not layout.with_used
    highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("time_limit", float(time_limit_s))
    _add_columns(highs, inst, layout, stage2)
    _add_rows(highs, inst, layout)
    _set_costs(highs, inst, layout)
    start_values = _start_vector(inst, layout, start, stage2)
    highs.setSolution(layout.num_cols, np.arange(layout.num_cols, dtype=np.int32), start_values)
    highs.run()
    status = highs.modelStatusToString(highs.getModelStatus())
    bins = None
    if highs.getInfo().primal_solution_status == 2:  # kSolutionStatusFeasible
        bins = _read_bins(inst, layout, highs.getSolution().col_value)
        bins = bins if _feasible(inst, bins) else None
    return MilpOutcome(bins, status, time.perf_counter() - began)


def _stage(samples, capacity, multiple, start, time_limit_s, *, stage1: bool) -> MilpOutcome:
    inst = _Instance.build(samples, capacity, multiple)
    layout = _Layout(len(inst.samples), inst.num_adapters, len(start), with_used=stage1)
    return _solve(inst, layout, start, time_limit_s)


def min_bins(
    samples: Sequence[Sample],
    capacity: int,
    multiple: int,
    start: Sequence[Microbatch],
    time_limit_s: float,
) -> MilpOutcome:
    """Stage 1: fewest microbatches, at most len(start) of them, starting from `start`."""
    return _stage(samples, capacity, multiple, start, time_limit_s, stage1=True)


def min_smallest(
    samples: Sequence[Sample],
    capacity: int,
    multiple: int,
    start: Sequence[Microbatch],
    time_limit_s: float,
) -> MilpOutcome:
    """Stage 2: len(start) microbatches; make the smallest one's padded tokens minimal."""
    return _stage(samples, capacity, multiple, start, time_limit_s, stage1=False)
