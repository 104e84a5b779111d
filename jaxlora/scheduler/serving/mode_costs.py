"""The cost-based inference-mode policy of "auto" (issue 38): measured step costs and the queue.

`CostPolicy` holds the knobs (frozen, in `EngineConfig.mode_policy`); `start()` builds the one
stateful `CostModes` an engine keeps. Each step `choose` predicts, for the current requests, the
cost per token (below) of every mode it could run (`predict`), from these step times:

- unmerged: the unmerged step over N rows (N: the requests, at most `max_batch`);
- mixed X: that step times the mixed ratio at X's share (`StepCosts.step`);
- merged X: the merged step over X's rows only (the other adapters' requests wait through it);
- plus, for a mode whose merged adapter differs from the current one, the switch time amortised
  over the steps a mode is expected to stay (the measured stays' moving average, at least
  `min_dwell`, and for merging X at least the tokens X's longest request still has to generate:
  X has requests that long).

Each option is priced per token it produces, weighted by the requests that wait through it:
(step + amortised switch) x requests / rows served. Every live request's latency grows by the
step's time, and the step yields one token per row it serves, so this is the step's increase of
the sum of request latencies per token generated (V-LoRA's average token latency), the quantity
a greedy choice should keep lowest. Merged X serves only X's rows: at a share s of X it costs
T_merged / s, so it wins against mixed only when s > T_merged / T_mixed (~0.85 on the H200's 8B
decode), and with no other request it is the plain merged step. Merged X is not an option while another request has
waited more than `max_wait_steps` unmerged steps. Hysteresis: the merged adapter changes (a weight switch) only after
`min_dwell` steps with the current one and once the new one was the best `confirm` steps in a
row, and any change needs the new mode to be predicted `margin` cheaper than the current one; an
infeasible current mode is replaced by its feasible twin with the same weights (merged X with a
starving request: mixed X; mixed X without other requests: merged X) and left at once only if
neither is feasible (an adapter without requests). Mixed X becomes merged X (the same weights) for a step when no merged
step of that size was measured yet, so that the merged cost is measured, not inferred.

Step costs (`StepCosts`) are exponential moving averages per token bucket (powers of two): the
unmerged step in seconds, the merged step as a ratio r0 to the unmerged one, and the mixed step as
the ratio (1 - f) r0 + f r1 at a share f of rows of other adapters (r1: a mixed step of no merged
rows, the LoRA plus the -ΔW branch). Unmeasured buckets interpolate between the measured ones (or take the nearest), else the
priors (`default_step_s`, `merged_ratio`, `mixed_ratio`); the engine's measurements replace them
(`observe_step`). Pure host code over `Pending` requests: no JAX, no engine.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from typing import Hashable

from jaxlora.scheduler.serving.mode_choice import Mode, Pending


WINDOW = 32  # samples an estimate is the median of
MIN_SAMPLES = 3  # samples before a measurement replaces the prior


@dataclasses.dataclass(frozen=True)
class CostPolicy:
    """Knobs of the cost-based policy (module doc). max_batch: rows a step takes; default_step_s:
    an unmerged step before any is measured; merged_ratio: the prior merged / unmerged step cost;
    mixed_ratio: the prior mixed / unmerged cost of a step with no merged rows (r1); switch_s: the
    prior switch time (the 8B shape on an H200: 9.7 ms); expected_stay: steps a merged adapter is
    expected to stay before stays are measured; min_dwell: steps before the merged adapter changes
    again; confirm: steps in a row another merged adapter (or none) must be the best before the
    weights switch to it; margin: the fraction a new mode must be predicted cheaper by;
    max_wait_steps: a request of another adapter that waited longer than this many unmerged steps
    (predicted, of the current rows) rules merged out (a starved request's TPOT grows by its
    wait); ema: the weight of a new measurement."""

    max_batch: int = 256
    default_step_s: float = 0.03
    merged_ratio: float = 0.85
    mixed_ratio: float = 1.15
    switch_s: float = 0.01
    expected_stay: int = 32
    min_dwell: int = 8
    confirm: int = 4
    margin: float = 0.02
    max_wait_steps: float = 2.0
    ema: float = 0.2

    def __post_init__(self):
        if min(self.max_batch, self.min_dwell, self.confirm, self.expected_stay) < 1:
            raise ValueError("max_batch, min_dwell, confirm and expected_stay must be >= 1")
        if not (self.default_step_s > 0 and self.merged_ratio > 0 and self.mixed_ratio > 0 and self.switch_s >= 0):
            raise ValueError("default_step_s, merged_ratio, mixed_ratio must be > 0 and switch_s >= 0")
        if not (0 <= self.margin < 1 and 0 < self.ema <= 1 and self.max_wait_steps >= 0):
            raise ValueError(f"margin in [0, 1), ema in (0, 1], max_wait_steps >= 0: got {self.margin}, {self.ema}, "
                             f"{self.max_wait_steps}")

    def start(self) -> "CostModes":
        """The policy's state for one engine (costs measured from now on)."""
        return CostModes(self)


