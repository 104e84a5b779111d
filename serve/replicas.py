"""Several engines behind one front end (Punica §4-5): placement, migration, cancellation, drain.

A `ReplicaSet` holds N `Engine`s (one per local device: `ReplicaSet.on_devices`; or any engines,
e.g. N on one CPU in tests) and offers the engine's interface that `serve.app` uses (submit,
abort, adapters, warm-up, start/stop, snapshot), so `jaxlora-serve --replicas N` is the same HTTP
server over a replica set.

- Placement (`jaxlora.scheduler.serving.placement.place`): each new request goes to the replica
  with the largest batch that still has room for it (a free row and the KV pages its admission
  takes), ties to a replica holding its adapter, then the lowest id. The set keeps its own ledger
  of the requests it placed (prompt, tokens delivered so far, replica), so the states it places by
  are exact at once, not one scrape late. When no replica has room, requests wait in the set's
  queue, in the order of the engines' `schedule_policy` (fcfs: first come first served; lof: the
  most output tokens still to come first), and are placed as requests finish.
- Migration: each engine's `handoff` is the set's. An engine that cannot grow a running request's
  KV (`EngineConfig.reserve_output_kv=False`) preempts its newest request and hands it here with
  the tokens already delivered; the set places it on another replica (its source excluded; if no
  other has room, it waits in the queue, by arrival under fcfs), which recomputes prompt + output
  in one prefill and continues. The client's callback is the same object throughout, so its
  stream goes on without a gap or a repeated token, and greedy (or seeded) tokens are unchanged.
- Cancellation: `abort` reaches whichever replica holds the request now (or takes it out of the
  queue, or catches it between replicas), and that engine frees its pages.
- Drain: `drain(i)` stops placing on replica i; with `migrate`, its requests are handed off at
  once, else they finish there; `load()` reports each replica's load and whether it is idle
  (draining and empty: an operator or autoscaler may release it). `drain(i, undo=True)` resumes.

Adapters are registered on every replica (each engine has its own adapter store, host cache and
device pool); the first replica's store stands for all where the app awaits a directory
adapter's first read and in /metrics' adapter-tier gauges (`adapters`), and `stats` sums the
engines' counters.

`server_state(engine_or_set)` is the JSON of `GET /state` (one entry per replica; a plain engine is
one replica), which `serve.router` places by across servers.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import threading
from typing import Callable

from jaxlora.lora.adapter import LoraAdapter
from jaxlora.sampling import SamplingParams
from jaxlora.scheduler.serving import SCHEDULE_POLICIES, ReplicaState, admission_pages, place
from jaxlora.sharding import make_mesh
from jaxlora.lora.head import TaskHead
from serve.engine import Engine, EngineBusy, Event, Handoff


@dataclasses.dataclass
class _Placed:
    """A request the set knows: what it needs to be placed (again), where it runs (None: queued)."""

    request_id: object
    prompt: list[int]
    adapter: str | None
    sampling: SamplingParams
    callback: Callable[[Event], None]  # the client's
    arrival: int
    output: list[int] = dataclasses.field(default_factory=list)  # tokens delivered so far
    replica: int | None = None
    exclude: tuple[int, ...] = ()  # a migrated request's source, for its next placement
    aborted: bool = False
    head: TaskHead | None = None  # a classification's task head (`classify`)

    @property
    def max_len(self) -> int:
        return len(self.prompt) + self.sampling.max_new_tokens

    def pages(self, page_size: int, reserve_output: bool) -> int:
        """KV pages it holds (or its admission takes) on a replica."""
        return admission_pages(len(self.prompt) + len(self.output), self.max_len, page_size, reserve_output)


class ReplicaSet:
    """Engines behind one front end (see the module doc); thread-safe like an `Engine`."""

    def __init__(self, engines: list[Engine], policy: Callable = place):
        """policy(states, tokens, max_len, adapter, exclude) -> replica id or None: `place`
        (Punica), or e.g. `RoundRobin()` as a baseline (bench/cluster.py)."""
        if not engines:
            raise ValueError("a replica set needs at least one engine")
        self.engines, self.policy = list(engines), policy
        self.config, self.model_config = engines[0].config, engines[0].model_config
        self._lock = threading.RLock()
        self._requests: dict[object, _Placed] = {}
        self._queue: list[_Placed] = []  # no replica had room: sorted by `_queue_key`
        policy = SCHEDULE_POLICIES[self.config.schedule_policy]
        self._queue_key = lambda p: policy(p.arrival, p.sampling.max_new_tokens - len(p.output))
        self._draining: set[int] = set()
        self._arrivals = itertools.count()
        self._started = False
        self.migrations = 0
        for index, engine in enumerate(self.engines):
            engine.handoff = lambda handoff, index=index: self._migrated(index, handoff)

    @classmethod
    def on_devices(cls, model, eos_ids, config, adapters: dict[str, LoraAdapter] | None, devices,
                   policy: Callable = place) -> "ReplicaSet":
        """One engine per device of `devices` (each a (tensor=1) mesh over it: its own copy of the
        weights, adapter pool and KV pages)."""
        return cls([Engine(model, eos_ids, config, adapters, mesh=make_mesh(tensor=1, devices=[device]))
                    for device in devices], policy)

    # ---- the engine's interface (serve.app) ---------------------------------------------
    def adapter_names(self) -> list[str]:
        return self.engines[0].adapter_names()

    @property
    def adapters(self):
        """The first replica's adapter store (see the module doc)."""
        return self.engines[0].adapters

    @property
    def stats(self) -> "_SummedStats":
        return _SummedStats(self.engines)

    def resolve_adapter(self, name: str):
        """`Engine.resolve_adapter` on every replica (a directory adapter is registered on each);
        the first replica's entry."""
        entries = [engine.resolve_adapter(name) for engine in self.engines]
        return entries[0]

    def add_adapter(self, name: str, adapter: LoraAdapter, path: str | None = None) -> None:
        """Registers `adapter` on every replica (none if one refuses it: the error is raised)."""
        done = []
        try:
            for engine in self.engines:
                engine.add_adapter(name, adapter, path)
                done.append(engine)
        except Exception:
            for engine in done:
                engine.remove_adapter(name)
            raise

    def remove_adapter(self, name: str) -> None:
        for engine in self.engines:
            engine.remove_adapter(name)

    def task_head(self, name: str) -> TaskHead:
        """`Engine.task_head` of the first replica (every replica registers the same folders)."""
        self.resolve_adapter(name)
        return self.engines[0].task_head(name)

    def classify(self, request_id, prompt: list[int], adapter: str, callback: Callable[[Event], None]) -> None:
        """`Engine.classify` on the replica the placement policy picks (a one-token request)."""
        self.submit(request_id, prompt, adapter, SamplingParams(max_new_tokens=1), callback, self.task_head(adapter))

    def validate(self, prompt_len: int, max_tokens: int) -> None:
        self.engines[0].validate(prompt_len, max_tokens)

    def warmup(self, shapes=None, threads: int | None = None) -> dict:
        infos = [engine.warmup(shapes, threads) for engine in self.engines]
        return {"programs": sum(i["programs"] for i in infos), "seconds": sum(i["seconds"] for i in infos)}

    def start(self) -> None:
        self._started = True
        for engine in self.engines:
            engine.start()

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()

    @property
    def alive(self) -> bool:
        return all(engine.alive for engine in self.engines)

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        """Steps every engine in turn in the calling thread until none has work (tests, offline)."""
        for _ in range(max_steps):
            busy = [engine.step() for engine in self.engines]  # a list: every engine steps each round
            if not any(busy) and not self._queue:
                return
        raise RuntimeError(f"still busy after {max_steps} rounds")

    def snapshot(self) -> dict:
        """The engines' snapshot counts summed (per replica: `load`)."""
        snaps = [engine.snapshot() for engine in self.engines]
        summed = {key: sum(s[key] for s in snaps) for key in ("running", "waiting", "free_pages", "total_pages",
                                                              "tokens_per_second", "dropped_overloaded",
                                                              "adapters_on_device")}
        pages = {holder: sum(s["pages"][holder] for s in snaps) for holder in snaps[0]["pages"]}
        rows = {kind: sum(s["adapter_rows"][kind] for s in snaps) for kind in snaps[0]["adapter_rows"]}
        return {**snaps[0], **summed, "pages": pages, "adapter_rows": rows, "prefix_cache": summed_prefix_cache(snaps),
                "waiting": summed["waiting"] + len(self._queue)}

    # ---- requests ---------------------------------------------------------------------------
    def submit(self, request_id, prompt: list[int], adapter: str | None, sampling: SamplingParams,
               callback: Callable[[Event], None], head: TaskHead | None = None) -> None:
        """Places a request (see the module doc); raises as `Engine.submit` does."""
        self.validate(len(prompt), sampling.max_new_tokens)
        if adapter is not None:
            self.resolve_adapter(adapter)  # UnknownAdapter, AdapterError
        with self._lock:
            if len(self._queue) >= self.config.max_waiting:
                raise EngineBusy(f"{len(self._queue)} requests wait for a replica; try again later")
            placed = _Placed(request_id, list(prompt), adapter, sampling, callback, next(self._arrivals), head=head)
            self._requests[request_id] = placed
            bisect.insort(self._queue, placed, key=self._queue_key)
            self._pump()

    def abort(self, request_id) -> None:
        """Ends a request wherever it is; its replica frees its pages at its next step boundary."""
        with self._lock:
            placed = self._requests.get(request_id)
            if placed is None:
                return
            placed.aborted = True
            if placed.replica is not None:
                self.engines[placed.replica].abort(request_id)
                return
            self._queue.remove(placed)
            del self._requests[request_id]
        placed.callback(Event(None, "abort"))

    def _pump(self) -> None:
        """Places queued requests in the queue's order while its head finds a replica with room."""
        with self._lock:
            while self._queue:
                placed = self._queue[0]
                replica = self.policy(self.states(), len(placed.prompt) + len(placed.output), placed.max_len,
                                      placed.adapter, placed.exclude)
                if replica is None and placed.exclude:  # no other replica: wait for any
                    placed.exclude = ()
                    continue
                if replica is None:
                    return
                self._queue.pop(0)
                self._submit_to(replica, placed)

    def _submit_to(self, replica: int, placed: _Placed) -> None:
        placed.replica, placed.exclude = replica, ()
        try:
            self.engines[replica].submit(placed.request_id, placed.prompt, placed.adapter, placed.sampling,
                                         lambda event: self._on_event(placed, event), output=placed.output,
                                         head=placed.head)
        except Exception as err:  # e.g. the adapter was removed meanwhile
            del self._requests[placed.request_id]
            placed.callback(Event(None, "error", f"placing the request on replica {replica} failed: {err}"))

    def _on_event(self, placed: _Placed, event: Event) -> None:
        """An engine's event for `placed`: recorded in the ledger, then given to the client."""
        with self._lock:
            if event.token is not None:
                placed.output.append(event.token)
            if event.finish_reason is not None:
                self._requests.pop(placed.request_id, None)
        try:
            placed.callback(event)
        finally:
            if event.finish_reason is not None:
                self._pump()

    def _migrated(self, source: int, handoff: Handoff) -> None:
        """Engine `source` handed a request off (engine thread): placed elsewhere, or queued in the policy's order."""
        with self._lock:
            placed = self._requests.get(handoff.request_id)
            if placed is None:
                return
            if placed.aborted:
                del self._requests[placed.request_id]
            else:
                self.migrations += 1
                placed.output, placed.replica, placed.exclude = list(handoff.output), None, (source,)
                bisect.insort(self._queue, placed, key=self._queue_key)
                self._pump()
                return
        placed.callback(Event(None, "abort"))

    # ---- load and drain -------------------------------------------------------------------------
    def states(self) -> list[ReplicaState]:
        """The placement states of the replicas, from the set's ledger (see the module doc)."""
        with self._lock:
            placed = [p for p in self._requests.values() if p.replica is not None]
            states = []
            for index, engine in enumerate(self.engines):
                config = engine.config
                mine = [p for p in placed if p.replica == index]
                used = sum(p.pages(config.page_size, config.reserve_output_kv) for p in mine)
                adapters = frozenset(name for name in engine.slot_adapters() if name is not None)
                states.append(ReplicaState(index, len(mine), config.max_num_seqs, config.num_pages - used,
                                           config.page_size, config.reserve_output_kv, adapters,
                                           draining=index in self._draining,
                                           healthy=engine.alive or not self._started))
            return states

    def drain(self, replica: int, migrate: bool = False, undo: bool = False) -> dict:
        """Stops placing on `replica` (undo: resumes); with `migrate`, hands its requests to the
        others now. Returns its `load` entry. ValueError for a replica id out of range."""
        if not 0 <= replica < len(self.engines):
            raise ValueError(f"replica must be in [0, {len(self.engines)}), got {replica}")
        with self._lock:
            if undo:
                self._draining.discard(replica)
            else:
                self._draining.add(replica)
            if migrate and not undo:
                for placed in [p for p in self._requests.values() if p.replica == replica]:
                    self.engines[replica].migrate(placed.request_id)
            self._pump()
        return self.load()[replica]

    def load(self) -> list[dict]:
        """Per replica: `engine_load`, with the set's view (batch placed there, draining, idle)."""
        states = self.states()
        return [engine_load(engine, index, state.batch, state.draining) for index, (engine, state)
                in enumerate(zip(self.engines, states))]


