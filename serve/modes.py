"""The serving engine's inference modes (V-LoRA §4.4, dLoRA): which mode each step runs in, the
merged adapter's ΔW in the base weights, and the deLoRA branch of mixed steps.

- unmerged: every row adds its adapter's LoRA (the adapter window or the LoRA kernels).
- merged: adapter X's ΔW is folded into the base kernels (`jaxlora.models.merged.set_merged`):
  X's rows run the plain base path (a base-only step, no LoRA cost); rows of other adapters and of
  the base model wait (`ServingScheduler.runs`).
- mixed (deLoRA): X merged; X's rows run the base path, every other row adds its own LoRA plus a
  -ΔW_X branch: X's A and B with negated scale in a window slot of its own (the key
  `delora_key`), each such token keeping that slot's shrink columns too (`WindowPlan.token_extra`),
  an extra low-rank term, never a dense ΔW. Needs the adapter window to cover the pool (X pinned
  in one pool slot leaves at most W - 1 other adapters a step, plus the branch).

Each step: `decide` picks the mode (`EngineConfig.inference_mode`: "auto" asks the policy object
built once from `EngineConfig.mode_policy`, by default the cost-based
`jaxlora.scheduler.serving.CostPolicy`, or V-LoRA's credits with a `ModePolicy`; a fixed mode
picks its merged adapter with `fixed_mode`)
and restricts the scheduler to the rows it can run; after the scheduler's loads, `apply` switches
the weights (one donated jitted update of every targeted kernel, all layers; unmerging restores
the kept base copy bit-identically) and lays the merged adapter's rows on the base path. The
merged adapter's pool slot stays pinned while its ΔW is in the weights. A switch between two
steps changes no request's tokens: each step computes its rows' own adapters either way. Each
finished step's seconds go back to the policy (`observe`: its mode, tokens, the share of rows
of other adapters, the switch before it; not a step during which a program compiled).
"""

from __future__ import annotations

import collections
import time
from typing import NamedTuple

import jax
import numpy as np

from jaxlora.nn.model_config import PROJECTIONS
from jaxlora.models.merged import MergeLayout, base_copy, merge_layout, set_merged
from jaxlora.scheduler.serving import (
    CostPolicy, Mode, ModePolicy, Pending, ServingScheduler, StepPlan, fixed_mode, runs_in,
)


class _Launched(NamedTuple):
    """What `observe` needs of a launched step: its plan (the engine lays its rows out in another
    plan of the same rows), mode, share of rows of other adapters
    than the merged one, the host seconds of the switch before it (None: none) and the engine's
    compile count when it was launched."""

    plan: StepPlan
    mode: str
    others: float
    switch_s: float | None
    compiles: int


