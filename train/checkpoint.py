"""Orbax checkpoints of the whole training state (adapters, optimizer states, gradient accumulators,
scheduler position). Orbax writes each step to a temporary folder and renames it when complete,
so a killed run never leaves a half-written checkpoint behind. Arrays are saved with their
sharding and restored into the template's: a run can resume on another mesh. With several
processes every process calls `save`/`restore_latest` (each writes its own shards)."""

from __future__ import annotations

import os
import shutil

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils


class Checkpointer:
    """Saves/restores a pytree under `directory/<microbatch index>`; keeps the last two."""

    def __init__(self, directory: str, primary: bool = True):
        self.directory = os.path.abspath(directory)
        self.primary = primary  # process 0: the one that removes old checkpoints
        self.manager = None

    def _manager(self) -> ocp.CheckpointManager:
        if self.manager is None:
            options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
            self.manager = ocp.CheckpointManager(self.directory, options=options)
        return self.manager

    def clear(self) -> None:
        """Forgets earlier checkpoints (a fresh, non-resumed run)."""
        self.manager = None
        if self.primary:
            shutil.rmtree(self.directory, ignore_errors=True)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("jaxlora checkpoints cleared")

    def save(self, step: int, state) -> None:
        manager = self._manager()
        if manager.latest_step() == step:
            return  # already saved (the last periodic checkpoint fell on the final microbatch)
        manager.save(step, args=ocp.args.StandardSave(state), force=True)
        manager.wait_until_finished()

    def restore_latest(self, template):
        """The newest complete checkpoint shaped like `template`, or None if there is none."""
        manager = self._manager()
        step = manager.latest_step()
        if step is None:
            return None
        return manager.restore(step, args=ocp.args.StandardRestore(template))