def engine_load(engine: Engine, replica: int = 0, batch: int | None = None, draining: bool = False) -> dict:
    """One replica's load (JSON): running and waiting sequences, its batch (requests placed there;
    default running + waiting), the most rows a step runs, KV pages (free: net of what its queued
    requests take), page size and admission mode, adapters on its device, device, draining, idle."""
    snap = engine.snapshot()
    queued = snap["running"] + snap["waiting"]
    batch = queued if batch is None else batch
    return {"replica": replica, "device": engine_device(engine), "running": snap["running"],
            "waiting": snap["waiting"], "batch": batch, "max_batch": snap["max_num_seqs"],
            "free_pages": max(0, snap["free_pages"] - snap["waiting_pages"]), "total_pages": snap["total_pages"],
            "page_size": snap["page_size"], "reserve_output_kv": snap["reserve_output_kv"],
            "adapters_on_device": sorted(n for n in engine.slot_adapters() if n is not None),
            "tokens_per_second": snap["tokens_per_second"], "draining": draining,
            "idle": draining and batch == 0 and queued == 0}


def engine_device(engine: Engine) -> str:
    """The device(s) an engine runs on, in words."""
    if engine.mesh is not None:
        return ",".join(str(d) for d in engine.mesh.devices.flat)
    import jax

    return str(jax.devices()[0])


