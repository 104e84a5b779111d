"""The serving engine's counters: steps, host time per step phase, generated tokens per second,
adapter loads, training steps in idle serving steps, and the prefix cache's hit rate (read by
`serve.metrics` and the benchmarks)."""

from __future__ import annotations

import collections
import heapq
import time


class _PhaseClock:
    """One engine iteration's host time per phase: adds the time since the previous mark to
    `seconds[name]` at each `mark(name)` (`EngineStats.end_iteration` files them, in total and by
    step kind)."""

    __slots__ = ("seconds", "last")

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.last = now


class EngineStats:
    """Step counters, host time per step phase and a sliding window of generated tokens for tokens/s.

    phase_seconds: cumulative seconds of each phase of `Engine.step` (PHASES, in step order):
    schedule (commands, drops, the scheduler), load (admissions' adapter copies not prefetched),
    commit (prefetched copies written into their slots, waiting for those the step needs), order
    (serving_order), batch (token/position/block-table arrays), lora_plan, sampling (arrays),
    dispatch (the jitted call: argument transfer and launch), prefetch (queued adapters' copies),
    wait (until the sampled tokens are on the host), complete (tokens to requests, callbacks)."""

    PHASES = ("schedule", "load", "commit", "order", "batch", "lora_plan", "sampling", "dispatch", "prefetch",
              "wait", "complete")

    def __init__(self, window_s: float = 10.0, prefix=None):
        self.window_s = window_s
        self.prefix = prefix  # the scheduler's `PrefixCache` (None: prefix caching off)
        self.steps = 0
        self.step_tokens = 0
        self.generated = 0
        self.adapter_loads = 0  # host -> device copies into pool slots
        self.adapter_load_seconds = 0.0  # their total and longest seconds
        self.adapter_load_max_s = 0.0
        self.base_only_steps = 0
        self.window_fills = 0  # adapters copied into the adapter window
        self.step_compiles = 0  # programs that steps compiled (not warmed up)
        self.step_seconds = 0.0
        self.last_step_s = 0.0
        self.dropped = 0  # requests ended by early abort (see EngineConfig.ttft_slo_s)
        self.train_steps = 0  # training steps run in idle serving steps (`Engine.train_step`)
        self.train_tokens = 0
        self.train_seconds = 0.0
        self.phase_seconds: dict[str, float] = {}
        self.kind_steps: dict[str, list] = {}  # kind -> [steps, seconds, tokens]
        self.kind_phases: dict[str, dict[str, float]] = {}  # kind -> {phase: host seconds} (`end_iteration`)
        self.slowest: list[tuple] = []  # a heap of the SLOWEST longest steps: (seconds, step index, kind, tokens, clock)
        self._clock: _PhaseClock | None = None  # the iteration running now (`phases`)
        self._recent: collections.deque = collections.deque()

    def phases(self) -> _PhaseClock:
        """A clock for one engine iteration, starting now (`end_iteration` files its phases); a step
        that this iteration finishes keeps it if it is among the slowest (`slowest_steps`)."""
        self._clock = _PhaseClock()
        return self._clock

    def phase_ms_per_step(self) -> dict[str, float]:
        """Mean host milliseconds per step of each phase (PHASES order; over `steps`)."""
        steps = max(1, self.steps)
        return {name: 1e3 * self.phase_seconds[name] / steps for name in self.PHASES if name in self.phase_seconds}

    def steps_by_kind(self) -> dict[str, dict]:
        """{kind: {"steps", "mean_ms" (dispatch to sampled tokens on the host), "mean_tokens"}} per
        kind of step ("base decode", "base mixed", "lora decode", "lora mixed"; decode: one-token
        rows only)."""
        return {kind: {"steps": n, "mean_ms": 1e3 * seconds / n, "mean_tokens": tokens / n}
                for kind, (n, seconds, tokens) in sorted(self.kind_steps.items())}

    def end_iteration(self, clock: _PhaseClock, launched: str | None, finished: str | None) -> None:
        """Files one engine iteration's phases (`clock.seconds`) into `phase_seconds` and by step kind:
        the launch's phases (schedule .. prefetch) under the kind of the step it launched, `wait` and
        `complete` under the kind of the step it finished ("none" where there was no such step)."""
        for name, seconds in clock.seconds.items():
            self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + seconds
            kind = (finished if name in ("wait", "complete") else launched) or "none"
            phases = self.kind_phases.setdefault(kind, {})
            phases[name] = phases.get(name, 0.0) + seconds

    def phase_ms_by_kind(self) -> dict[str, dict[str, float]]:
        """{kind: {phase: mean host ms per step of that kind}} (`end_iteration`; PHASES order): which
        step kind the host's time per step goes to; "none" (iterations that launched and finished
        no step: waiting for adapter reads) in total ms."""
        out = {}
        for kind, phases in sorted(self.kind_phases.items()):
            steps = max(1, self.kind_steps.get(kind, [0])[0])
            out[kind] = {name: 1e3 * phases[name] / steps for name in self.PHASES if name in phases}
        return out

    def slowest_steps(self) -> list[dict]:
        """The longest steps so far, longest first: {"step" (index), "kind", "tokens", "ms", "phases_ms"}.
        phases_ms: the host ms per phase of the iteration that finished the step (under async
        scheduling the launch of the next step, then the wait for this one's tokens: what the
        step's time overlapped on the host); {} for a step finished outside `Engine.step`."""
        return [{"step": index, "kind": kind, "tokens": tokens, "ms": 1e3 * seconds,
                 "phases_ms": {} if clock is None else {name: 1e3 * v for name, v in clock.seconds.items()}}
                for seconds, index, kind, tokens, clock in sorted(self.slowest, key=lambda s: s[:2], reverse=True)]

    SLOWEST = 12

    def record_step(self, kind: str, tokens: int, generated: int, seconds: float) -> None:
        """Counts a finished step of `kind` (`Step.kind`): its tokens, generated tokens and seconds."""
        if len(self.slowest) < self.SLOWEST:
            heapq.heappush(self.slowest, (seconds, self.steps, kind, tokens, self._clock))
        elif seconds > self.slowest[0][0]:
            heapq.heapreplace(self.slowest, (seconds, self.steps, kind, tokens, self._clock))
        self.steps += 1
        kind = self.kind_steps.setdefault(kind, [0, 0.0, 0])
        kind[0], kind[1], kind[2] = kind[0] + 1, kind[1] + seconds, kind[2] + tokens
        self.step_tokens += tokens
        self.generated += generated
        self.step_seconds += seconds
        self.last_step_s = seconds
        now = time.monotonic()
        self._recent.append((now, generated))
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()

    def training_seconds(self, item) -> float:
        """A training step's expected seconds: its tokens at the mean seconds per token so far (0
        before the first)."""
        if item is None or not self.train_tokens:
            return 0.0
        return item.tokens * self.train_seconds / self.train_tokens

    def record_training(self, tokens: int, seconds: float) -> None:
        """Counts one training step (microbatch) of `tokens` that held the engine thread `seconds`."""
        self.train_steps += 1
        self.train_tokens += tokens
        self.train_seconds += seconds

    def record_device_load(self, seconds: float) -> None:
        """Counts one host -> device adapter copy of `seconds`."""
        self.adapter_loads += 1
        self.adapter_load_seconds += seconds
        self.adapter_load_max_s = max(self.adapter_load_max_s, seconds)

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._recent) if t >= now - self.window_s]
        return sum(n for _, n in recent) / self.window_s if recent else 0.0

    # ---- prefix caching (jaxlora.scheduler.serving.prefix; 0 when off) ---------------------------
    @property
    def prefix_cache_queries(self) -> int:
        """Tokens of admitted requests looked up in the prefix cache."""
        return 0 if self.prefix is None else self.prefix.stats.queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of those, tokens whose keys and values came from cached pages (not computed)."""
        return 0 if self.prefix is None else self.prefix.stats.hits

    @property
    def prefix_cache_evictions(self) -> int:
        return 0 if self.prefix is None else self.prefix.stats.evictions

    def prefix_cache(self) -> dict:
        """{"enabled", "queries", "hits", "hit_rate", "requests", "hit_requests", "evictions",
        "cached_blocks" (registered so far), "cached_pages" (held now), "unreferenced_pages"}."""
        cache = self.prefix
        if cache is None:
            return {"enabled": False, "queries": 0, "hits": 0, "hit_rate": 0.0, "requests": 0, "hit_requests": 0,
                    "evictions": 0, "cached_blocks": 0, "cached_pages": 0, "unreferenced_pages": 0}
        stats = cache.stats
        return {"enabled": True, "queries": stats.queries, "hits": stats.hits, "hit_rate": stats.hit_rate,
                "requests": stats.requests, "hit_requests": stats.hit_requests, "evictions": stats.evictions,
                "cached_blocks": stats.cached_blocks, "cached_pages": cache.num_registered,
                "unreferenced_pages": cache.num_cached}


def engine_snapshot(engine) -> dict:
    """An `Engine`'s counts for /metrics and /health (read without locking; values may be one step
    stale): requests running and waiting, adapters per tier, KV pages, throughput, prefix cache,
    and the inference mode's state."""
    scheduler = engine.scheduler
    return {
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting) + engine._num_waiting_submitted,
        "adapters_on_device": len(scheduler.slots.resident()),
        "adapters_known": len(engine.adapters.names()),
        "adapters_on_host": engine.adapters.on_host_count(),
        "adapters_on_disk": engine.adapters.disk_count(),
        "host_adapter_bytes": engine.adapters.cached_bytes(),
        "free_pages": scheduler.pages.num_free,
        "pages": scheduler.page_split(),
        "adapter_rows": {"used": getattr(scheduler.pages, "adapter_rows_used", 0),
                         "total": getattr(engine.pool, "num_rows", 0)},  # unified paging's device rows
        "total_pages": engine.config.num_pages,
        "tokens_per_second": engine.stats.tokens_per_second(),
        "dropped_overloaded": engine.stats.dropped,
        "max_num_seqs": engine.config.max_num_seqs,
        "page_size": engine.config.page_size,
        "reserve_output_kv": engine.config.reserve_output_kv,
        "waiting_pages": sum(scheduler.pages_needed(seq) for seq in list(scheduler.waiting)),
        "prefix_cache": engine.stats.prefix_cache(),
        **({} if engine.modes is None else engine.modes.snapshot()),
    }
