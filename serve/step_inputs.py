"""A step's small inputs in device buffers that stay put from step to step (vLLM's and SGLang's static
CUDA-graph inputs, here for XLA's command buffers).

XLA runs a step's kernels as CUDA graphs (command buffers). A graph records each kernel's buffer
addresses, so when a call's input buffers lie elsewhere than the last call's, XLA re-records the
graphs before launching them. Every step's tokens, positions, block tables, LoRA plan and previous
tokens arrive as fresh buffers (from numpy, or the last step's output), and that update is most of
the host's call of a step: H200, jax 0.11.2, 2026-11-29 (`bench/dispatch_probe.py`, 8B,
pallas LoRA): the call of a mixed step 7.0 -> 3.9 ms and of a 64-row decode step 5.2 -> 1.9 ms with
the same input buffers every call; `command_buffer::update` was 2.6-4.2 ms of a step's host time in
the disk tier's trace (`bench/slora_disk.py --profile-steps`).

`StepInputs.place(key, tree)` returns `tree` (a pytree of numpy and device arrays) as device arrays
held for `key` (the program: its shapes are fixed), written into the same buffers as at the last
call with that key: a jitted copy that donates the held arrays (XLA writes its output into them,
after the kernels of the step before, which read them, in stream order). The copy's own inputs are
new buffers, but its program is a handful of copies. Off (`enabled` False: a CPU backend, which
has no command buffers, or a mesh, whose programs place their inputs themselves) it returns `tree`
as it is. Opt-in for now (`EngineConfig.stable_step_inputs`): in the engine the host's `dispatch`
fell 0.3 ms a step, not the probe's 3 ms, and its serving guard is not yet measured with the copies
compiled at warmup (bench/NOTES_serve.md, "Seventeenth session").
"""

from __future__ import annotations

import functools
from typing import Hashable

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np


@functools.partial(jax.jit, donate_argnums=0)
def _refill(held, new):
    """`new` written into the buffers of `held` (donated; the same shapes and dtypes): an update of
    each held array, so XLA writes it in place (`new` returned as it is would be handed back in its
    own buffer, and an unused `held` dropped)."""
    return jax.tree.map(lambda h, n: lax.dynamic_update_slice(h, jnp.asarray(n, h.dtype), (0,) * h.ndim), held, new)


def forward_inputs(batch, lora, prev_tokens, token_src) -> tuple:
    """The tree of a forward's small inputs that `StepInputs` holds: the batch arrays, the LoRA
    plan (not the pool: its arrays stay put already), the previous step's tokens and the token
    sources. One definition for the engine's steps and its warmup (`prepare`), so their signatures
    agree."""
    return batch, None if lora is None else lora.plan, prev_tokens, token_src


def _spec(leaf) -> jax.ShapeDtypeStruct:
    """A leaf's shape and dtype (read from the leaf: a device array is not copied to the host)."""
    if not hasattr(leaf, "dtype"):
        leaf = np.asarray(leaf)
    return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype)


def _first(tree):
    """`tree` in new device buffers of the runtime's own (a CPU's `device_put` may share numpy's
    memory, which a later donation cannot write into)."""
    return jax.tree.map(lambda leaf: jnp.array(leaf, copy=True), tree)


class StepInputs:
    """Device buffers per program key for a step's small inputs (module doc)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._held: dict[Hashable, object] = {}
        self._copies: dict[Hashable, object] = {}  # the copy compiled ahead per (key, signature): `prepare`

    @staticmethod
    def signature(tree) -> tuple:
        """(tree structure, (shape, dtype) of every leaf): the buffers `tree` needs."""
        specs, treedef = jax.tree.flatten(jax.tree.map(_spec, tree))
        return treedef, tuple((spec.shape, str(spec.dtype)) for spec in specs)

    def place(self, key: Hashable, tree):
        """`tree` in the device buffers held for (`key`, its signature): placed there the first time,
        copied into them after (module doc); `tree` itself when off."""
        if not self.enabled:
            return tree
        full_key = (key, self.signature(tree))
        held = self._held.pop(full_key, None)
        placed = _first(tree) if held is None else self._copies.get(full_key, _refill)(held, tree)
        self._held[full_key] = placed
        return placed

    def prepare(self, key: Hashable, tree) -> None:
        """Compiles the copy `place` runs for `tree`'s signature under `key` now (`Engine.warmup`, per
        program): compiled at a step's first use it took a serving run's first steps (the guard's
        first case, H200 2026-11-29: its mixed steps +25%)."""
        full_key = (key, self.signature(tree))
        if not self.enabled or full_key in self._copies:
            return
        specs = jax.tree.map(_spec, tree)
        self._copies[full_key] = _refill.lower(specs, specs).compile()

    def clear(self) -> None:
        """Forgets the held buffers (e.g. after a failed step: the next step places its inputs anew)."""
        self._held.clear()
