"""The cost-based inference-mode policy of "auto" (issue 38): measured step costs and the queue.

`CostPolicy` holds the knobs (frozen, in `EngineConfig.mode_policy`); `start()` builds the one
stateful `CostModes` an engine keeps. Each step `choose` predicts, for the current requests, the
cost per token (below) of every mode it could run (`predict`), from these step times:

- unmerged: the unmerged step over N rows (N: the requests, at most `max_batch`);
- mixed X: that step times the mixed ratio r1 (with rows of other adapters; none: the merged
  ratio r0, `StepCosts.step`); also for the adapter merged now while it has no request;
- merged X: the merged step, an option only while every request is X's;
- plus, for a mode whose merged adapter differs from the current one, the switch time amortised
  over the steps a mode is expected to stay (the measured stays' moving average, at least
  `min_dwell`, and for merging X at least the tokens X's longest request still has to generate:
  X has requests that long).

Each option is priced per token: (step + amortised switch) x requests / rows (rows: at most
`max_batch`). Why merged X is not an option while other adapters have requests: it would serve X's
rows and leave the others waiting, and their token still needs a later step of every row (mixed X
on the same weights). Served in turns (merged, then mixed), X's requests get a token per
(T_merged + T_mixed) / 2 and the others one per T_merged + T_mixed; the mean over requests at a
share s of X is (T_merged + T_mixed)(1 - s / 2), below T_mixed only for s > 0.91 at the H200's
8B decode costs (T_merged 0.83 T_mixed), and by at most 2% there, while the others' TPOT
doubles. (A per-step price of a merged step, tried first, held merged X with others waiting: 4%
above mixed alone on the skew trace's replay.) Hysteresis: the merged adapter changes (a weight switch) only after
`min_dwell` steps with the current one and once the new one was the best `confirm` steps in a
row, and any change needs the new mode to be predicted `margin` cheaper than the current one; an
infeasible current mode is replaced by its feasible twin with the same weights (merged X when a
request of another adapter comes: mixed X; mixed X without other requests: merged X); the adapter
merged now stays a candidate while it has no request (mixed X), so a lull in X's traffic is no
switch away and back. Until a mixed cost is known, mixed X replaces unmerged once past the
dwell when X has most requests and the switch is cheap over their tokens (`_explore`): its cost
is measured, not taken from the prior.

Step costs (`StepCosts`) are medians of recent samples per token bucket (powers of two): the
unmerged step in seconds, the merged step as a ratio r0 to the unmerged one, and a mixed step with
rows of other adapters as a ratio r1, whatever their share: the H200 (8B, 2026-11-27) measured a
mixed decode step at the unmerged one's cost at every share (6.19 vs 6.21 ms at 8 rows), its LoRA
kernels costing per launch, not per row; a model linear in the share (tried first) put r1 at
1.5 from those samples and kept auto off mixed. Unmeasured buckets interpolate between the
measured ones (or take the nearest), else the priors (`default_step_s`, `merged_ratio`,
`mixed_ratio`); the engine's measurements replace them (`observe_step`). Pure host code over
`Pending` requests: no JAX, no engine.
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
    weights switch to it; margin: the fraction a new mode must be predicted cheaper by; ema: the
    weight of a new measurement (the switch time and the stays)."""

    max_batch: int = 256
    default_step_s: float = 0.03
    merged_ratio: float = 0.85
    mixed_ratio: float = 1.15
    switch_s: float = 0.01
    expected_stay: int = 32
    min_dwell: int = 8
    confirm: int = 4
    margin: float = 0.02
    ema: float = 0.2

    def __post_init__(self):
        if min(self.max_batch, self.min_dwell, self.confirm, self.expected_stay) < 1:
            raise ValueError("max_batch, min_dwell, confirm and expected_stay must be >= 1")
        if not (self.default_step_s > 0 and self.merged_ratio > 0 and self.mixed_ratio > 0 and self.switch_s >= 0):
            raise ValueError("default_step_s, merged_ratio, mixed_ratio must be > 0 and switch_s >= 0")
        if not (0 <= self.margin < 1 and 0 < self.ema <= 1):
            raise ValueError(f"margin in [0, 1) and ema in (0, 1]: got {self.margin}, {self.ema}")

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
        return base * (r0 if mode == "merged" or others == 0 else r1)

    def record(self, mode: str, tokens: int, seconds: float, others: float = 0.0) -> None:
        """Adds a measured step (a mixed step without rows of other adapters is a merged one).
        Each estimate is the median of its last `WINDOW` samples, set once `MIN_SAMPLES` are in
        (before that: the priors, or the measured buckets around): the unmerged seconds, the merged
        step's ratio to the unmerged one of its bucket (r0), and a mixed step's (r1, in [0.25, 8])."""
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
        if mode == "merged":
            if self._median("r0", b, seconds / base):
                self.merged_buckets.add(b)
            return
        self._median("r1", b, seconds / base, low=0.25, high=8.0)

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
            horizon = max([p.min_dwell, self.stay] + [r.remaining for r in requests if r.adapter == adapter])
            others = (total - n_x) / total
            if n_x == total:
                merged = Mode("merged", adapter)
                options[merged] = (self.costs.step("merged", rows) + self._switch(merged, current, horizon)) * per_row
            if others > 0:  # (with none, a mixed step is a merged one)
                mixed = Mode("mixed", adapter)
                options[mixed] = (self.costs.step("mixed", rows, others) + self._switch(mixed, current, horizon)) * per_row
        return options

    def _candidates(self, counts: collections.Counter, current: Mode) -> list[Hashable]:
        """The adapters worth merging: the most requested one (ties: the current) and the one
        merged now, also while it has no request (mixed X serves the others on X's weights: no
        switch away and back when X's next request comes); never the base model (None)."""
        named = {a: n for a, n in counts.items() if a is not None}
        top = [max(named, key=lambda a: (named[a], a == current.merged))] if named else []
        kept = current.merged if current.name != "unmerged" and current.merged is not None else None
        return top + ([kept] if kept is not None and kept not in top else [])

    def _switch(self, mode: Mode, current: Mode, horizon: float) -> float:
        """The switch time per step over `horizon` if `mode` changes the merged weights."""
        return 0.0 if _target(mode) == _target(current) else self.switch_s / horizon

    def _explore(self, chosen: Mode, options: dict[Mode, float], requests: list[Pending]) -> Mode:
        """Mixed X instead of unmerged, once past the dwell, while no mixed cost is known, X has
        more than half the requests and the switch amortised over X's requests costs at most the
        margin: one stay measures r1 (the prior is a guess; a stream without lulls in the others'
        traffic would never try it otherwise)."""
        p = self.policy
        if chosen.name != "unmerged" or any(key == "r1" for key, _ in self.costs.table) or self.steps_here < p.min_dwell:
            return chosen
        trial = next((mode for mode in options if mode.name == "mixed"), None)
        mine = [r.remaining for r in requests if trial is not None and r.adapter == trial.merged]
        if trial is None or 2 * len(mine) <= len(requests):
            return chosen
        horizon = max([p.min_dwell, self.stay] + mine)
        rows = min(len(requests), p.max_batch)
        return trial if self.switch_s / horizon <= p.margin * self.costs.unmerged(rows) else chosen

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
    merged X / mixed X (the same weights: merged X with another adapter's request -> mixed X, mixed X
    without other requests -> merged X); None if neither is feasible."""
    if current in options:
        return current
    other = Mode({"merged": "mixed", "mixed": "merged"}.get(current.name, current.name), current.merged)
    return other if other in options else None


def _target(mode: Mode) -> Hashable | None:
    """The adapter whose ΔW is in the weights in `mode` (None: unmerged)."""
    return None if mode.name == "unmerged" else mode.merged