class StepCosts:
    """Moving averages of step costs per token bucket (module doc): "base" (unmerged seconds),
    "r0" (merged / unmerged), "r1" (mixed / unmerged with no merged rows)."""

    def __init__(self, policy: CostPolicy):
        self.policy = policy
        self.table: dict[tuple[str, int], float] = {}
        self.samples: collections.Counter = collections.Counter()  # mode -> steps recorded
        self.merged_buckets: set[int] = set()  # buckets whose r0 a merged step measured
        self.seen: dict[tuple[str, int], list[float]] = {}  # (mode, bucket) -> [count, sum, min, max] of raw seconds
        self.recent: dict[tuple[str, int], collections.deque] = {}  # (key, bucket) -> the last samples

    def has_merged(self, tokens: int) -> bool:
        """Whether a merged step of the bucket of `tokens` was measured."""
        return bucket(max(1, tokens)) in self.merged_buckets

    def get(self, key: str, tokens: int) -> float | None:
        """The measured `key` at the bucket of `tokens`: its own, else geometric interpolation in
        log2(bucket) between the measured buckets on either side, else the nearest measured one;
        None if none is measured."""
        b = bucket(max(1, tokens))
        if (key, b) in self.table:
            return self.table[(key, b)]
        known = sorted(k for name, k in self.table if name == key)
        below, above = [k for k in known if k < b], [k for k in known if k > b]
        if not below or not above:
            return self.table[(key, above[0])] if above else (self.table[(key, below[-1])] if below else None)
        lo, hi = below[-1], above[0]
        t = (math.log2(b) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        return self.table[(key, lo)] ** (1 - t) * self.table[(key, hi)] ** t

    def unmerged(self, tokens: int) -> float:
        """Seconds of an unmerged step of `tokens` tokens (rows)."""
        value = self.get("base", tokens)
        return self.policy.default_step_s if value is None else value

    def ratios(self, tokens: int) -> tuple[float, float]:
        """(r0, r1) of the bucket of `tokens`."""
        r0, r1 = self.get("r0", tokens), self.get("r1", tokens)
        return (self.policy.merged_ratio if r0 is None else r0), (self.policy.mixed_ratio if r1 is None else r1)

    def step(self, mode: str, tokens: int, others: float = 0.0) -> float:
        """Predicted seconds of a step of `mode` over `tokens` tokens; others: the share of its
        rows of other adapters than the merged one (mixed)."""
        base = self.unmerged(tokens)
        if mode == "unmerged":
            return base
        r0, r1 = self.ratios(tokens)
        return base * (r0 if mode == "merged" else (1 - others) * r0 + others * r1)

    def record(self, mode: str, tokens: int, seconds: float, others: float = 0.0) -> None:
        """Adds a measured step (a mixed step without rows of other adapters is a merged one).
        Each estimate is the median of its last `WINDOW` samples, set once `MIN_SAMPLES` are in
        (before that: the priors, or the measured buckets around): the unmerged seconds, and the
        merged step's ratio to the unmerged one of its bucket. A mixed step of a bucket whose r0 is
        measured gives its own r1 ((ratio - (1 - f) r0) / f: noisy at a small f, the median takes
        care of it); with r0 unmeasured it moves r0 and r1 by their weights (1 - f, f) in
        its prediction (normalised least mean squares, the sample clipped to [1/2, 2] x the
        prediction). r1 stays in [0.25, 8]."""
        if mode == "mixed" and others == 0:
            mode = "merged"
        b = bucket(max(1, tokens))
        self.samples[mode] += 1
        self._see(mode, b, seconds)
        if mode == "unmerged":
            self._median("base", b, seconds)
            return
        base = self.get("base", tokens)
        if base is None:
            return
        r0, r1 = self.ratios(tokens)
        if mode == "merged":
            if self._median("r0", b, seconds / base):
                self.merged_buckets.add(b)
            return
        if b in self.merged_buckets:
            if others > 0:
                self._median("r1", b, (seconds / base - (1 - others) * r0) / others, low=0.25, high=8.0)
            return
        predicted = (1 - others) * r0 + others * r1
        error, norm = _clip(seconds / base, predicted) - predicted, (1 - others) ** 2 + others ** 2
        alpha = self.policy.ema
        self.table[("r0", b)] = r0 + alpha * error * (1 - others) / norm
        self.table[("r1", b)] = min(8.0, max(0.25, r1 + alpha * error * others / norm))

    def _median(self, key: str, b: int, value: float, low: float = 0.0, high: float = math.inf) -> bool:
        """Adds `value` to the window of (key, b); once it holds `MIN_SAMPLES`, the table's entry
        becomes their median (clamped to [low, high]). Returns whether it did."""
        window = self.recent.setdefault((key, b), collections.deque(maxlen=WINDOW))
        window.append(value)
        if len(window) < MIN_SAMPLES:
            return False
        self.table[(key, b)] = min(high, max(low, statistics.median(window)))
        return True

    def _see(self, mode: str, b: int, seconds: float) -> None:
        """Adds a raw sample to `seen`."""
        entry = self.seen.setdefault((mode, b), [0, 0.0, seconds, seconds])
        entry[0] += 1
        entry[1] += seconds
        entry[2], entry[3] = min(entry[2], seconds), max(entry[3], seconds)


def _clip(sample: float, around: float) -> float:
    """`sample` clipped to [around / 2, 2 around] (`around` > 0)."""
    return min(2 * around, max(0.5 * around, sample))


class CostModes:
    """The policy's state in one engine: the step costs, the switch time, the stays and the
    hysteresis counters; `choose` picks each step's mode (module doc)."""

    def __init__(self, policy: CostPolicy):
        self.policy = policy
        self.costs = StepCosts(policy)
        self.switch_s = policy.switch_s  # moving average of measured switches
        self.stay = float(policy.expected_stay)  # moving average of steps per merged adapter
        self.steps_here = 0  # steps since the merged adapter last changed
        self.switches = 0  # merged-adapter changes it chose
        self.streak: tuple = (None, 0)  # (the best mode's merged adapter, steps in a row) when not the current one
        self.last: dict[Mode, float] = {}  # the last prediction (for tests and logs)

    # ---- measurements ------------------------------------------------------------------------
    def observe_step(self, mode: str, tokens: int, seconds: float, others: float = 0.0,
                     switch_s: float | None = None) -> None:
        """A measured step of `mode` (see `StepCosts.record`). switch_s: the host seconds of a
        switch just before it: then the step's excess over its prediction is the switch's device
        time, and the switch (host + excess) is measured instead of the step."""
        if switch_s is None:
            self.costs.record(mode, tokens, seconds, others)
            return
        excess = max(0.0, seconds - self.costs.step(mode, tokens, others))
        self.switch_s += self.policy.ema * (switch_s + excess - self.switch_s)

    def summary(self) -> dict:
        """What it measured: {"costs": {"base@16": seconds, "r0@16": ratio, ...}, "seen" (raw samples per
        mode and bucket: steps, mean, min, max seconds), "switch_s",
        "stay_steps", "switches", "samples" (steps recorded per mode)}."""
        seen = {f"{mode}@{b}": {"steps": n, "mean_s": round(total / n, 6), "min_s": round(lo, 6), "max_s": round(hi, 6)}
                for (mode, b), (n, total, lo, hi) in sorted(self.costs.seen.items())}
        return {"costs": {f"{key}@{b}": round(value, 6) for (key, b), value in sorted(self.costs.table.items())},
                "seen": seen,
                "switch_s": self.switch_s, "stay_steps": self.stay, "switches": self.switches,
                "samples": dict(self.costs.samples)}

    # ---- the decision ------------------------------------------------------------------------
    def choose(self, requests: list[Pending], current: Mode, step_s: float = 0.0, switch_s: float = 0.0) -> Mode:
        """This step's mode for the waiting and running `requests` (step_s, switch_s: unused,
        the costs are its own). No requests: the current mode."""
        if not requests:
            return current
        self.last = options = self.predict(requests, current)
        best = min(options, key=lambda mode: (options[mode], mode != current))
        chosen = self._explore(self._hysteresis(best, options, _anchor(current, options)), options, requests)
        if _target(chosen) != _target(current):
            if current.name != "unmerged":
                self.stay += self.policy.ema * (self.steps_here - self.stay)
            self.steps_here, self.switches = 0, self.switches + 1
        else:
            self.steps_here += 1
        return chosen

    def predict(self, requests: list[Pending], current: Mode) -> dict[Mode, float]:
        """Predicted mean seconds per token of every feasible mode (module doc)."""
        p = self.policy
        total = len(requests)
        rows = min(total, p.max_batch)
        counts = collections.Counter(r.adapter for r in requests)
        horizon = max(p.min_dwell, self.stay)
        unmerged, step_u = Mode("unmerged"), self.costs.step("unmerged", rows)
        per_row = total / rows  # every request waits through a step; `rows` of them get a token
        options = {unmerged: (step_u + self._switch(unmerged, current, horizon)) * per_row}
        for adapter in self._candidates(counts, current):
            n_x = counts[adapter]
            horizon = max(p.min_dwell, self.stay, max(r.remaining for r in requests if r.adapter == adapter))
            others = (total - n_x) / total
            if not self._starving(requests, adapter, p.max_wait_steps * step_u):
                merged, served = Mode("merged", adapter), min(n_x, p.max_batch)
                options[merged] = ((self.costs.step("merged", served) + self._switch(merged, current, horizon))
                                   * total / served)
            if others > 0:  # (with none, a mixed step is a merged one)
                mixed = Mode("mixed", adapter)
                options[mixed] = (self.costs.step("mixed", rows, others) + self._switch(mixed, current, horizon)) * per_row
        return options

    def _candidates(self, counts: collections.Counter, current: Mode) -> list[Hashable]:
        """The adapters worth merging: the most requested one (ties: the current) and the current
        one while it has requests; never the base model (None)."""
        named = {a: n for a, n in counts.items() if a is not None}
        if not named:
            return []
        top = max(named, key=lambda a: (named[a], a == current.merged))
        return [top] + ([current.merged] if current.merged in named and current.merged != top else [])

    @staticmethod
    def _starving(requests: list[Pending], adapter: Hashable, bound_s: float) -> bool:
        """Whether a request of another adapter than `adapter` waited more than `bound_s`."""
        return any(r.adapter != adapter and r.waited_s > bound_s for r in requests)

    def _switch(self, mode: Mode, current: Mode, horizon: float) -> float:
        """The switch time per step over `horizon` if `mode` changes the merged weights."""
        return 0.0 if _target(mode) == _target(current) else self.switch_s / horizon

    def _explore(self, chosen: Mode, options: dict[Mode, float], requests: list[Pending]) -> Mode:
        """Merged X instead of mixed X (the same weights: no switch) when merged X is feasible
        and no merged step of that size was measured: one step measures r0 (a mixed step at a
        small share of others cannot tell r0 from r1)."""
        merged = Mode("merged", chosen.merged)
        if chosen.name != "mixed" or merged not in options:
            return chosen
        rows = min(sum(r.adapter == chosen.merged for r in requests), self.policy.max_batch)
        return chosen if self.costs.has_merged(rows) else merged

    def _hysteresis(self, best: Mode, options: dict[Mode, float], current: Mode | None) -> Mode:
        """`best` if there is no feasible current mode (`_anchor`: None); else, if it switches
        the weights, only past the dwell and once the best was the same adapter `confirm` steps
        in a row; and only past the margin. Otherwise the current mode."""
        target = _target(best)
        if current is not None and target == _target(current):
            self.streak = (None, 0)
        else:
            self.streak = (target, self.streak[1] + 1 if self.streak[0] == target and self.streak[1] else 1)
        if current is None or best == current:
            return best
        p = self.policy
        if target != _target(current) and (self.steps_here < p.min_dwell or self.streak[1] < p.confirm):
            return current
        return best if options[best] < (1 - p.margin) * options[current] else current


def bucket(n: int) -> int:
    """The smallest power of two >= n (a step size bucket)."""
    return 1 << max(0, (n - 1).bit_length())


def _anchor(current: Mode, options: dict[Mode, float]) -> Mode | None:
    """The feasible mode that stands for `current` in the hysteresis: itself, else the other of
    merged X / mixed X (the same weights: merged X with a starving request -> mixed X, mixed X
    without other requests -> merged X); None if neither is feasible."""
    if current in options:
        return current
    other = Mode({"merged": "mixed", "mixed": "merged"}.get(current.name, current.name), current.merged)
    return other if other in options else None


def _target(mode: Mode) -> Hashable | None:
    """The adapter whose ΔW is in the weights in `mode` (None: unmerged)."""
    return None if mode.name == "unmerged" else mode.merged
