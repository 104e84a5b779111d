"""V-LoRA's accuracy-aware knowledge fusion (§4.2.1), the packing logic alone: put tasks into as
few adapters as their accuracy requirements allow, with the paper's greedy heuristic.

Tasks come in order (the paper starts from a random task: `fusion_order`). Each task is added to
an open adapter: that adapter is retrained on all its tasks and evaluated (`FusionBackend.fit`);
the task stays only if every task of the adapter still meets its requirement, else the adapter
keeps its previous state (the earlier fit) and the task is tried in the next open adapter, or in
a new adapter of its own. `next_fit` (the paper) keeps only the newest adapter open; `first_fit`
tries every adapter whose tasks all meet their requirements, oldest first. A task that misses its
requirement even alone keeps its adapter (it fits nowhere else), which then takes no more tasks.

Training and evaluation stay behind `FusionBackend` (`train.fusion_run` trains with `Trainer`
and checks generated answers); tests script the accuracies."""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable, Protocol


@dataclasses.dataclass(frozen=True)
class FusionTask:
    """One task: a job's name and its accuracy requirement on its evaluation set (0..1)."""

    name: str
    min_accuracy: float


@dataclasses.dataclass(frozen=True)
class Fit:
    """An adapter trained on some tasks: each task's accuracy, and the adapter itself (opaque here)."""

    accuracy: dict[str, float]
    adapter: Any = None


class FusionBackend(Protocol):
    def fit(self, tasks: tuple[FusionTask, ...]) -> Fit:
        """Trains one fresh adapter on all `tasks` together and evaluates it on each task."""


@dataclasses.dataclass
class FusedAdapter:
    """An adapter of the packing: its tasks (in the order added) and its latest accepted fit."""

    tasks: tuple[FusionTask, ...]
    fit: Fit

    def meets(self) -> bool:
        return meets_all(self.tasks, self.fit)


@dataclasses.dataclass(frozen=True)
class Trial:
    """One fit of the packing: which adapter (index), with which tasks, and whether it was kept."""

    adapter: int
    tasks: tuple[str, ...]
    accuracy: dict[str, float]
    accepted: bool


@dataclasses.dataclass
class Packing:
    adapters: list[FusedAdapter]
    trials: list[Trial]
    on_trial: Callable[[Trial], None] | None = None

    def record(self, trial: Trial) -> None:
        self.trials.append(trial)
        if self.on_trial is not None:
            self.on_trial(trial)


def meets_all(tasks: tuple[FusionTask, ...], fit: Fit) -> bool:
    """Every task's accuracy in `fit` is at least its requirement."""
    return all(fit.accuracy[task.name] >= task.min_accuracy for task in tasks)


def fusion_order(tasks: list[FusionTask], order: str, seed: int) -> list[FusionTask]:
    """`given`: as listed; `random`: a seeded shuffle (the paper starts from a random dataset)."""
    if order == "given":
        return list(tasks)
    if order == "random":
        shuffled = list(tasks)
        random.Random(seed).shuffle(shuffled)
        return shuffled
    raise ValueError(f"fusion order {order!r} is not one of random, given")


def pack(tasks: list[FusionTask], backend: FusionBackend, policy: str = "next_fit",
         on_trial: Callable[[Trial], None] | None = None) -> Packing:
    """Packs `tasks` (in this order) into adapters greedily; returns the adapters and every fit
    tried (also handed to `on_trial` as each ends: progress)."""
    if policy not in ("next_fit", "first_fit"):
        raise ValueError(f"fusion policy {policy!r} is not one of next_fit, first_fit")
    names = [task.name for task in tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"task names must be unique: {names}")
    packing = Packing([], [], on_trial)
    for task in tasks:
        if not any(_try_add(packing, index, task, backend) for index in _open_adapters(packing, policy)):
            _new_adapter(packing, task, backend)
    return packing


