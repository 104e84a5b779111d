"""The serving policy: iteration-level continuous batching under a token budget (Orca, S-LoRA).

Every step the scheduler picks, from the requests it knows, which tokens run next:
  1. one decode token for every running request that has finished its prompt;
  2. the next prompt chunk (at most `prefill_chunk` tokens) of running requests still in prefill;
  3. new requests from the queue, in its order, while the step has token budget, rows, KV pages
     and an adapter slot for them.
Requests join and leave at every step. Rows of a step are returned grouped by adapter slot
(base-model rows last), the order the LoRA batch plan wants.

Admission control: by default (`reserve_output`) a request is admitted only when the page pool can
hold its whole sequence (prompt + max_tokens), so a running request never waits for memory and
nothing is preempted; its pages come back when it finishes or is aborted. Without
`reserve_output` (Punica, vLLM) a request is admitted with the pages of its tokens so far plus the
next one, and a decode row takes a new page when it crosses into one; when the pool has none, the
newest running request is preempted (Punica: newest first, which keeps FCFS): its pages are
freed, its unread (PENDING) tokens dropped, and it goes back to the waiting queue in its order
with its prompt and the tokens it generated, to be recomputed by a prefill over both when it is
admitted again (or handed to another replica by the caller: `StepPlan.preempted`).

Queue order (`SchedulerConfig.schedule_policy`): "fcfs" (default) admits in arrival order; "lof"
(SGLang's longest-output-first) admits the waiting request with the most output tokens still to
come (max_tokens minus what it generated; ties in arrival order) first. When slots or rows are the
bottleneck (more distinct adapters than device slots) lof starts the long requests first, so the
ones that start late are short and the batch's tail does not run nearly alone; it minimizes a
batch's makespan, not its mean latency, and under sustained load a short request may wait behind
every longer one that arrives after it.

Adapter slots: a running request pins its adapter's slot; admitting a request whose adapter is not on the device takes a free slot or
evicts the least recently used unpinned adapter (the caller copies the weights before the step).
If the head of the queue cannot get a slot (all pinned), later requests whose adapters are
already on the device may go first (adapter-aware skipping); if it lacks pages, admission stops,
so long requests are not starved. A request whose adapter is neither on the device nor ready to
copy there (`is_ready(key)`: the caller's host tier holds it; default always) is passed over until
it is, as is its adapter by `prefetch`: a request whose adapter is still read from disk waits
without holding the queue.

Async scheduling (vLLM/SGLang): `schedule()` commits its plan at once, as if the step had run:
each row's tokens count as computed, and a row that samples appends a `PENDING` placeholder to
its sequence's output, so the next step can be planned (a decode row whose input is that
placeholder) while this one still runs on the device. `complete()` fills the placeholders with
the sampled tokens, one step late. A sequence whose output (placeholders included) has reached
max_tokens gets no more rows; one that turns out to have sampled EOS is finished then (its
placeholders past the EOS dropped), and a row of it already planned is skipped at completion.

Unified paging (S-LoRA §5.1, `SchedulerConfig.unified_paging`): KV pages and the pages of resident
adapters come from one budget (`jaxlora.scheduler.serving.unified.UnifiedPages`; an adapter's page
count from `adapter_pages(key)`, the caller's, at its own rank). A request is admitted when its KV
pages plus its adapter's (if not resident) fit in the free pages and those of idle adapters (its
own kept); KV allocation evicts idle adapters first (their slots are dropped too), a slot's LRU
victim frees its pages, and an adapter in use (its slot pinned) is never evicted. With
`adapter_rows` the adapter also takes `adapter_rows(key)` (its rank) rows of the device row pool
(`jaxlora.lora.rows`): a slot is then only a row-table entry, the rows hold the weights.

Prompt chunks per step (`max_prefill_adapters`, 0: no bound): a step holds the prompt chunks
(rows of more than one token) of at most that many distinct adapters, base-model chunks aside; a
running request in prefill whose adapter would be one more waits for the next step, and admission
passes over such a request (later ones of the step's adapters, or of the base model, may go
first). The engine sets it to its LoRA backend's segment window (a mixed step's segment GEMM covers
that many adapters; `jaxlora.lora.ops.SEGMENT_WINDOW`).

Inference modes: `runs(key)` (the caller's; default always) says whether requests of an adapter
get rows this step: in merged mode only the merged adapter's do; the others keep their pages and
wait, running or queued.

Early abort (S-LoRA): with a time-to-first-token objective, `expire(now, ttft_slo_s, next_step_s)`
drops every waiting request that can no longer meet it (waited so far + at least one more step >
the objective) instead of serving it late at the cost of the requests behind it; running
requests, and preempted ones that already have output tokens, are never dropped.

Prefix caching (`SchedulerConfig.prefix_caching`, `jaxlora.scheduler.serving.prefix`): pages go
through a `PrefixCache`. When a request is admitted, the leading full blocks of its tokens that are
cached under its root (`prefix_root(adapter)`, the caller's: the adapter's identity and the step's
numerics) are taken from the cache and count as computed, so its prefill starts after them (at
least one token is always computed; a `Sequence` with `cache_prefix` False, e.g. one that needs
every prompt position's logits, takes none). Every full block a step commits is registered under
the chain of its sequence's root, as are the output blocks when a sequence finishes; a sequence
whose root changes while it runs (another inference mode) registers nothing more. Cached pages no
sequence holds count as free and are evicted, least recently used first, when pages are needed.

Pure host-side Python: no JAX here; `serve.engine` turns a `StepPlan` into device arrays.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import itertools
from typing import Any, Callable, Hashable

from jaxlora.scheduler.core import DECODE, PREFILL, TokenCapacity, WorkItem
from jaxlora.scheduler.serving.adapters import AdapterSlots
from jaxlora.scheduler.serving.pages import PageAllocator, admission_pages, pages_for
from jaxlora.scheduler.serving.prefix import PrefixCache, chain_digests, root_digest
from jaxlora.scheduler.serving.unified import UnifiedPages


PENDING = -1  # an output token sampled by a step whose result is not read yet


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class Sequence:
    """One generation: prompt ids, generated ids, its pages, and how many tokens are in the cache."""

    seq_id: Hashable
    prompt: list[int]
    max_tokens: int
    adapter: Hashable | None = None  # adapter key, None for the base model
    eos_ids: frozenset[int] = frozenset()
    output: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    order: int = 0
    arrival: float = 0.0  # when the request arrived (seconds, the caller's clock; see `expire`)
    sampling: Any = None  # the caller's sampling parameters (opaque here; the engine's SamplingParams)
    cache_prefix: bool = True  # prefix caching: may start after cached blocks (False: computes every position)
    prefix_root: bytes | None = None  # its chain's root digest (None: registers no blocks)
    prefix_salt: bytes = b""  # mixed into its root (e.g. a digest of its images): shares blocks only with the same salt
    prefix_digests: list = dataclasses.field(default_factory=list)  # digests of its first full blocks
    prefix_blocks: int = 0  # its leading blocks that are cached (hit or registered)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """len(tokens), without building the list (the scheduler asks every step for every row)."""
        return len(self.prompt) + len(self.output)

    @property
    def num_pending(self) -> int:
        """Tokens whose keys/values are not in the cache yet (1 while decoding)."""
        return self.num_tokens - self.num_computed

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt)

    @property
    def all_planned(self) -> bool:
        """Whether every output token up to max_tokens is generated or on its way (PENDING)."""
        return len(self.output) >= self.max_tokens

    def fill(self, index: int, token: int) -> str | None:
        """Puts the sampled `token` in place of the placeholder output[index]; returns "stop" (EOS:
        the placeholders after it are dropped) or "length" (max_tokens reached) if the sequence is
        now done."""
        self.output[index] = token
        if token in self.eos_ids:
            del self.output[index + 1:]
            return "stop"
        if index + 1 >= self.max_tokens:
            return "length"
        return None


def _fcfs(arrival: int, tokens_left: int) -> int:
    return arrival


def _lof(arrival: int, tokens_left: int) -> tuple[int, int]:
    return -tokens_left, arrival


# The waiting queue's orders (`SchedulerConfig.schedule_policy`; module doc): a sort key from a request's
# arrival order and the output tokens it has still to come (max_tokens minus those generated), so that
# every queue of requests (this scheduler's, a replica set's) orders by the same policy.
SCHEDULE_POLICIES: dict[str, Callable[[int, int], Any]] = {"fcfs": _fcfs, "lof": _lof}


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """max_num_seqs: rows per step; token_budget: tokens per step; prefill_chunk: most prompt
    tokens of one request per step."""

    num_pages: int
    page_size: int
    num_adapter_slots: int
    max_num_seqs: int = 32
    token_budget: int = 128
    prefill_chunk: int = 64
    unified_paging: bool = False  # KV and adapter pages in one budget (module doc)
    adapter_rows: int = 0  # unified paging: device rows adapters take at their rank (0: none; module doc)
    reserve_output: bool = True  # admission reserves prompt + max_tokens pages (else: pages grow; module doc)
    max_prefill_adapters: int = 0  # distinct adapters with prompt chunks in one step (0: no bound; module doc)
    prefix_caching: bool = False  # reuse cached full KV blocks across requests (module doc)
    prefetch_steps: int = 0  # `prefetch` looks this many steps' token budgets down the queue (0: the whole queue)
    schedule_policy: str = "fcfs"  # the waiting queue's order: one of SCHEDULE_POLICIES (module doc)

    def __post_init__(self):
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {sorted(SCHEDULE_POLICIES)}, "
                             f"got {self.schedule_policy!r}")
        if min(self.max_num_seqs, self.token_budget, self.prefill_chunk) < 1:
            raise ValueError("max_num_seqs, token_budget and prefill_chunk must be >= 1")
        if self.prefetch_steps < 0:
            raise ValueError("prefetch_steps must be >= 0 (0: the whole queue)")
        if self.max_prefill_adapters < 0:
            raise ValueError("max_prefill_adapters must be >= 0 (0: no bound)")


@dataclasses.dataclass
class StepRow:
    """A row of a step: `count` tokens of `seq` from cache position `start`; `sample` when the
    row's last token is the sequence's newest (its logits give the next token)."""

    seq: Sequence
    start: int
    count: int
    slot: int  # adapter pool slot, -1 for the base model
    sample: bool


@dataclasses.dataclass
class StepPlan:
    """The rows of one step (grouped by slot, base last), the adapters to copy in before it, and
    the running sequences preempted for want of KV pages (back in the waiting queue; see the
    module doc)."""

    rows: list[StepRow]
    loads: list[tuple[int, Hashable]]
    preempted: list[Sequence] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(row.count for row in self.rows)

    def work_items(self) -> list[WorkItem]:
        """The step's rows as the scheduler core's work items: a decode row computes the newest
        token of a sequence past its prompt, a prefill row a chunk of its prompt (or a recompute)."""
        return [WorkItem(DECODE if row.count == 1 and row.start >= len(row.seq.prompt) else PREFILL,
                         row.seq.adapter, row.count) for row in self.rows]


class ServingScheduler:
    """Waiting queue, running set, pages and adapter slots; `schedule()` plans the next step."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.capacity = TokenCapacity(config.token_budget)  # every step's work items fit it
        self.slots = AdapterSlots(config.num_adapter_slots)
        pool = (UnifiedPages(config.num_pages, config.page_size, in_use=self.slots.pinned, num_rows=config.adapter_rows)
                if config.unified_paging else PageAllocator(config.num_pages, config.page_size))
        self.prefix = PrefixCache(pool, config.page_size) if config.prefix_caching else None
        self.pages = self.prefix or pool
        # prefix caching: what besides the tokens names an adapter's (None: the base model's) cached
        # blocks, the caller's (its identity, the step's numerics)
        self.prefix_root: Callable[[Hashable | None], Hashable] = lambda key: key
        self.adapter_pages: Callable[[Hashable], int] = lambda key: 1  # unified paging: an adapter's pages
        self.adapter_rows: Callable[[Hashable], int] = lambda key: 1  # with adapter_rows: its rank in rows
        self.refused: list[Sequence] = []  # finished "too_large" by admission; the caller tells them
        self.waiting: list[Sequence] = []  # sorted by `_queue_key`
        self.running: list[Sequence] = []
        self._order = itertools.count()
        policy = SCHEDULE_POLICIES[config.schedule_policy]
        self._queue_key: Callable[[Sequence], Any] = lambda seq: policy(seq.order, seq.max_tokens - len(seq.output))
        self.is_ready: Callable[[Hashable], bool] = lambda key: True  # adapter copyable to the device now
        # whether requests of an adapter (None: the base model) get rows now (merged inference mode:
        # only the merged adapter's; `jaxlora.scheduler.serving.mode_choice.runs_in`)
        self.runs: Callable[[Hashable | None], bool] = lambda key: True

    # ---- requests in and out -------------------------------------------------------------
    def pages_needed(self, seq: Sequence) -> int:
        """KV pages `seq` takes when admitted (`admission_pages`)."""
        return admission_pages(seq.num_tokens, len(seq.prompt) + seq.max_tokens, self.config.page_size,
                               self.config.reserve_output)

    def fits_ever(self, prompt_len: int, max_tokens: int) -> bool:
        """Whether such a request could ever be admitted (the whole pool free)."""
        return pages_for(prompt_len + max_tokens, self.config.page_size) <= self.config.num_pages

    def add(self, seq: Sequence) -> None:
        if not seq.prompt or seq.max_tokens < 1:
            raise ValueError("a sequence needs a prompt token and max_tokens >= 1")
        if not self.fits_ever(len(seq.prompt), seq.max_tokens):
            raise ValueError(f"prompt + max_tokens ({len(seq.prompt) + seq.max_tokens}) exceeds the KV cache")
        seq.order = next(self._order)
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=self._queue_key)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a waiting or running sequence: frees its pages and unpins its adapter."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.RUNNING:
            if reason in ("stop", "length"):
                self._register_blocks(seq)  # its output blocks
            self.running.remove(seq)
            self.pages.free(seq.pages)
            seq.pages = []
            if seq.adapter is not None:
                self.slots.unpin(seq.adapter)
        elif seq in self.waiting:  # else: preempted and not queued again (handed away)
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def expire(self, now: float, ttft_slo_s: float, next_step_s: float = 0.0) -> list[Sequence]:
        """Finishes ("overloaded") and returns the waiting sequences whose first token cannot come
        within `ttft_slo_s` of their arrival any more: `now - arrival + next_step_s > ttft_slo_s`
        (`next_step_s`: the soonest a first token can come, e.g. the recent step time)."""
        late = [seq for seq in self.waiting if not seq.output and now - seq.arrival + next_step_s > ttft_slo_s]
        for seq in late:
            self.finish(seq, "overloaded")
        return late

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- planning ------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Plans one step: decode rows, prefill chunks, then admissions (see the module doc), and
        commits it: the rows' tokens count as computed, sampling rows append a PENDING output."""
        budget = self.config.token_budget
        rows: list[StepRow] = []
        preempted: list[Sequence] = []
        chunked: set = set()  # adapters with a prompt chunk in this step (`max_prefill_adapters`)
        for seq in sorted(self.running, key=lambda s: (s.in_prefill, s.order)):
            if budget == 0:
                break
            if seq.all_planned or seq.status is not Status.RUNNING or not self.runs(seq.adapter):
                continue  # its last token is on its way, it was preempted just now, or its mode does not run it
            row = self._row(seq, budget)
            if not self._chunk_fits(chunked, row):
                continue  # its adapter would be one more with a prompt chunk in this step
            if not self._grow(seq, row.start + row.count, preempted):
                continue
            rows.append(row)
            budget -= row.count
            self._count_chunk(chunked, row)
        budget += sum(row.count for row in rows if row.seq.status is not Status.RUNNING)
        rows = [row for row in rows if row.seq.status is Status.RUNNING]  # a victim has no row yet; kept safe
        loads = self._admit(rows, budget, chunked)
        for seq in preempted:  # not re-admitted this step; the queue stays sorted (no re-sort a step)
            bisect.insort(self.waiting, seq, key=self._queue_key)
        for row in rows:
            if row.seq.adapter is not None:
                self.slots.touch(row.seq.adapter)
            row.seq.num_computed += row.count
            if row.sample:
                row.seq.output.append(PENDING)
            self._register_blocks(row.seq)
        rows.sort(key=lambda r: (r.slot < 0, r.slot))
        plan = StepPlan(rows, loads, preempted)
        if plan.num_tokens > self.capacity.tokens:  # the work items only to name the overflow
            self.capacity.check(plan.work_items())
        return plan

    def _grow(self, seq: Sequence, positions: int, preempted: list[Sequence]) -> bool:
        """Gives `seq` the pages of its first `positions` cache positions, preempting the newest
        running sequences while the pool is short (`preempt`; added to `preempted`); False if
        `seq` itself was preempted. Nothing to do when admission reserved the whole sequence."""
        missing = pages_for(positions, self.config.page_size) - len(seq.pages)
        while missing > 0 and not self.pages.can_allocate(missing):
            victim = max(self.running, key=lambda s: s.order)
            self.preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        if missing > 0:
            seq.pages += self.pages.allocate(missing)
            self._drop_evicted()
        return True

    def preempt(self, seq: Sequence) -> None:
        """Takes a running sequence off the device: frees its pages, unpins its adapter, drops its
        unread (PENDING) tokens and marks it WAITING with nothing computed, so that a prefill over
        prompt + output recomputes it. `schedule` queues its victims again; a caller that preempts
        (e.g. to migrate the sequence to another replica) ends it here with `finish`."""
        self._register_blocks(seq)
        self.running.remove(seq)
        self.pages.free(seq.pages)
        seq.pages = []
        if seq.adapter is not None:
            self.slots.unpin(seq.adapter)
        while seq.output and seq.output[-1] == PENDING:
            seq.output.pop()
        seq.num_computed = 0
        seq.status = Status.WAITING

    def _row(self, seq: Sequence, budget: int) -> StepRow:
        count = min(seq.num_pending, budget, self.config.prefill_chunk)
        slot = -1 if seq.adapter is None else self.slots.slot_of(seq.adapter)
        return StepRow(seq, seq.num_computed, count, slot, seq.num_computed + count == seq.num_tokens)

    def _chunk_fits(self, chunked: set, row: StepRow) -> bool:
        """Whether `row` keeps the step within `max_prefill_adapters` adapters with prompt chunks
        (`chunked`: those the step has so far)."""
        bound, key = self.config.max_prefill_adapters, row.seq.adapter
        return not bound or row.count < 2 or key is None or key in chunked or len(chunked) < bound

    @staticmethod
    def _count_chunk(chunked: set, row: StepRow) -> None:
        if row.count > 1 and row.seq.adapter is not None:
            chunked.add(row.seq.adapter)

    def _admit(self, rows: list[StepRow], budget: int, chunked: set) -> list[tuple[int, Hashable]]:
        loads = []
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if seq.adapter is not None and self.slots.slot_of(seq.adapter) is None and not self.is_ready(seq.adapter):
                continue  # its adapter is still on its way to the host
            if not self.runs(seq.adapter):
                continue
            if not self._chunk_fits(chunked, self._row(seq, budget)):
                continue  # its adapter would be one more with a prompt chunk in this step
            hits = self._hits(seq)
            if not self._fits(seq, hits):
                if self._unified_pages_needed(seq) > self.config.num_pages:  # its adapter's pages: never
                    self.finish(seq, "too_large")
                    self.refused.append(seq)
                    continue
                break
            if self.prefix is not None:
                self.prefix.acquire(hits)  # held: placing its adapter evicts no hit
            if seq.adapter is not None:
                placed = self._place(seq.adapter)
                if placed is None:
                    self.pages.free(hits)
                    continue  # every slot pinned: let requests for resident adapters pass
                if placed[1]:
                    loads.append((placed[0], seq.adapter))
                self.slots.pin(seq.adapter)
            self.waiting.remove(seq)
            seq.pages = self._take_pages(seq, hits)
            self._drop_evicted()
            seq.status = Status.RUNNING
            self.running.append(seq)
            row = self._row(seq, budget)
            rows.append(row)
            budget -= row.count
            self._count_chunk(chunked, row)
        return loads

    def prefetch(self) -> list[tuple[int, Hashable]]:
        """Slots to fill now with adapters of queued requests (queue order), evicting only unpinned
        adapters that no earlier queued request wants. Returns the (slot, key) loads to perform.

        With `prefetch_steps` > 0 only the requests that the next that many steps can start are looked
        at: those whose pending tokens, summed in queue order over the requests that could start now
        (base, or an adapter resident or on the host), begin within that many token budgets. The
        whole queue (0, the default) copies adapters steps before a request can use them, all at once
        when a long queue forms (400 queued requests: ~60 copies and slot writes in the disk trace's
        first steps, 0.1-0.26 s of host time each); a bound of 2 spread them over later steps but did
        not raise the trace's throughput (H200, 2026-11-29: 5,471 against 5,437 tok/s; the host's
        time per load is the cost, not when it is paid; bench/NOTES_serve.md, nineteenth session)."""
        loads, wanted = [], set()
        horizon = self.config.prefetch_steps * self.config.token_budget  # 0: the whole queue, nothing counted
        ahead = 0
        for seq in self.waiting:
            if horizon and ahead >= horizon:
                break
            key = seq.adapter
            if key is not None and key not in wanted:
                wanted.add(key)
                if self.slots.slot_of(key) is None:
                    if not self.is_ready(key):
                        continue  # still being read: passed over, not counted
                    placed = self._place(key, protect=wanted)
                    if placed is None:
                        break
                    loads.append((placed[0], key))
            if horizon:
                ahead += seq.num_pending
        return loads

    # ---- adapter residency (slots, and pages with unified paging) ------------------------------------
    @property
    def unified(self) -> bool:
        return self.config.unified_paging

    def _fits(self, seq: Sequence, hits: list[int] = ()) -> bool:
        """Whether `seq`'s KV pages past its cached `hits` (and, with unified paging, its adapter's
        pages if it is not resident) can be had now, evicting only idle adapters other than its own
        and cached pages other than its hits."""
        free = self.pages.num_free if self.prefix is None else self.prefix.num_free_besides(hits)
        needed = self._unified_pages_needed(seq) - len(hits)
        return needed <= free or (self.unified and needed <= free + self.pages.idle_pages(keep=(seq.adapter,)))

    # ---- prefix caching (module doc) ----------------------------------------------------------
    def _hits(self, seq: Sequence) -> list[int]:
        """The cached pages `seq` can start after (its leading full blocks but the last token's):
        none without prefix caching or with `cache_prefix` False. Sets its chain's root."""
        if self.prefix is None:
            return []
        root = self._root(seq)
        if seq.prefix_root != root:
            seq.prefix_root, seq.prefix_digests = root, []
        if not seq.cache_prefix:
            return []
        tokens = seq.tokens
        count = (len(tokens) - 1) // self.config.page_size
        return self.prefix.lookup(chain_digests(tokens, self.config.page_size, root, seq.prefix_digests, count)[:count])

    def _root(self, seq: Sequence) -> bytes:
        """The root digest of `seq`'s chain: its adapter's `prefix_root`, salted with `seq.prefix_salt`."""
        key = self.prefix_root(seq.adapter)
        return root_digest((key, seq.prefix_salt) if seq.prefix_salt else key)

    def _take_pages(self, seq: Sequence, hits: list[int]) -> list[int]:
        """An admitted `seq`'s pages: its cached `hits` (acquired; counted as computed) and new ones
        for the rest."""
        if self.prefix is not None and seq.cache_prefix:
            self.prefix.stats.record(seq.num_tokens, len(hits) * self.config.page_size)
        seq.prefix_blocks = len(hits)
        seq.num_computed = len(hits) * self.config.page_size
        return hits + self.pages.allocate(self.pages_needed(seq) - len(hits))

    def _register_blocks(self, seq: Sequence) -> None:
        """Caches `seq`'s full blocks whose keys and values are computed (or committed to a step)
        and whose tokens are known (no PENDING), under its root; none once the root changed."""
        if self.prefix is None or seq.prefix_root is None:
            return
        size, output = self.config.page_size, seq.output
        pending = 0
        while pending < len(output) and output[-1 - pending] == PENDING:
            pending += 1
        full = min(seq.num_computed, len(seq.prompt) + len(output) - pending) // size
        if full <= seq.prefix_blocks:
            return
        if self._root(seq) != seq.prefix_root:
            seq.prefix_root = None  # computed under other numerics from here on
            return
        digests = chain_digests(seq.tokens, size, seq.prefix_root, seq.prefix_digests, full)
        for i in range(seq.prefix_blocks, full):
            self.prefix.register(seq.pages[i], digests[i], seq.adapter)
        seq.prefix_blocks = full

    def clear_prefix_cache(self) -> None:
        """Forgets every cached block (e.g. the KV pages were rebuilt after a failed step)."""
        if self.prefix is not None:
            self.prefix.forget()

    def _unified_pages_needed(self, seq: Sequence) -> int:
        """`seq`'s KV pages plus, with unified paging, its adapter's if that is not resident."""
        needed, key = self.pages_needed(seq), seq.adapter
        if self.unified and key is not None and key not in self.slots.fixed and not self.pages.holds(key):
            needed += self.adapter_pages(key)
        return needed

    def _place(self, key, protect=()) -> tuple[int, bool] | None:
        """`slots.place(key, protect)` and, with unified paging, the adapter's pages (the slot's
        LRU victim's pages freed); None (no slot or no pages) changes nothing but that victim."""
        before = set(self.slots.keys)
        placed = self.slots.place(key, protect)
        if placed is None or not self.unified or key in self.slots.fixed:
            return placed
        for gone in before - set(self.slots.keys):
            self.pages.remove_adapter(gone)
        resident = self.pages.holds(key)  # resident: its pages, touched
        count = 0 if resident else self.adapter_pages(key)
        rows = 0 if resident or not self.config.adapter_rows else self.adapter_rows(key)
        if self.pages.add_adapter(key, count, rows) is None:
            self.slots.drop(key)
            return None
        self._drop_evicted()
        return placed

    def _drop_evicted(self) -> None:
        """Drops the slots of adapters whose pages unified paging evicted (they were idle)."""
        if self.unified:
            for key in self.pages.evicted:
                self.slots.drop(key)
            self.pages.evicted.clear()

    def drop_adapter(self, key) -> int | None:
        """Forgets an unpinned adapter: its slot (returned, None if it had none) and its pages."""
        slot = self.slots.drop(key)
        if self.unified:
            self.pages.remove_adapter(key)
        if self.prefix is not None:
            self.prefix.forget(key)  # its blocks: it is gone for good
        return slot

    def page_split(self) -> dict:
        """{"kv": pages held by sequences, "adapters": pages held by resident adapters (unified
        paging; else 0), "free": free pages}."""
        free = self.pages.num_free
        adapters = self.pages.adapter_pages_used if self.unified else 0
        return {"kv": self.config.num_pages - free - adapters, "adapters": adapters, "free": free}

    def complete(self, plan: StepPlan, sampled: dict) -> list[tuple[Sequence, int, str | None]]:
        """Applies a finished step: puts the sampled tokens (`sampled[seq_id]`) in place of its
        rows' placeholders and finishes sequences that hit EOS or max_tokens. Rows of sequences
        finished meanwhile (aborted, or EOS in the step before) are skipped.

        Returns (seq, new token, finish reason or None) for every sampling row still relevant."""
        events = []
        for row in plan.rows:
            seq = row.seq
            if seq.status is not Status.RUNNING or not row.sample:
                continue
            token = sampled[seq.seq_id]
            reason = seq.fill(row.start + row.count - len(seq.prompt), token)
            if reason is not None:
                self.finish(seq, reason)
            events.append((seq, token, reason))
        return events
