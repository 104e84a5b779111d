"""The serving engine: continuous batching over a paged KV cache with many LoRA adapters.

One `Engine` owns the device state (model weights, the KV page pool, the adapter pool) and the
`ServingScheduler` (the policy, `jaxlora.scheduler.serving`). Each `step()`:
  1. applies queued commands (new requests, aborts, adapter removals) from other threads;
  2. asks the scheduler for the next step (decode rows, prefill chunks, admissions; grouped by
     adapter) and copies in the adapters that admissions need;
  3. builds the step's padded inputs (`build_step` -> `Step`) and runs it (`step_fn`, by default
     `device_step`: the compiled forward over the flat token list, `jaxlora.models.paged`, then
     the sampler when a row samples; `serve.step`), and, while the device runs it, starts
     copying the adapters of queued requests to the device on a background thread (prefetch: the
     host -> device transfers overlap this and the next steps; each copy goes into its pool slot
     before the first step that uses the slot, or at any step boundary once it is done);
  4. reads the sampled tokens of the step launched before (async scheduling) or of this one
     (`EngineConfig.async_scheduling=False`) and hands new tokens and finish reasons to each
     request's callback.

Async scheduling (vLLM/SGLang): step N+1 is planned, built and dispatched while step N runs, and
step N's tokens are read one step late, so the host never waits for the device before
dispatching. The scheduler commits each plan when it makes it (its tokens count as computed;
each sampled token is a `PENDING` placeholder until read); a decode row of step N+1 whose input
is step N's sampled token takes it on the device (`Step.token_src` into step N's token array).
A request never gets a row past max_tokens (known ahead); one that sampled EOS in step N is
finished when step N is read, and the row step N+1 computed for it is dropped, never delivered;
finished and aborted requests' pages are freed then. The slots a launched step reads stay pinned
until its tokens are read, so no adapter load or prefetch overwrites them under it.

Compiled shapes are bucketed (tokens, rows, block-table width; `serve.step_builder`, which also
assembles each step's rows and LoRA plan: `ServingPlan`s in `serving_order` for the BGMV/SGMV
backends, a base-only or adapter-window variant where it can). `step_shapes()` lists every
program variant a step can need and `warmup()` compiles them all (and the adapter pool's slot
update) without touching the engine's state, so that a server compiles nothing once it serves
(`jaxlora-serve` warms up before `/health` reports ready). `Engine(step_fn=...)` replaces the
device step (host-only benchmarks: the engine's host work alone, nothing compiled or dispatched).

Adapters (S-LoRA's tiers: disk, host cache, device pool, or device rows under unified paging) live
in `serve.residency.Residency`, the adapter window over the pool in `serve.window.WindowFill`: each
step the engine tells the residency what the queue needs and which slots the step uses, and ends
the requests whose adapter failed to read (finish reason "adapter_error").

`start()` runs steps in a background thread; `submit`/`abort`/`add_adapter`/`remove_adapter` are
thread-safe.

KV pages per request: by default admission reserves a request's whole sequence (prompt +
max_tokens), so nothing is ever preempted. With `EngineConfig.reserve_output_kv=False` pages grow
with the output and, when the pool runs out, the scheduler preempts the newest running request
(`jaxlora.scheduler.serving.policy`); alone, the engine recomputes it later (a prefill over prompt +
the tokens it generated; its client sees no gap and no repeat). A replica set (`serve.replicas`)
sets `Engine.handoff`: the engine then hands each preempted request away instead (a `Handoff`: its
prompt, the tokens delivered so far, adapter, sampling and callback) for another engine to
`submit(..., output=...)` (Punica's migration by recomputation); `migrate(request_id)` hands one off
on demand (draining a replica).

Prefix caching (`EngineConfig.prefix_caching`, on; `jaxlora.scheduler.serving.prefix`): the scheduler
reuses cached full KV blocks of the same adapter uid (and inference-mode numerics,
`EngineModes.prefix_root`) and token prefix; requests asking for prompt log-probabilities take none,
a failed step empties the cache, and the hit rate is in `stats.prefix_cache()` and `snapshot()`.

Classification (`classify`, V-LoRA's task heads): a one-token greedy sequence in the same steps as
every other request, its prompt's last features through the adapter's task head (`serve.requests`).

A compressed collection (`Engine(..., compressed=SharedBasisSet)`, Compress-then-Serve; a `shared_basis`
backend): bases and cores stay on the device; adapter j's rows take the fixed slot `max_adapters_on_device + j`.

Images (`Engine(llava.language, ..., images=serve.vision.ImageServing(...))`, `submit(images=)`): the
tower runs once per request on a step's new images (batched), each prefill chunk writes their rows at its
image tokens; a step without image tokens runs the text-only programs (`serve.vision`).

Tensor parallel (`Engine(..., mesh=jaxlora.sharding.make_mesh(tensor=N, ...))`): weights, adapter pool and
KV pages placed over the mesh's `tensor` axis, the same jitted step under GSPMD (`serve.placement`).
"""

from __future__ import annotations

