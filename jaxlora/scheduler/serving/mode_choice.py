"""Which inference mode the serving engine's next step runs in (V-LoRA §4.4, Alg. 1; dLoRA).

Modes: "unmerged" (every row's adapter as LoRA: the window or the LoRA kernels), "merged" (one
adapter's ΔW folded into the base weights: only its rows run, on the plain base path), "mixed"
(deLoRA: that adapter merged; every row runs, the others adding their own LoRA and a -ΔW branch).
`choose_mode` is V-LoRA's credit-based policy (`ModePolicy`; "auto" runs it when the engine's
`mode_policy` is one; the default is the cost-based `mode_costs.CostPolicy`, issue 38);
`fixed_mode` picks the merged adapter of an engine held in one mode. Pure host functions over
`Pending` requests: no JAX, no engine.

Alg. 1 as built here: every request gets a credit, its waiting time plus the current mode's step
time plus the switch latency. The merge criterion: the adapter with the most requests (waiting and
running; base-model requests count against it) has at least `merge_share` of them. Requests that
the merged adapter's mode leaves waiting (every other one) starve when their credit exceeds
`starve_s`. If the criterion holds: merged, unless more than `theta` requests starve (mixed: they
run beside the merged adapter) or more than half of `max_batch` starve (unmerged). Without a
dominant adapter: unmerged.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Hashable

MODES = ("unmerged", "merged", "mixed")
INFERENCE_MODES = ("auto",) + MODES


@dataclasses.dataclass(frozen=True)
class ModePolicy:
    """Thresholds of `choose_mode`. merge_share: the dominant adapter's least share of the
    requests for merging; starve_s: a request whose credit exceeds it starves; theta: more starving
    requests than this run in mixed mode; max_batch: more than half of it starving -> unmerged.
    The defaults follow V-LoRA's shape (θ small, half the batch) with a starvation bound of a few
    8B decode steps (100 ms) and θ = 0 (with θ > 0, up to θ starving requests wait as long as the
    merged adapter has requests); not tuned on a GPU yet (`bench/serve.py --modes-skew`)."""

    merge_share: float = 0.6
    starve_s: float = 0.1
    theta: int = 0
    max_batch: int = 256

    def __post_init__(self):
        if not 0 < self.merge_share <= 1:
            raise ValueError(f"merge_share must be in (0, 1], got {self.merge_share}")
        if not self.starve_s >= 0 or self.theta < 0 or self.max_batch < 1:
            raise ValueError(f"starve_s and theta must be >= 0 and max_batch >= 1, got {self.starve_s}, "
                             f"{self.theta}, {self.max_batch}")

    def start(self) -> "CreditModes":
        """The policy's state for one engine (`CostPolicy.start`'s interface)."""
        return CreditModes(self)


@dataclasses.dataclass(frozen=True)
class Pending:
    """A request as the policy sees it: its adapter (None: the base model), seconds since it last
    got a row (or since it arrived), its arrival order (smaller: older), whether it is running
    (admitted: it holds its KV pages), and the tokens it may still generate (max_tokens - output)."""

    adapter: Hashable | None
    waited_s: float
    order: int = 0
    running: bool = False
    remaining: int = 0


@dataclasses.dataclass(frozen=True)
class Mode:
    """A step's mode and the merged adapter (None in unmerged mode; in merged mode None serves the
    base model's rows with nothing merged)."""

    name: str = "unmerged"
    merged: Hashable | None = None


def choose_mode(requests: list[Pending], current: Mode, step_s: float, switch_s: float,
                policy: ModePolicy) -> Mode:
    """V-LoRA Alg. 1 (module doc) over the waiting and running `requests`; step_s: the current
    mode's step time, switch_s: a mode switch's latency (both seconds, measured by the caller).
    No requests: the current mode."""
    if not requests:
        return current
    dominant, share = _dominant(requests, current.merged)
    if dominant is None or share < policy.merge_share:
        return Mode("unmerged")
    credit = step_s + switch_s
    starving = sum(r.adapter != dominant and r.waited_s + credit > policy.starve_s for r in requests)
    if starving > policy.max_batch / 2:
        return Mode("unmerged")
    if starving > policy.theta:
        return Mode("mixed", dominant)
    return Mode("merged", dominant)


class CreditModes:
    """`choose_mode` behind the interface of `mode_costs.CostModes` (it measures nothing)."""

    def __init__(self, policy: ModePolicy):
        self.policy = policy

    def choose(self, requests: list[Pending], current: Mode, step_s: float = 0.0, switch_s: float = 0.0) -> Mode:
        """`choose_mode` with the current mode's step time and the last switch's time."""
        return choose_mode(requests, current, step_s, switch_s, self.policy)

    def observe_step(self, mode: str, tokens: int, seconds: float, others: float = 0.0,
                     switch_s: float | None = None) -> None:
        """Nothing: the credits take the engine's last step and switch times."""

    def summary(self) -> dict:
        """Nothing measured."""
        return {}


def fixed_mode(requests: list[Pending], current: Mode, name: str) -> Mode:
    """The mode of an engine held in mode `name`. "merged" (merged-only serving): while requests
    run, the current target if one of them is its (its adapter, or None: the base model), else the
    oldest running request's; with none running, the current target if it has waiting requests,
    else the oldest waiting request's. Running requests go first because they hold their KV pages
    (a target whose requests all wait for pages that others hold would wait forever); a steady
    stream of the target's requests keeps the others waiting (merged-only serving starves; "auto"
    does not). "mixed": the adapter with the most requests merged, kept while it has any;
    "unmerged": nothing merged."""
    if name == "unmerged":
        return Mode("unmerged")
    if not requests:
        return current if current.name == name else Mode(name)
    if name == "mixed":
        if current.name == name and current.merged in {r.adapter for r in requests}:
            return current
        return Mode("mixed", _dominant(requests, current.merged)[0])
    running = [r for r in requests if r.running] or requests
    if current.name == name and current.merged in {r.adapter for r in running}:
        return current
    return Mode("merged", min(running, key=lambda r: r.order).adapter)


def runs_in(mode: Mode, adapter: Hashable | None) -> bool:
    """Whether a request of `adapter` can get rows in `mode` (merged: only the merged target's)."""
    return mode.name != "merged" or adapter == mode.merged


def _dominant(requests: list[Pending], preferred) -> tuple[Hashable | None, float]:
    """(the adapter with the most requests, ties to `preferred` then the oldest request; its share
    of all requests, base-model ones included); (None, 0) if every request is on the base model."""
    counts = collections.Counter(r.adapter for r in requests if r.adapter is not None)
    if not counts:
        return None, 0.0
    oldest = {}
    for r in requests:
        oldest[r.adapter] = min(oldest.get(r.adapter, r.order), r.order)
    best = max(counts, key=lambda a: (counts[a], a == preferred, -oldest[a]))
    return best, counts[best] / len(requests)