def server_state(engine: Engine | ReplicaSet) -> dict:
    """The JSON of `GET /state`: {"replicas": [load per replica], "queued": requests waiting for a
    replica, "migrations": so far}."""
    if isinstance(engine, ReplicaSet):
        with engine._lock:
            queued = len(engine._queue)
        return {"replicas": engine.load(), "queued": queued, "migrations": engine.migrations}
    return {"replicas": [engine_load(engine)], "queued": 0, "migrations": 0}


def summed_prefix_cache(snaps: list[dict]) -> dict:
    """The engines' `prefix_cache` counts summed (each replica caches its own pages), hit rate over the sum."""
    caches = [s["prefix_cache"] for s in snaps]
    summed = {key: sum(c[key] for c in caches) for key in caches[0] if key not in ("enabled", "hit_rate")}
    return {**summed, "enabled": caches[0]["enabled"],
            "hit_rate": summed["hits"] / summed["queries"] if summed["queries"] else 0.0}


class _SummedStats:
    """The engines' `EngineStats` read as one: counters and seconds summed, maxima (`*_max_s`) the
    largest."""

    def __init__(self, engines: list[Engine]):
        self._engines = engines

    def __getattr__(self, name: str):
        values = [getattr(engine.stats, name) for engine in self._engines]
        return max(values) if name.endswith("_max_s") else _summed(values)


def _summed(values: list):
    """Numbers summed; dicts (`kind_steps`, `phase_seconds`) summed by key, lists in them by position."""
    if values and isinstance(values[0], dict):
        keys = dict.fromkeys(key for value in values for key in value)
        return {key: _summed([value[key] for value in values if key in value]) for key in keys}
    if values and isinstance(values[0], (list, tuple)):
        return [sum(column) for column in zip(*values)]
    return sum(values)
