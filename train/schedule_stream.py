"""Runs the training scheduler ahead of training and keeps the schedule it produced.

A background thread iterates `ScheduleAhead` (whose packing runs in worker processes) and hands
microbatches to the trainer through a queue. The finished schedule is written to
`schedule.json`, so that a resumed run replays exactly the same microbatches."""

from __future__ import annotations

import json
import os
import queue
import threading

from jaxlora.scheduler.training.samples import Sample, TrainingData
from jaxlora.scheduler.training.schedule import SchedulerConfig
from jaxlora.scheduler.training.ahead import ScheduleAhead

_DONE = object()


class ScheduleStream:
    """Iterates microbatches (tuples of `Sample`) as the scheduler produces them."""

    def __init__(self, data: TrainingData, config: SchedulerConfig, path: str):
        self.path = path
        self.microbatches: list[tuple[Sample, ...]] = []
        self.saved = threading.Event()  # set once the whole schedule is on disk
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self.loaded = os.path.exists(path)
        if self.loaded:
            self.microbatches = load_schedule(path)
            self.saved.set()
        else:
            threading.Thread(target=self._produce, args=(data, config), daemon=True).start()

    def _produce(self, data: TrainingData, config: SchedulerConfig) -> None:
        produced = []
        try:
            with ScheduleAhead(data, config, batches_per_window=1, lookahead=2) as ahead:
                for chunk in ahead:
                    for microbatch in chunk.microbatches:
                        produced.append(tuple(microbatch))
                        self._queue.put(produced[-1])
            _write_schedule(self.path, produced)
            self.saved.set()
        except BaseException as err:  # surfaced in the training thread
            self._error = err
        finally:
            self._queue.put(_DONE)

    def __iter__(self):
        if self.loaded:
            yield from self.microbatches
            return
        while True:
            item = self._queue.get()
            if item is _DONE:
                break
            self.microbatches.append(item)
            yield item
        if self._error is not None:
            raise RuntimeError(f"the scheduler failed: {self._error}") from self._error


def _write_schedule(path: str, microbatches) -> None:
    rows = [[[s.adapter_id, s.sample_index, s.num_tokens] for s in mb] for mb in microbatches]
    temporary = f"{path}.tmp"
    with open(temporary, "w") as f:
        json.dump({"microbatches": rows}, f)
    os.replace(temporary, path)


def load_schedule(path: str) -> list[tuple[Sample, ...]]:
    with open(path) as f:
        rows = json.load(f)["microbatches"]
    return [tuple(Sample(*entry) for entry in mb) for mb in rows]