import collections
import gc
import dataclasses
import functools
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxlora.lora.adapter import LoraAdapter
from jaxlora.lora.compressed import SharedBasisSet
from jaxlora.lora.head import TaskHead
from jaxlora.buckets import bucket
from jaxlora.lora.pool import PreparedAdapter
from jaxlora.lora.rows import RowPool
from jaxlora.models.llama import Llama, split_layers
from jaxlora.models.paged import PagedKVCache
from jaxlora.sampling import SamplingParams
from jaxlora.scheduler.core import TRAIN, CoSchedulePolicy, ServingLoad
from jaxlora.scheduler.serving import SchedulerConfig, Sequence, ServingScheduler, StepPlan, pages_for

from serve.engine_config import (  # noqa: F401 (re-exported: the engine's public names)
    EngineBusy, EngineConfig, Event, NoTaskHead, RequestError, TrainingSource, UnknownAdapter, kv_page_bytes,
    kv_pages_that_fit,
)
from serve.modes import EngineModes
from serve.placement import (  # noqa: F401 (check_mesh: re-exported)
    Handover, check_mesh, hand_over, new_kv_cache, serving_model,
)
from serve.requests import Handoff, Request, check_request, classified, collect_scores, prompt_k, row_logprobs
from serve.residency import Residency, adapter_pool, place_compressed, slot_rows
from serve.sampler_state import SamplerSlots
from serve.stats import EngineStats, _PhaseClock, engine_snapshot
from serve.step import Programs, Step, StepShape
from serve.step_builder import StepBuilder, scores_prompt, segments
from serve.step_inputs import StepInputs, forward_inputs
from serve.structured import GrammarRows
from serve.warmup import Warmup
from serve.window import WindowFill

if TYPE_CHECKING:
    from serve.vision import ImageInput, ImageServing

log = logging.getLogger("jaxlora.serve")
STALLED_WAIT_S = 0.01  # the longest a stalled engine waits before stepping again (woken sooner by news)


class _InFlight(NamedTuple):
    """A launched step: its inputs, its sampled tokens (a device array until read), when it
    launched, and its log-probabilities (device arrays; None unless its sampler made them)."""

    step: Step
    tokens: object
    launched: float
    logprobs: tuple | None = None
    features: object = None  # the rows' features [R, d] (device array), None from a `step_fn` stub
    scores: tuple | None = None  # a scoring step's (target log-probs [T], top values [T, K], ids [T, K])


