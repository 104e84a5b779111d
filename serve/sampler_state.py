"""The serving engine's per-sequence sampler state on the device: which sequence holds which
`SamplerState` slot, and writing a slot when a sequence gets it.

A sequence whose logits depend on more than its own logits (a logit bias, penalties over its
prompt and output tokens, min_tokens) or that asks for log-probabilities gets a slot the first
time one of its rows is built (its output counts written then: non-zero for a resumed sequence),
and keeps it until it finishes or is preempted (`release`); a slot is freed lazily, when the
next sequence needs one (a finished sequence's row still in flight only adds to the counts of a
slot that is rewritten after it: the device runs the writes and the steps in the order they are
dispatched). There are as many slots as running sequences can be (`max_num_seqs`), so a running
sequence always finds one. The arrays ([S, V] each, about 10 bytes per slot and vocabulary
entry) are allocated at the first such sequence: an engine that never sees one holds none.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.sampling import SamplingParams
from serve.step import RowSampling, RowState, SamplerState


class SamplerSlots:
    """Slots of `SamplerState` for sequences, and the device arrays (see the module doc)."""

    def __init__(self, num_slots: int, vocab_size: int, sharding=None):
        """sharding: where the arrays live (e.g. replicated over the engine's mesh); None: the
        default device."""
        self.num_slots, self.vocab_size, self.sharding = num_slots, vocab_size, sharding
        self.arrays: SamplerState | None = None
        self._holders: dict = {}  # slot -> the Sequence holding it
        self._slot_of: dict = {}  # seq_id -> slot

    def specs(self) -> SamplerState:
        """The arrays' shapes and dtypes (for compiling ahead of time)."""
        shape = (self.num_slots, self.vocab_size)
        dtypes = (jnp.bool_, jnp.int32, jnp.float32, jnp.bool_)
        return SamplerState(*(jax.ShapeDtypeStruct(shape, d, sharding=self.sharding) for d in dtypes))

    def slot(self, seq, eos_ids) -> int:
        """The slot of `seq` (a scheduler Sequence whose `sampling` is a SamplingParams), given one
        and written now (its prompt, bias and stop tokens; zero counts) if it has none."""
        slot = self._slot_of.get(seq.seq_id)
        if slot is not None:
            return slot
        slot = self._free_slot()
        self._holders[slot], self._slot_of[seq.seq_id] = seq, slot
        self.allocate()
        prompt, bias, stop = slot_rows(seq.prompt, seq.sampling, eos_ids, self.vocab_size)
        counts = np.bincount([t for t in seq.output if t >= 0], minlength=self.vocab_size).astype(np.int32)
        self.arrays = _write_slot(self.arrays, np.int32(slot), prompt, counts, bias, stop)
        return slot

    def release(self, seq_id) -> None:
        """Frees the slot of `seq_id` if it holds one (a preempted sequence: its unread token may
        have been counted; it gets a slot written afresh from its prompt and output when next built)."""
        slot = self._slot_of.pop(seq_id, None)
        if slot is not None:
            del self._holders[slot]

    def allocate(self) -> None:
        """Allocates the arrays (zeros) if they are not yet."""
        if self.arrays is None:
            self.arrays = _zeros(self.specs())

    def reset(self) -> None:
        """Forgets every slot and the arrays (after a failed step, whose donated arrays are gone)."""
        self.arrays = None
        self._holders.clear()
        self._slot_of.clear()

    def _free_slot(self) -> int:
        for slot, holder in list(self._holders.items()):
            if holder.finish_reason is not None:
                del self._holders[slot], self._slot_of[holder.seq_id]
        free = next((s for s in range(self.num_slots) if s not in self._holders), None)
        if free is None:
            raise RuntimeError(f"all {self.num_slots} sampler slots are held by running sequences")
        return free


def slot_rows(prompt, sampling: SamplingParams, eos_ids, vocab_size: int):
    """A slot's host rows [V]: (prompt tokens bool, logit bias float32, stop tokens bool)."""
    seen = np.zeros(vocab_size, bool)
    seen[np.asarray(prompt, np.int64)] = True
    bias = np.zeros(vocab_size, np.float32)
    for token, value in sampling.logit_bias:
        bias[token] += value
    stop = np.zeros(vocab_size, bool)
    stop[sorted(t for t in sampling.stop_ids(eos_ids) if 0 <= t < vocab_size)] = True
    return seen, bias, stop


def _zeros(specs: SamplerState) -> SamplerState:
    return SamplerState(*(jnp.zeros(s.shape, s.dtype, device=s.sharding) for s in specs))


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_slot(state: SamplerState, slot, prompt_seen, output_counts, bias, stop_mask) -> SamplerState:
    """`state` with slot `slot` holding these rows [V] (output_counts: of the output tokens so far,
    non-zero for a resumed sequence)."""
    return SamplerState(state.prompt_seen.at[slot].set(prompt_seen),
                        state.output_counts.at[slot].set(output_counts),
                        state.bias.at[slot].set(bias),
                        state.stop_mask.at[slot].set(stop_mask))


def step_sampling(plan_rows, rows: int, slots: SamplerSlots, eos_ids, masked: bool = False):
    """(program, inputs) of the sampler that a step over `plan_rows` (scheduler StepRows, in the
    step's order, padded to `rows`) runs: ("sample_state", (RowSampling, RowState)) when a row
    changes its logits (bias, penalties, min_tokens; its sequence gets a slot) or asks for
    log-probabilities; ("sample", (RowSampling,)) when a row samples (temperature > 0) or `masked`
    (a row follows a grammar: the program's "_masked" variant, which also takes a token mask);
    None when every row takes the forward's greedy token."""
    params = [row.seq.sampling for row in plan_rows]
    stateful = any(p.needs_state for p in params)
    suffix = "_masked" if masked else ""
    if not stateful and not masked and all(p.temperature == 0 for p in params):
        return None
    sampling = RowSampling.greedy(rows)
    for r, (row, p) in enumerate(zip(plan_rows, params)):
        sampling.temperature[r], sampling.top_p[r], sampling.top_k[r], sampling.min_p[r] = (
            p.temperature, p.top_p, p.top_k, p.min_p)
        sampling.seeds[r], sampling.counters[r] = p.seed % (1 << 32), _output_index(row)
    if not stateful:
        return "sample" + suffix, (sampling,)
    state = RowState.empty(rows, slots.num_slots)
    for r, (row, p) in enumerate(zip(plan_rows, params)):
        if not p.changes_logits:
            continue
        slot = slots.slot(row.seq, eos_ids)
        state.slot[r], state.count_slot[r] = slot, slot if row.sample else slots.num_slots
        state.presence[r], state.frequency[r], state.repetition[r] = (
            p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        state.suppress_stop[r] = _output_index(row) < p.min_tokens
    slots.allocate()
    return "sample_state" + suffix, (sampling, state)


def _output_index(row) -> int:
    """The index of the output token a step row samples (its last token's position + 1 - prompt)."""
    return row.start + row.count - len(row.seq.prompt)