def _open_adapters(packing: Packing, policy: str) -> list[int]:
    """Indices of the adapters that may take the next task, in the order they are tried."""
    candidates = range(len(packing.adapters)) if policy == "first_fit" else range(len(packing.adapters))[-1:]
    return [index for index in candidates if packing.adapters[index].meets()]


def _try_add(packing: Packing, index: int, task: FusionTask, backend: FusionBackend) -> bool:
    adapter = packing.adapters[index]
    tasks = adapter.tasks + (task,)
    fit = _checked_fit(backend, tasks)
    accepted = meets_all(tasks, fit)
    packing.record(Trial(index, tuple(t.name for t in tasks), dict(fit.accuracy), accepted))
    if accepted:
        packing.adapters[index] = FusedAdapter(tasks, fit)
    return accepted


def _new_adapter(packing: Packing, task: FusionTask, backend: FusionBackend) -> None:
    fit = _checked_fit(backend, (task,))
    packing.record(Trial(len(packing.adapters), (task.name,), dict(fit.accuracy), True))
    packing.adapters.append(FusedAdapter((task,), fit))


def _checked_fit(backend: FusionBackend, tasks: tuple[FusionTask, ...]) -> Fit:
    fit = backend.fit(tasks)
    missing = [task.name for task in tasks if task.name not in fit.accuracy]
    if missing:
        raise ValueError(f"the fusion backend returned no accuracy for {missing}")
    return fit


def adapter_names(packing: Packing) -> list[str]:
    """adapter_1, adapter_2, ... in the order the adapters were started."""
    return [f"adapter_{index + 1}" for index in range(len(packing.adapters))]


def packing_report(packing: Packing) -> dict:
    """JSON-ready: per task (requirement, adapter, accuracy, met), per adapter, and every trial."""
    names = adapter_names(packing)
    tasks = [{"task": task.name, "min_accuracy": task.min_accuracy, "adapter": name,
              "accuracy": adapter.fit.accuracy[task.name], "met": adapter.fit.accuracy[task.name] >= task.min_accuracy}
             for name, adapter in zip(names, packing.adapters) for task in adapter.tasks]
    adapters = [{"name": name, "tasks": [task.name for task in adapter.tasks], "accuracy": dict(adapter.fit.accuracy)}
                for name, adapter in zip(names, packing.adapters)]
    trials = [{"adapter": names[trial.adapter], "tasks": list(trial.tasks), "accuracy": trial.accuracy,
               "accepted": trial.accepted} for trial in packing.trials]
    return {"num_tasks": len(tasks), "num_adapters": len(adapters), "all_met": all(t["met"] for t in tasks),
            "tasks": tasks, "adapters": adapters, "trials": trials}


def format_trial(trial: Trial) -> str:
    """One line of progress: the adapter, its tasks' accuracies, kept or rolled back."""
    accuracy = ", ".join(f"{name} {trial.accuracy[name]:.0%}" for name in trial.tasks)
    return f"adapter_{trial.adapter + 1} <- {trial.tasks[-1]}: {accuracy}: {'kept' if trial.accepted else 'rolled back'}"


def format_table(report: dict) -> str:
    """The report's task rows as a text table (task, requirement, adapter, accuracy, met)."""
    width = max(len("task"), *(len(row["task"]) for row in report["tasks"]))
    lines = [f"{'task':<{width}}  required  adapter     accuracy  met"]
    for row in report["tasks"]:
        lines.append(f"{row['task']:<{width}}  {row['min_accuracy']:>8.0%}  {row['adapter']:<10}  "
                     f"{row['accuracy']:>8.0%}  {'yes' if row['met'] else 'NO'}")
    lines.append(f"{report['num_tasks']} tasks in {report['num_adapters']} adapters; "
                 + ("every requirement met" if report["all_met"] else "some requirements NOT met")
                 + f"; {len(report['trials'])} adapters trained")
    return "\n".join(lines)
