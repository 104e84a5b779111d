"""Placement of requests over replicas (Punica §4-5): the pure policy over replica states.

A front end over several serving replicas (engines on local devices, or servers on other hosts)
sends each new request to the replica with the **largest** batch that still has room for it:
its batch (requests placed there and not finished) below its maximum, and enough free KV pages
for the request's admission. Packing requests onto the busiest replicas keeps them busy (a large
batch costs about what a small one does per step) and lets idle ones drain and be released.
Ties: a replica that already holds the request's adapter on its device wins (S-LoRA/Punica
affinity: no adapter copy), then the lower replica id. Full, draining and unhealthy replicas are
skipped; None means no replica has room (the caller queues the request, first come first served,
or refuses it).

Migration uses the same policy: a request preempted on one replica for want of KV pages is placed
elsewhere (`exclude` its source) with the tokens it has so far.

Pure host-side Python: the mechanics (engines, HTTP) live in `serve.replicas` and `serve.router`.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Iterable

from jaxlora.scheduler.serving.pages import admission_pages


@dataclasses.dataclass(frozen=True)
class ReplicaState:
    """What placement knows of one replica: its batch (requests placed and not finished) and the
    most it runs at once, its free KV pages (net of what its queued requests will take) and page
    size, whether its admission reserves each request's whole output (`SchedulerConfig`), the
    adapters on its device, and whether it is draining or unreachable."""

    replica_id: int
    batch: int
    max_batch: int
    free_pages: int
    page_size: int
    reserve_output: bool = True
    adapters: frozenset = frozenset()
    draining: bool = False
    healthy: bool = True

    def pages_for(self, tokens: int, max_len: int) -> int:
        """KV pages a request of `tokens` tokens so far and at most `max_len` takes on admission here."""
        return admission_pages(tokens, max_len, self.page_size, self.reserve_output)

    def has_room(self, tokens: int, max_len: int) -> bool:
        """Whether a request fits now: a free batch row and its admission pages."""
        return (self.healthy and not self.draining and self.batch < self.max_batch
                and self.pages_for(tokens, max_len) <= self.free_pages)


def place(states: Iterable[ReplicaState], tokens: int, max_len: int, adapter: Hashable | None = None,
          exclude: Iterable[int] = ()) -> int | None:
    """The replica id for a request of `tokens` tokens so far (prompt, plus output when it
    migrates) and at most `max_len` tokens (prompt + max_tokens), for `adapter` (None: the base
    model): among the replicas with room (`ReplicaState.has_room`) not in `exclude`, the largest
    batch; ties to a replica holding the adapter, then the lowest id. None if none has room."""
    excluded = set(exclude)
    fits = [s for s in states if s.replica_id not in excluded and s.has_room(tokens, max_len)]
    if not fits:
        return None
    best = min(fits, key=lambda s: (-s.batch, adapter is None or adapter not in s.adapters, s.replica_id))
    return best.replica_id


class RoundRobin:
    """The baseline policy (same call as `place`): replicas take turns in id order; a replica
    without room (`ReplicaState.has_room`) or in `exclude` passes its turn. None if none has room."""

    def __init__(self):
        self.turn = 0

    def __call__(self, states: Iterable[ReplicaState], tokens: int, max_len: int, adapter: Hashable | None = None,
                 exclude: Iterable[int] = ()) -> int | None:
        excluded = set(exclude)
        ordered = sorted(states, key=lambda s: s.replica_id)
        for k in range(len(ordered)):
            state = ordered[(self.turn + k) % len(ordered)]
            if state.replica_id not in excluded and state.has_room(tokens, max_len):
                self.turn = (self.turn + k + 1) % len(ordered)
                return state.replica_id
        return None