class EngineModes:
    """The mode state of one engine: the configured mode ("auto", "merged" or "mixed"), the kept
    base columns, the merged adapter (uid, pool slot) and switch counters."""

    def __init__(self, name: str, policy: ModePolicy | CostPolicy, layout: MergeLayout, base: dict):
        self.name, self.policy, self.layout, self.base = name, policy, layout, base
        self.decider = policy.start()  # the policy's state: "auto" asks it each step
        self._launched: collections.deque = collections.deque(maxlen=4)  # `_Launched` of steps in flight
        self.mode = Mode()  # this step's
        self.merged: tuple | None = None  # (uid, pool slot) whose ΔW is in the weights
        self.switches = 0
        self.switch_seconds = 0.0  # host seconds of the switches (dispatch; the device runs them async)
        self.last_switch_s = 0.0
        self.mode_steps: collections.Counter = collections.Counter()
        self._served: dict = {}  # seq_id -> when it last got a row
        self._program = None  # `set_merged`, compiled on first use

    @classmethod
    def build(cls, name: str, policy: ModePolicy | CostPolicy, model_config, weights, modules) -> "EngineModes":
        """For the serving model's `weights` (nnx Variables by key; the kernels are copied now,
        before the KV pages are sized) and the pool's target `modules`."""
        layout = merge_layout(model_config, weights.keys(), modules)
        return cls(name, policy, layout, base_copy(layout, {key: weights[key][...] for key in layout.kernel_keys}))

    @classmethod
    def for_config(cls, config, model_config, weights, window, mesh, compressed) -> "EngineModes | None":
        """The mode state of `config.inference_mode` (an `EngineConfig`; None for "unmerged") over the
        serving model's `weights` (its base copy made now, before the KV pages are sized); ValueError
        where the mode cannot run: with a `mesh` or a `compressed` collection, or for "auto" and
        "mixed" without an adapter `window` (`AdapterWindow`, None: off) of max_adapters_on_device slots."""
        if config.inference_mode == "unmerged":
            return None
        if mesh is not None or compressed is not None:
            raise ValueError(f"inference_mode {config.inference_mode!r} needs one device and no compressed collection")
        if config.inference_mode != "merged" and (window is None or window.slots < config.max_adapters_on_device):
            raise ValueError(f"inference_mode {config.inference_mode!r} needs an adapter window of at least "
                             f"max_adapters_on_device ({config.max_adapters_on_device}) slots")
        policy = config.mode_policy or CostPolicy(max_batch=config.max_num_seqs)
        return cls.build(config.inference_mode, policy, model_config, weights, PROJECTIONS)

    # ---- before the scheduler ---------------------------------------------------------------
    def decide(self, scheduler: ServingScheduler, step_s: float) -> Mode:
        """Picks this step's mode from the waiting and running requests and restricts the
        scheduler's rows to it (`runs`)."""
        now = time.monotonic()
        requests = [Pending(seq.adapter, now - self._served.get(seq.seq_id, seq.arrival), seq.order, running,
                            max(0, seq.max_tokens - len(seq.output)))
                    for running, queue in ((True, scheduler.running), (False, scheduler.waiting)) for seq in queue]
        if self.name == "auto":
            self.mode = self.decider.choose(requests, self.mode, step_s, self.last_switch_s)
        else:
            self.mode = fixed_mode(requests, self.mode, self.name)
        mode = self.mode
        scheduler.runs = lambda key: runs_in(mode, key)
        return mode

    def prefix_root(self, key) -> tuple:
        """The scheduler's `prefix_root`: adapter `key` (None: the base model) and how this step
        computes its rows: plain (unmerged), on the merged weights (the merged adapter's rows), or
        beside them with the -ΔW branch (the others); the bits differ, so cached blocks do not mix."""
        merged = self.mode.merged if self.mode.name != "unmerged" else None
        if merged is None:
            return (key, "unmerged")
        return (key, "merged" if key == merged else "branch", merged)

    def relax(self, scheduler: ServingScheduler) -> bool:
        """"auto" in merged mode whose step got no rows (the merged adapter's requests wait for
        pages others hold, or for their last token): this step runs mixed instead (the same merged
        weights, every row), so nothing waits forever. Returns whether it relaxed (then schedule
        again)."""
        if self.name != "auto" or self.mode.name != "merged":
            return False
        self.mode = Mode("mixed", self.mode.merged)
        scheduler.runs = lambda key: True
        return True

    # ---- after the scheduler's loads --------------------------------------------------------
    def apply(self, engine, plan: StepPlan) -> None:
        """Switches the weights to this step's merged adapter (none in unmerged mode, or when the
        adapter is not on the device) and puts its rows on the base path (slot -1)."""
        self._note_served(engine.scheduler, plan)
        if not plan.rows:
            return
        uid = self.mode.merged if self.mode.name != "unmerged" else None
        slot = None if uid is None else engine.scheduler.slots.slot_of(uid)
        target = None if slot is None else (uid, slot)
        switched = target != self.merged and self._program is not None  # (not a first switch: it compiles)
        if target != self.merged:
            self.switch(engine, target)
        name = "unmerged" if target is None else self.mode.name
        self.mode_steps["unmerged" if target is None and self.mode.name == "mixed" else self.mode.name] += 1
        others = 0.0 if target is None else sum(row.seq.adapter != uid for row in plan.rows) / len(plan.rows)
        for row in plan.rows:
            if target is not None and row.seq.adapter == uid:
                row.slot = -1
        self._launched.append(_Launched(plan, name, others, self.last_switch_s if switched else None,
                                        engine.stats.step_compiles))

    def observe(self, engine, plan: StepPlan, seconds: float) -> None:
        """Gives the policy a finished step's `seconds` (`_Launched`), unless a program compiled
        since it was launched."""
        rows = {id(row) for row in plan.rows}
        launched = next((entry for entry in self._launched if {id(row) for row in entry.plan.rows} == rows), None)
        if launched is None:
            return
        self._launched.remove(launched)
        if engine.stats.step_compiles == launched.compiles:
            self.decider.observe_step(launched.mode, plan.num_tokens, seconds, launched.others, launched.switch_s)

    def delora_key(self, engine, plan: StepPlan) -> tuple | None:
        """The window key of the -ΔW branch, (-1 - pool slot, that slot's write count), when this
        is a mixed step with rows other than the merged adapter's; else None. Those rows'
        tokens keep the branch's columns (`branch_rows`)."""
        if self.merged is None or self.mode.name != "mixed" or not any(self._in_branch(row) for row in plan.rows):
            return None
        slot = self.merged[1]
        return -1 - slot, engine.pool.slot_writes[slot]

    def branch_rows(self, plan: StepPlan) -> np.ndarray:
        """[R] bool: the rows that add the -ΔW branch (mixed: every row not of the merged adapter)."""
        return np.array([self._in_branch(row) for row in plan.rows], bool)

    def _in_branch(self, row) -> bool:
        return self.merged is not None and row.seq.adapter != self.merged[0]

    def switch(self, engine, target: tuple | None) -> None:
        """Writes the base (+ ΔW of `target`'s pool slot) into the targeted kernels, in place; pins
        the merged adapter's slot while it is merged."""
        started = time.perf_counter()
        if target is not None:
            engine._commit_staged({target[1]})  # its pool slot holds its weights before ΔW is formed
        weights = engine._state["weights"]
        args = (self.layout, {key: weights[key][...] for key in self.layout.kernel_keys}, self.base,
                engine.pool.arrays, np.int32(0 if target is None else target[1]), np.bool_(target is not None))
        if self._program is None:
            self._program = set_merged.lower(*args).compile()
        for key, value in self._program(*args[1:]).items():
            weights[key].set_value(value)
        if self.merged is not None:
            engine.scheduler.slots.unpin(self.merged[0])
        if target is not None:
            engine.scheduler.slots.pin(target[0])
        self.merged = target
        self.switches += 1
        self.last_switch_s = time.perf_counter() - started
        self.switch_seconds += self.last_switch_s

    def _note_served(self, scheduler: ServingScheduler, plan: StepPlan) -> None:
        """Remembers when each row's request last got a row (its waiting time for the policy)."""
        now = time.monotonic()
        live = {seq.seq_id for seq in scheduler.running}
        self._served = {seq_id: t for seq_id, t in self._served.items() if seq_id in live}
        for row in plan.rows:
            self._served[row.seq.seq_id] = now

    def warmup(self, engine) -> None:
        """Compiles the switch (nothing runs)."""
        if self._program is None:
            weights = engine._state["weights"]
            kernels = {key: jax.ShapeDtypeStruct(weights[key][...].shape, weights[key][...].dtype)
                       for key in self.layout.kernel_keys}
            self._program = set_merged.lower(self.layout, kernels, self.base, engine.pool.arrays, np.int32(0),
                                             np.bool_(False)).compile()

    def snapshot(self) -> dict:
        """For /metrics: the mode, the merged adapter's uid, switches and their host seconds, steps per
        mode; what the "auto" policy measured (`mode_policy`)."""
        return {"inference_mode": self.mode.name, "merged_adapter": None if self.merged is None else self.merged[0],
                "mode_switches": self.switches, "mode_switch_seconds": self.switch_seconds,
                "mode_steps": dict(self.mode_steps), "mode_policy": self.decider.summary()}
