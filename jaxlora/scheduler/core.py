"""The scheduler core shared by training and serving: work items, the per-step token capacity,
and the co-scheduling policy that decides what the device runs next.

A device step runs work items of one adapter each: prefill chunks and decode rows (serving,
`jaxlora.scheduler.serving` picks them under the step's token budget) or a training microbatch
(forward + backward, `jaxlora.scheduler.training` packs it to the microbatch capacity). The two
policies stay what they are; `CoSchedulePolicy` composes them: each step is a serving step or a
training microbatch, serving first. The offline trainer (`train.trainer`) asks the same policy
with no serving load (every step is a training step); the server (`serve.engine`) asks it between
its steps with its scheduler's load, so a training microbatch runs only on steps serving leaves
idle (or below a configured load), and a request waits for at most one microbatch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

PREFILL, DECODE, TRAIN = "prefill", "decode", "train"
KINDS = (PREFILL, DECODE, TRAIN)
SERVE = "serve"  # a serving step (prefill and decode rows together)


@dataclasses.dataclass(frozen=True)
class WorkItem:
    """Tokens of one adapter (None: the base model) of one kind that a device step computes."""

    kind: str
    adapter: object
    tokens: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"work item kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.tokens < 0:
            raise ValueError(f"a work item has >= 0 tokens, got {self.tokens}")


@dataclasses.dataclass(frozen=True)
class TokenCapacity:
    """The tokens one device step holds: a serving step's token budget, a training microbatch's
    capacity (the compiled shape: more tokens do not fit, fewer are padding)."""

    tokens: int

    def __post_init__(self):
        if self.tokens < 1:
            raise ValueError(f"a step holds >= 1 token, got {self.tokens}")

    def used(self, items: Iterable[WorkItem]) -> int:
        return sum(item.tokens for item in items)

    def check(self, items: Iterable[WorkItem]) -> None:
        """ValueError when the items overflow one step."""
        used = self.used(items)
        if used > self.tokens:
            raise ValueError(f"a step of {used} tokens overflows its capacity of {self.tokens} tokens")


@dataclasses.dataclass(frozen=True)
class ServingLoad:
    """What the serving policy has to do: sequences waiting for admission (or a command not
    applied yet) and sequences running (decode rows every step); step_s: the last serving step's
    seconds (what a running sequence's next token costs)."""

    waiting: int = 0
    running: int = 0
    step_s: float = 0.0

    @property
    def busy(self) -> bool:
        return self.waiting > 0 or self.running > 0


IDLE = ServingLoad()


@dataclasses.dataclass(frozen=True)
class CoSchedulePolicy:
    """Serving first, training on the leftover steps.

    A training microbatch runs when serving is idle; or, with nothing waiting and at most
    `train_below` sequences running, between two serving steps, if the microbatch's expected
    seconds plus a serving step's stay within `tpot_target_s` (a decode step is never pushed past
    the time-per-output-token target; None: no target). A waiting request or a decode step is so
    delayed by at most one microbatch. Otherwise a serving step runs; nothing when neither side
    has work."""

    train_below: int = 0
    tpot_target_s: float | None = None

    def __post_init__(self):
        if self.train_below < 0:
            raise ValueError(f"train_below must be >= 0, got {self.train_below}")
        if self.tpot_target_s is not None and not self.tpot_target_s > 0:
            raise ValueError(f"tpot_target_s must be > 0 (or None), got {self.tpot_target_s}")

    def next_kind(self, serving: ServingLoad, training: WorkItem | None, training_s: float = 0.0) -> str | None:
        """SERVE, TRAIN or None (nothing to run); training_s: the training step's expected seconds."""
        if training is not None and serving.waiting == 0 and serving.running <= self.train_below:
            within = (serving.running == 0 or self.tpot_target_s is None
                      or serving.step_s + training_s <= self.tpot_target_s)
            if within:
                return TRAIN
        return SERVE if serving.busy else None


TRAINING_ONLY = CoSchedulePolicy()  # with no serving load every step is a training step
