"""Scheduling ahead of training in worker processes, so a training step never waits on it.

Packing (the MILPs) of upcoming windows of global batches runs in a
`concurrent.futures.ProcessPoolExecutor`; the parent merges, inserts no-ops and verifies
(milliseconds) and yields `Schedule` chunks in order. Workers start with "spawn" by default:
forking a process that already runs JAX threads is unsafe.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor

from jaxlora.scheduler.training.samples import TrainingData
from jaxlora.scheduler.training.schedule import (
    Finalizer, Schedule, SchedulerConfig, adapter_groups, pack_window, window_samples,
)


class ScheduleAhead:
    """Iterate over the schedule in chunks while workers pack the next windows.

    Each window is `batches_per_window` global batch indices; up to `lookahead` windows are
    being packed at once. Use as a context manager (or call `close`) to stop the workers.
    """

    def __init__(
        self,
        data: TrainingData,
        config: SchedulerConfig,
        batches_per_window: int = 1,
        lookahead: int = 2,
        max_workers: int = 1,
        start_method: str = "spawn",
    ) -> None:
        if batches_per_window < 1 or lookahead < 1:
            raise ValueError("batches_per_window and lookahead must be >= 1")
        self.data, self.config = data, config
        self.groups = adapter_groups(data, config.group_size)
        total = data.num_global_batches
        starts = range(0, total, batches_per_window)
        self.windows = [range(j, min(j + batches_per_window, total)) for j in starts]
        self.lookahead = lookahead
        context = multiprocessing.get_context(start_method)
        self.executor = ProcessPoolExecutor(max_workers, mp_context=context, initializer=_silence_stdout)

    def _submit(self, window: range) -> Future:
        samples = window_samples(self.data, window)
        return self.executor.submit(pack_window, samples, self.groups, self.config)

    def __iter__(self) -> Iterator[Schedule]:
        pending: deque[Future] = deque()
        upcoming = iter(self.windows)
        finalizer = Finalizer(self.data.global_batch_size, self.config)
        for window in upcoming:
            pending.append(self._submit(window))
            if len(pending) >= self.lookahead:
                break
        while pending:
            packed = pending.popleft().result()
            next_window = next(upcoming, None)
            if next_window is not None:
                pending.append(self._submit(next_window))
            yield finalizer.push(packed)
        yield finalizer.flush()

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ScheduleAhead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _silence_stdout() -> None:
    """Workers print nothing: HiGHS writes its banner to the process's stdout when a process makes
    its first solver (it would land in the middle of a progress bar or a notebook's output).
    Errors still reach the parent as exceptions."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