class Engine:
    """Continuous-batching multi-adapter generation over one model (see the module doc)."""

    def __init__(self, model: Llama, eos_ids=(), config: EngineConfig = EngineConfig(),
                 adapters: dict[str, LoraAdapter] | None = None, mesh: Mesh | None = None,
                 step_fn: Callable[[Step, PagedKVCache], tuple] | None = None,
                 compressed: SharedBasisSet | None = None, images: "ImageServing | None" = None,
                 handover: Handover = Handover.KEEP):
        """mesh: serve tensor parallel over `mesh`'s `tensor` axis (see the module doc).
        step_fn(step, cache) -> (sampled tokens: row r's at index r, the cache): runs each step in
        place of `device_step` (e.g. a host-only stub for benchmarks); a public attribute.
        `self.config` is `config` with its unset sizes filled (see `EngineConfig`).
        compressed: a compressed collection to serve (see the module doc).
        images: a vision-language model's vision side (`serve.vision.ImageServing`; `model` is its
        language model): requests may carry images (`submit(images=)`). None: text only.
        handover: what the engine may do with `model`'s arrays (`serve.placement.Handover`): KEEP
        them usable, or ZEROS (placeholders: those it replaces freed, its own remade side by side)."""
        devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
        if images is not None and (mesh is not None or compressed is not None):
            raise ValueError("a vision-language model is served by one engine on one device (no tensor parallel, "
                             "no compressed collection)")
        self.images = images
        config = config.for_platform(devices[0].platform)
        self.config = config
        self.model_config = model.config
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.mesh = mesh
        stable = config.stable_step_inputs
        self.step_inputs = StepInputs(mesh is None and jax.default_backend() == "gpu" if stable is None else stable)
        # packed projections (or a copy placed over the mesh); window: its layout (`AdapterWindow`), None: off
        given = model
        model, self.window, window = serving_model(model, config, mesh, compressed)
        if config.split_layers:  # each layer's weights arrays of their own (EngineConfig); a scan needs a stack
            if mesh is not None or images is not None:
                raise ValueError("split_layers serves a text model on one device (no tensor parallel, no images)")
            model = split_layers(nnx.merge(*nnx.split(model)))  # a new module over the same arrays: the caller's stays
        hand_over(given, model, handover)  # before the pool and the KV pages take the free memory
        del given
        self._graphdef, self._state = nnx.split(model)
        self._dtype = model.dtype
        self.modes = EngineModes.for_config(config, self.model_config, self._state["weights"], self.window, mesh,
                                            compressed)  # None: unmerged only
        # donate: the pool's arrays are written in place; only `build_step` reads them, afresh each step
        self.pool = adapter_pool(model, config, mesh, compressed, lambda slot: slot_rows(self.scheduler, slot))
        compressed_arrays = place_compressed(compressed, mesh, config.backend, self.model_config, self._dtype,
                                             self.pool)  # before the KV pages are sized
        if config.num_pages is None:  # sized now: after the weights and the pool are on the devices
            # arrays only a reference cycle still holds (e.g. a caller's model before `pack_projections`:
            # 9 GB of an 8B model's zeros in the warm start) are freed first, or the pages vary by 4k on
            # an H200 with when Python's collector last ran (2026-11-28 20:00-20:31)
            gc.collect()
            config = self.config = dataclasses.replace(config, num_pages=self._pages_that_fit(devices))
        self.cache = self._new_cache()
        self.max_rows = bucket(min(config.max_num_seqs, config.token_budget), 8)  # most rows of a step
        fixed = 0 if compressed is None else min(len(compressed.names), self.max_rows)  # distinct per step
        self._num_segments, chunk_bound = segments(config, fixed)
        self.scheduler = ServingScheduler(SchedulerConfig(
            num_pages=config.num_pages, page_size=config.page_size,
            num_adapter_slots=config.max_adapters_on_device, max_num_seqs=config.max_num_seqs,
            token_budget=config.token_budget, prefill_chunk=config.prefill_chunk,
            unified_paging=config.unified_paging, reserve_output=config.reserve_output_kv,
            adapter_rows=self.pool.num_rows if isinstance(self.pool, RowPool) else 0,
            max_prefill_adapters=chunk_bound, prefix_caching=config.prefix_caching,
            prefetch_steps=config.prefetch_steps, schedule_policy=config.schedule_policy))
        if self.modes is not None:  # merged weights compute other bits: blocks keyed by the step's mode too
            self.scheduler.prefix_root = self.modes.prefix_root
        self.handoff: Callable[[Handoff], None] | None = None  # set by a replica set (module doc)
        self.programs = Programs(self._graphdef, config.backend, self.max_rows, config.scan_layers_from_tokens,
                                 layers_split=config.split_layers)
        self.startup = Warmup(self)  # the start-up compile: `warmup`, `start_warmup` (`serve.warmup`)
        self.sampler_slots = SamplerSlots(config.max_num_seqs, model.config.vocab_size,
                                          None if mesh is None else NamedSharding(mesh, jax.sharding.PartitionSpec()))
        self.grammars = GrammarRows(model.config.vocab_size, self.eos_ids)  # structured outputs' matchers
        self.step_fn = step_fn or self.device_step
        self._last_tokens = np.zeros(self.max_rows, np.int32)  # the previous step's sampled tokens
        self._last_logprobs = None  # the last step's log-probabilities (device arrays), if it made them
        self._last_features = None  # the last step's row features [R, d] (device array; `classify`)
        self._last_scores = None  # the last scoring step's prompt log-probabilities (device arrays)
        self._scoring = 0  # requests whose prompt log-probabilities are not delivered yet (>=: steps check rows)
        self._in_flight: _InFlight | None = None  # launched, tokens not read yet (async scheduling)
        self._last_done = 0.0  # when the last step's tokens were read
        self._lock = threading.Lock()
        self._commands: collections.deque = collections.deque()
        self._requests: dict = {}
        self._num_waiting_submitted = 0
        self._wake = threading.Event()
        self.stalled = False  # the last step ran nothing while requests wait (for their adapters' reads)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.stats = EngineStats(prefix=self.scheduler.prefix)
        # Background copies need a device apart from the host (on a CPU backend the copy is a memcpy
        # on the cores that run the step) and a pool without a mesh (see `Residency.stage`).
        self.residency = Residency(config, self.model_config, self._dtype, self.pool, compressed_arrays,
                                   self.scheduler, self.stats, self._page_bytes(), self.tensor_parallel,
                                   background_prefetch=mesh is None and jax.default_backend() != "cpu")
        self.adapters, self.copies = self.residency.store, self.residency.copies  # the store; prefetched copies
        self.adapters.on_read = self._wake.set  # a stalled engine waits for reads, and steps when one ends
        if images is not None:  # PEFT adapters saved on the LLaVA model: its language model's part
            self.residency.load_adapter = images.read_adapter
        self.scheduler.adapter_pages = self.residency.adapter_pages
        self.scheduler.adapter_rows = self.residency.adapter_rows
        self.scheduler.is_ready = self._adapter_ready  # admit a request once its adapter is on the host
        self.window_fill = None if self.window is None else WindowFill(
            self.window, window, self.pool, self._state, self.stats, config.window_mixed_adapters,
            self.model_config.num_layers if config.split_layers else 0)
        self.builder = StepBuilder(config, self.model_config, self.programs, self.residency.lora_arrays,
                                   self.stats, self.grammars, self.sampler_slots, self.eos_ids, self.window_fill,
                                   self.modes, self.max_rows, self._num_segments)
        self.builder.image_dtype = self._dtype
        # Training in the steps serving leaves idle (`jaxlora.scheduler.core`): set by the server.
        self.training: TrainingSource | None = None
        self.co_policy = CoSchedulePolicy()
        for name, adapter in (adapters or {}).items():
            self.add_adapter(name, adapter)
        for index, name in enumerate(() if compressed is None else compressed.names):
            self.residency.register_compressed(name, index)

    def model_view(self) -> Llama:
        """The served model as a module over the engine's own weight Variables (no copy; packed
        projections and the adapter window's columns included): a program given it reads the
        weights as they are when it runs. Training in the server runs on it (`serve.finetune`)."""
        return nnx.merge(self._graphdef, self._state)

    def weight_variables(self):
        """The served weights' Variables by name, the state the steps read (`serve.warm_start` writes them)."""
        return self._state["weights"]

    @property
    def tensor_parallel(self) -> int:
        return 1 if self.mesh is None else self.mesh.shape["tensor"]

    @property
    def background_prefetch(self) -> bool:
        """Whether prefetched adapters are copied on a background thread (`Residency.stage`)."""
        return self.residency.background_prefetch

    @background_prefetch.setter
    def background_prefetch(self, value: bool) -> None:
        self.residency.background_prefetch = value

    # ---- KV memory ----------------------------------------------------------------------------
    def _pages_that_fit(self, devices) -> int:
        """KV pages for `num_pages=None` (see `EngineConfig`); ValueError if not one context fits."""
        config = self.config
        context_pages = pages_for(config.max_model_len, config.page_size)
        pages = kv_pages_that_fit([d.memory_stats() for d in devices], config.gpu_memory_utilization,
                                  self._page_bytes())
        if pages is None:
            return config.CPU_CONTEXTS * context_pages
        if pages < context_pages:
            raise ValueError(f"{pages} KV pages fit in {config.gpu_memory_utilization:g} of the device memory after "
                             f"the weights and the adapter pool; one context of max_model_len "
                             f"{config.max_model_len} needs {context_pages}: raise gpu_memory_utilization, or "
                             f"lower max_model_len or the adapter pool")
        return pages

    def _page_bytes(self) -> int:
        """Bytes of one KV page on one device (`kv_page_bytes`)."""
        return kv_page_bytes(self.model_config, self.config.page_size, self._dtype, self.tensor_parallel)

    def _new_cache(self) -> PagedKVCache:
        """Zeroed KV pages; with a mesh, made in place split by KV heads (`new_kv_cache`)."""
        return new_kv_cache(self.model_config, self.config.num_pages, self.config.page_size, self._dtype, self.mesh)

    # ---- adapters (any thread; `serve.residency`) -------------------------------------------
    def add_adapter(self, name: str, adapter: LoraAdapter, path: str | None = None,
                    head: TaskHead | None = None) -> None:
        """Registers `adapter` under `name`; AdapterError if the pool cannot hold it, ValueError if
        the name is taken. With `path` (the folder it was read from) it goes into the bounded host
        cache and is read from there again after an eviction; without, it is held in host memory.
        head: its task head (`classify`); None: the one in `path`'s folder, if any."""
        self.residency.add(name, adapter, path, head)

    def task_head(self, name: str) -> TaskHead:
        """The task head of adapter `name` (read from its folder on first use; any thread):
        UnknownAdapter, AdapterError (a malformed head), or NoTaskHead."""
        return self.residency.task_head(name)

    def remove_adapter(self, name: str) -> None:
        """Forgets `name` (UnknownAdapter if absent). Requests already submitted still finish."""
        self.residency.remove(name)
        self._wake.set()

    def adapter_names(self) -> list[str]:
        """Registered adapters (those of `adapter_dir` once requested)."""
        return self.adapters.names()

    def resolve_adapter(self, name: str):
        """The store entry of `name` (a directory adapter is registered now): UnknownAdapter if there
        is none, AdapterError for a name the directory refuses (`AdapterStore.resolve`)."""
        return self.residency.resolve(name)

    def check_adapter(self, adapter: LoraAdapter, finite: bool = True) -> None:
        """AdapterError unless `adapter` fits this engine's pool (modules, rank, shapes; finite
        weights unless `finite` is False, for a caller that checked them)."""
        self.residency.check(adapter, finite)

    def prepare_adapter(self, adapter: LoraAdapter) -> PreparedAdapter:
        """`check_adapter`, then the adapter as the pool loads it (compact host arrays)."""
        return self.residency.prepare(adapter)

    def _adapter_ready(self, uid) -> bool:
        """The scheduler's `is_ready` (`Residency.ready`): whether `uid` is on the host (kept for this step)."""
        return self.residency.ready(uid)

    def _commit_staged(self, needed) -> None:
        """Writes prefetched adapters into their slots (`Residency.commit_staged`; `needed`: the
        slots the step's rows use)."""
        self.residency.commit_staged(needed)

    def _want_adapters(self) -> None:
        """Starts the disk reads of the adapters the queue needs and ends the queued requests whose
        adapter failed to read (`Residency.want`)."""
        for seq, error in self.residency.want():
            self._end(seq, "adapter_error", error)

    # ---- requests (any thread) ---------------------------------------------------------
    def validate(self, prompt_len: int, max_tokens: int) -> None:
        """RequestError unless a prompt of `prompt_len` tokens with `max_tokens` more fits."""
        limit = self.config.max_model_len
        if prompt_len < 1:
            raise RequestError("the prompt is empty")
        if prompt_len >= limit:
            raise RequestError(f"the prompt has {prompt_len} tokens; this server's context is {limit} tokens")
        if max_tokens < 1 or prompt_len + max_tokens > limit:
            raise RequestError(f"max_tokens must be in [1, {limit - prompt_len}] for a {prompt_len}-token prompt "
                               f"(context {limit}), got {max_tokens}")

    def submit(self, request_id, prompt: list[int], adapter: str | None, sampling: SamplingParams,
               callback: Callable[[Event], None], output: list[int] = (), head: TaskHead | None = None,
               images: "ImageInput | None" = None) -> None:
        """Queues a request for up to `sampling.max_new_tokens` tokens (temperature 0: greedy; a
        sampled row draws from key(seed) folded with the token's index, so a seeded request gives
        the same tokens whatever else is in the batch); `callback(Event)` is called from the engine
        thread for every new token and once with a finish reason. output: tokens it already
        generated elsewhere (a migrated request, `Handoff`): it continues after them, their keys
        and values recomputed, and they count towards max_new_tokens. Raises RequestError,
        UnknownAdapter, AdapterError (a name the adapter directory refuses) or EngineBusy.
        head: classify instead of generating (`classify` says how; one token, no output).
        images: the prompt's images (`serve.vision.ImageInput`; its image tokens expanded, one run
        of `tokens_per_image` per image), for an engine with a vision tower.
        """
        self.validate(len(prompt), sampling.max_new_tokens)
        if self.images is not None:
            try:
                self.images.check(prompt, images)
            except ValueError as err:
                raise RequestError(str(err)) from err
        elif images is not None:
            raise RequestError("this model reads text only: it has no vision tower")
        check_request(sampling, output, head, self.model_config.vocab_size, self.modes is not None)
        uid = None if adapter is None else self.resolve_adapter(adapter).uid
        with self._lock:
            waiting = self._num_waiting_submitted + len(self.scheduler.waiting)
            if waiting >= self.config.max_waiting:
                raise EngineBusy(f"{waiting} requests are waiting; try again later")
            self._num_waiting_submitted += 1
        seq = Sequence(request_id, list(prompt), sampling.max_new_tokens, uid, sampling.stop_ids(self.eos_ids),
                       output=list(output), sampling=sampling, cache_prefix=sampling.prompt_logprobs is None,
                       prefix_salt=b"" if images is None else images.digest)
        request = Request(seq, callback, time.monotonic(), head, images=images)
        self._command(lambda: self._add(request))

    def classify(self, request_id, prompt: list[int], adapter: str, callback: Callable[[Event], None]) -> None:
        """Queues a classification of `prompt` by adapter `adapter`'s task head: one prefill-only
        sequence in the normal batches (beside other requests' rows), its last token's features
        through the head, no token delivered; `callback` gets one Event with `probs` [num_labels]
        and finish reason "classified" (or an error). Raises as `submit` does, and NoTaskHead."""
        head = self.task_head(adapter)
        self.submit(request_id, prompt, adapter, SamplingParams(max_new_tokens=1), callback, head=head)

    def abort(self, request_id) -> None:
        """Ends a request (if still known) and frees its pages, at the next step boundary."""
        self._command(lambda: self._abort(request_id))

    def migrate(self, request_id) -> None:
        """Hands a request (if still known) to `handoff` at the next step boundary, its pages freed
        (a draining replica gives its work away); without a `handoff`, nothing happens."""
        self._command(lambda: self._hand_off_now(request_id))

    def _hand_off_now(self, request_id) -> None:
        request = self._requests.get(request_id)
        if request is None or self.handoff is None:
            return
        if request.seq in self.scheduler.running:
            self.scheduler.preempt(request.seq)
        self._hand_off([request.seq])

    def _hand_off(self, preempted: list[Sequence]) -> None:
        """Preempted sequences (waiting again, nothing computed): their sampler slots are released
        (written afresh from prompt and output when next built); with a `handoff`, each is ended here
        and handed to it, else it stays queued to be recomputed."""
        for seq in preempted:
            self.sampler_slots.release(seq.seq_id)
        if self.handoff is None:
            return
        for seq in preempted:
            self.scheduler.finish(seq, "migrated")
            request = self._requests.pop(seq.seq_id)
            entry = None if seq.adapter is None else self.adapters.by_uid(seq.adapter)
            try:
                self.handoff(Handoff(seq.seq_id, seq.prompt, list(seq.output), entry and entry.name, seq.sampling,
                                     request.callback))
            except Exception as err:
                log.exception("handing a request off failed")
                self._deliver(request, Event(None, "error", f"migrating the request failed: {err}"))

    def _command(self, fn) -> None:
        self._commands.append(fn)
        self._wake.set()

    def _add(self, request: Request) -> None:
        with self._lock:
            self._num_waiting_submitted -= 1
        uid = request.seq.adapter
        if uid is not None and self.adapters.by_uid(uid) is None:
            self._deliver(request, Event(None, "error", "the adapter was unloaded"))
            return
        self._requests[request.seq.seq_id] = request
        request.seq.arrival = request.submitted
        self._scoring += prompt_k(request.seq) is not None
        self.scheduler.add(request.seq)

    def _abort(self, request_id) -> None:
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish(request.seq, "abort")
            self._deliver(request, Event(None, "abort"))

    # ---- the step (engine thread) -------------------------------------------------------
    def step(self) -> bool:
        """Runs one iteration: plans and launches the next step, then (async scheduling) reads the
        tokens of the step launched before it, or (synchronous) of this one; returns False when
        there was nothing to do. Host time per phase goes to `stats.phase_seconds`, in total and by
        step kind (`EngineStats.end_iteration`, `PHASES`)."""
        phases = self.stats.phases()
        self.residency.new_step()  # last step's host copies: copied to the device by now
        while self._commands:
            self._commands.popleft()()
        self.residency.drop_removed()
        self._drop_late_requests()
        self._want_adapters()
        self.stalled = False
        if not self.scheduler.has_work() and self._in_flight is None:
            return False
        launched = self._launch(phases)
        previous, self._in_flight = self._in_flight, launched
        self.stalled = launched is None and previous is None  # nothing ran: the queue waits (for adapter reads)
        if previous is not None:
            self._finish(previous, phases)
        if launched is not None and not self.config.async_scheduling:
            self._in_flight = None
            self._finish(launched, phases)
            previous = launched
        self.stats.end_iteration(phases, launched and launched.step.kind, previous and previous.step.kind)
        return True

    def _launch(self, phases: "_PhaseClock") -> "_InFlight | None":
        """Plans the next step, copies in its adapters and runs it without waiting for its tokens;
        pins its adapters' slots until `_finish`. None when no row can run now."""
        if not self.scheduler.has_work():
            return None
        if self.modes is not None:
            self.modes.decide(self.scheduler, self.stats.last_step_s)
        plan = self.scheduler.schedule()
        if not plan.rows and self.modes is not None and self.modes.relax(self.scheduler):
            plan = self.scheduler.schedule()
        self._tell_refused()
        if plan.preempted:
            self._hand_off(plan.preempted)
        phases.mark("schedule")
        self.residency.load(plan.loads)
        phases.mark("load")
        self._commit_staged({row.slot for row in plan.rows})
        phases.mark("commit")
        if not plan.rows:
            return None
        try:
            if self.modes is not None:
                self.modes.apply(self, plan)  # may switch the weights; the merged adapter's rows -> base
            step = self._build_step(plan, phases)
            tokens = self.run_step(step)
            phases.mark("dispatch")
        except Exception as err:  # keep serving: fail the running requests, rebuild the cache
            log.exception("engine step failed")
            self._fail_running(f"engine step failed: {err}")
            return None
        for row in step.plan.rows:  # the slots this step reads stay until it is done
            if row.seq.adapter is not None:
                self.scheduler.slots.pin(row.seq.adapter)
        self.residency.stage(self.scheduler.prefetch())  # overlaps the step running on the device
        phases.mark("prefetch")
        return _InFlight(step, tokens, time.monotonic(), self._last_logprobs, self._last_features, self._last_scores)

    def _finish(self, flight: "_InFlight", phases: "_PhaseClock") -> None:
        """Reads a launched step's tokens (waits for it), unpins its slots and completes its rows."""
        try:
            tokens = np.asarray(flight.tokens)
            logprobs = None if flight.logprobs is None else tuple(np.asarray(a) for a in flight.logprobs)
            features = None
            if flight.features is not None and self._classifies(flight.step):
                features = np.asarray(flight.features)
            scores = None if flight.scores is None else tuple(np.asarray(a) for a in flight.scores)
            phases.mark("wait")
        except Exception as err:
            log.exception("engine step failed")
            self._fail_running(f"engine step failed: {err}")
            tokens = None
        for row in flight.step.plan.rows:
            if row.seq.adapter is not None:
                self.scheduler.slots.unpin(row.seq.adapter)
        if tokens is None:
            return
        done = time.monotonic()
        started, self._last_done = max(flight.launched, self._last_done), done
        self._complete(flight.step, tokens, done - started, logprobs, features, scores)
        phases.mark("complete")

    def _classifies(self, step: Step) -> bool:
        """Whether a row of `step` ends a classification's prompt (its features are needed)."""
        return any(row.sample and getattr(self._requests.get(row.seq.seq_id), "head", None) is not None
                   for row in step.plan.rows)

    # ---- one step's programs (`serve.step_builder`) -----------------------------------------
    def build_step(self, plan: StepPlan) -> Step:
        """The padded inputs of a step over `plan.rows` (laid out in `serving_order`; each row's
        sequence carries its `SamplingParams` in `sampling`), reading the adapter pool now."""
        return self._build_step(plan, _PhaseClock())

    def _build_step(self, plan: StepPlan, phases: "_PhaseClock") -> Step:
        """`StepBuilder.build` over `plan` in serving order, with this engine's state of the moment."""
        plan = self.builder.order(plan)
        phases.mark("order")
        delora = None if self.modes is None else self.modes.delora_key(self, plan)  # mixed: the -ΔW branch
        scoring = self._scoring > 0 and any(scores_prompt(row) for row in plan.rows)  # no window (no score variant)
        in_flight = None if self._in_flight is None else self._in_flight.step
        image_rows = None if self.images is None else functools.partial(self.images.plan_rows, plan.rows, self._requests)
        return self.builder.build(plan, phases, self._last_tokens, in_flight, scoring, delora, self._grammar_masks,
                                  image_rows)

    def _grammar_masks(self, plan_rows, rows: int, phases: "_PhaseClock") -> np.ndarray:
        """A step's token masks (`serve.structured`), called once its forward is dispatched: the step in flight
        before it is read first (its tokens advance the grammars) while the device runs this one's forward."""
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self._finish(previous, phases)
        return self.grammars.masks(plan_rows, rows)

    def run_step(self, step: Step):
        """Runs `step` through `step_fn` (the cache is updated); returns its sampled tokens (row r's
        at index r; a device array by default: reading it waits for the step)."""
        self._last_logprobs = self._last_features = self._last_scores = None
        tokens, self.cache = self.step_fn(step, self.cache)
        self._last_tokens = tokens
        return tokens

    def device_step(self, step: Step, cache: PagedKVCache):
        """The default `step_fn`: the step's compiled programs on the device (compiled now if
        `warmup` did not). Returns (sampled tokens [max_rows] device array, the updated cache)."""
        for shape in step.shapes:
            self.stats.step_compiles += shape not in self.programs
        forward = step.shapes[0]
        scoring = () if step.score_targets is None else (step.score_targets,)
        if step.image_rows is not None:  # a prefill with image tokens (`serve.vision`)
            scoring = (step.score_targets, step.image_rows)
        batch, plan, prev_tokens, token_src = self.step_inputs.place(
            forward, forward_inputs(step.batch, step.lora, step.prev_tokens, step.token_src))
        lora = None if step.lora is None else step.lora._replace(plan=plan)
        greedy, logits, cache, self._last_features, self._last_scores = self.programs.run(
            forward, self._state, cache, batch, lora, prev_tokens, token_src, *scoring)
        if step.sampling is None:
            return greedy, cache
        sampler, masks = step.shapes[1], () if step.masks is None else (step.masks(),)  # overlaps the forward
        if not sampler.program.startswith("sample_state"):
            return self.programs.run(sampler, logits, *step.sampling, *masks), cache
        tokens, self._last_logprobs, self.sampler_slots.arrays = self.programs.run(
            sampler, logits, self.sampler_slots.arrays, *step.sampling, *masks)
        return tokens, cache

    def step_shapes(self) -> list[StepShape]:
        """Every program variant a step of this engine can run (`StepBuilder.step_shapes`)."""
        return self.builder.step_shapes()

    def warmup(self, shapes: list[StepShape] | None = None, threads: int | None = None,
               background: bool | None = None) -> dict:
        """Compiles the programs of `shapes` (default: all of `step_shapes()`), `threads` at a time
        (default: one per CPU core, at most 8), the adapter pool's slot update, the adapter window's
        slot copy and the inference modes' switch; changes nothing the engine serves from (nothing
        runs but an update of an empty slot with zeros). With `background` (None: the config's
        `background_compile`; only for the default shapes) it compiles now only the programs that
        can serve any step (`first_shapes`) and the rest on a background thread (`serve.warmup.Warmup.compile_rest`).
        After `start_warmup`, a call with the defaults waits for the programs it compiles instead.
        Returns {"programs": compiled now, "seconds": wall time, "background": programs left to the
        background thread}."""
        return self.startup.run(shapes, threads, background)

    def start_warmup(self) -> None:
        """Starts `warmup`'s programs on a thread now, lowered over the weights' shapes alone
        (`abstract_state`): the caller may meanwhile replace each weight array by one of the same
        shape, dtype and placement (`serve.warm_start`); `warmup()` then waits for them."""
        self.startup.start()

    # ---- a step's results (engine thread) -----------------------------------------------------
    def _complete(self, step: Step, next_tokens: np.ndarray, seconds: float, logprobs: tuple | None = None,
                  features: np.ndarray | None = None, scores: tuple | None = None) -> None:
        """Hands a step's sampled tokens (row r's at r) to the scheduler and its events to the
        requests; logprobs: the step's (chosen [R], top values [R, K], top ids [R, K]) or None;
        features: the rows' features [R, d] (read when a classification's prompt ends here)."""
        plan = step.plan
        if scores is not None:
            collect_scores(plan, scores, self._requests)
        sampled = {row.seq.seq_id: int(next_tokens[r]) for r, row in enumerate(plan.rows) if row.sample}
        row_of = {row.seq.seq_id: r for r, row in enumerate(plan.rows) if row.sample}
        events = self.scheduler.complete(plan, sampled)
        heads = 0 if features is None else sum(self._requests[seq.seq_id].head is not None for seq, *_ in events)
        self.stats.record_step(step.kind, plan.num_tokens, len(events) - heads, seconds)  # tokens delivered
        if self.modes is not None:
            self.modes.observe(self, plan, seconds)  # the step's cost, for the "auto" policy
        for seq, token, reason in events:
            request = self._requests[seq.seq_id]
            if reason is not None:
                del self._requests[seq.seq_id]
            if request.head is not None:
                self._deliver(request, classified(request.head, features, row_of[seq.seq_id]))
                continue
            prompt_logprobs = None
            if self._scoring and prompt_k(seq) is not None and request.scored_to >= 0:
                prompt_logprobs, request.prompt_entries, request.scored_to = request.prompt_entries, [], -1
                self._scoring -= 1
            self._deliver(request, Event(token, reason, logprobs=row_logprobs(logprobs, row_of[seq.seq_id], seq),
                                         prompt_logprobs=prompt_logprobs))

    def _deliver(self, request: Request, event: Event) -> None:
        try:
            request.callback(event)
        except Exception:
            log.exception("request callback failed")

    def _end(self, seq: Sequence, reason: str, message: str) -> None:
        """Finishes `seq` with `reason` and gives its request (if still known) an error Event with `message`."""
        self.scheduler.finish(seq, reason)
        request = self._requests.pop(seq.seq_id, None)
        if request is not None:
            self._deliver(request, Event(None, reason, message))

    def _drop_late_requests(self) -> None:
        """S-LoRA early abort: waiting requests that can no longer get a first token within
        `ttft_slo_s` end now with an "overloaded" error (the soonest a first token can come is one
        step away: the last step's time)."""
        slo = self.config.ttft_slo_s
        if slo is None:
            return
        for seq in self.scheduler.expire(time.monotonic(), slo, self.stats.last_step_s):
            request = self._requests.pop(seq.seq_id, None)
            self.stats.dropped += 1
            if request is not None:
                self._deliver(request, Event(None, "overloaded", f"the server is overloaded: the request could "
                                                                 f"not start within its {slo * 1e3:.0f} ms "
                                                                 "time-to-first-token objective; retry later"))

    def _fail_running(self, message: str) -> None:
        self.sampler_slots.reset()  # the failed step may have consumed its donated arrays
        self.step_inputs.clear()  # and its inputs' held buffers
        for seq in list(self.scheduler.running):
            self._end(seq, "error", message)
        self.scheduler.clear_prefix_cache()  # the failed step's writes are unknown
        if self.cache.k.is_deleted():
            self.cache = self._new_cache()

    def _tell_refused(self) -> None:
        """Ends the requests the scheduler refused at admission (unified paging: their KV pages and
        their adapter's exceed the whole page pool)."""
        for seq in self.scheduler.refused:
            request = self._requests.pop(seq.seq_id, None)
            if request is not None:
                self._deliver(request, Event(None, "adapter_error", (
                    f"the request's KV pages and its adapter's pages exceed the device page pool "
                    f"({self.config.num_pages} pages of {self.config.page_size} tokens)")))
        self.scheduler.refused.clear()

    # ---- thread ---------------------------------------------------------------------------
    def start(self) -> None:
        """Runs steps in a daemon thread until `stop()`."""
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="jaxlora-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self.startup.stop()  # a compile in the worker is abandoned: the background thread returns
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stopping:
            self._wake.clear()
            try:
                busy, trained = self.step(), self.train_step()
            except Exception:
                log.exception("engine loop error")
                busy = trained = False
            if not trained and (not busy or self.stalled):  # stalled: woken by a read's end, not spinning
                self._wake.wait(STALLED_WAIT_S if busy else 0.05)

    def serving_load(self) -> ServingLoad:
        """The serving side's work now: sequences running, and waiting (queued commands included;
        a launched step whose tokens are unread while none runs counts as one: it is read first)."""
        running = len(self.scheduler.running)
        waiting = len(self.scheduler.waiting) + self._num_waiting_submitted + len(self._commands)
        return ServingLoad(waiting + (self._in_flight is not None and not running), running, self.stats.last_step_s)

    def train_step(self) -> bool:
        """Runs one step of `training` (a microbatch) when the co-scheduling policy picks training
        over serving now (`co_policy`: serving first); True if it ran one."""
        source = self.training
        if source is None:
            return False
        item = source.next_item()
        if self.co_policy.next_kind(self.serving_load(), item, self.stats.training_seconds(item)) != TRAIN:
            return False
        started = time.perf_counter()
        source.run_next()
        self.stats.record_training(item.tokens, time.perf_counter() - started)
        return True

    def wait_for_work(self, timeout: float) -> None:
        """Waits up to `timeout` s for news a `step` can act on (a submit, a command, the end of an
        adapter's disk read): for a caller that steps the engine itself, when `stalled`."""
        self._wake.wait(timeout)
        self._wake.clear()

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        """Steps in the calling thread until no request is left (tests, offline use)."""
        for _ in range(max_steps):
            if not self.step() and not self._commands:
                return
            if self.stalled:
                self.wait_for_work(STALLED_WAIT_S)
        raise RuntimeError(f"still busy after {max_steps} steps")

    # ---- introspection ----------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return self.scheduler.pages.num_free

    def slot_adapters(self) -> list[str | None]:
        """The name of the adapter in each device pool slot (None: free), as the scheduler last
        placed them (read without stopping the engine; may be one step stale)."""
        return self.residency.slot_adapters()

    def snapshot(self) -> dict:
        """Counts for /metrics and /health (`serve.stats.engine_snapshot`; may be one step stale)."""
        return engine_snapshot(self)
