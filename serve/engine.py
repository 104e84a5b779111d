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

Compiled shapes are bucketed: tokens per step to a power of two (>= 8), rows per step to the same
number capped at `max_rows` (the most rows a step can have), block-table width to the longest
context's on a GPU/TPU (the attention kernel reads only each row's pages) or a power of two of
pages (>= 4) on a CPU, the plan's segment count fixed; sampling is a program of its own keyed by rows.
`step_shapes()` lists every program variant a step can need and `warmup()` compiles them all
(and the adapter pool's slot update) without touching the engine's state, so that a server
compiles nothing once it serves (`jaxlora-serve` warms up before `/health` reports ready).
`Engine(step_fn=...)` replaces the device step (host-only benchmarks: the engine's host work
alone, nothing compiled or dispatched).

LoRA kernels (the backends that take a `ServingPlan`, `jaxlora.lora.backends`): the engine orders each step's rows once, on the host
(`jaxlora.lora.plan.serving_order`: prefill chunks grouped by adapter, then one-token rows), and
hands the model a `ServingPlan` over that order, so no projection gathers rows into adapter order
or scatters them back; one-token (decode) rows go through BGMV, prefill chunks through SGMV. A
step without multi-token rows (decode only, so at most `max_num_seqs` tokens) runs BGMV alone:
its own compiled variant of the buckets up to that size. Sampled tokens map back to requests by
row on the host. The other backends get the usual `LoraPlan`.

Adapters (S-LoRA's tiers): `serve.adapter_store.AdapterStore` knows every adapter by name and
holds the disk and host tiers: adapters registered with a path or found in
`EngineConfig.adapter_dir` on first request are read by a background thread into a host cache
bounded by `max_host_adapter_bytes` / `max_host_adapters` (LRU; compact `PreparedAdapter`s: own
rank, stored dtype), and read again when evicted; adapters given without a path are held. Each
step the engine tells the store which adapters the queued requests need (`want`: disk reads
overlap the steps) and the scheduler admits a request only once its adapter is on the host or on
the device, so one whose adapter is still being read waits without holding others back; a
failed read ends the requests naming it (finish reason "adapter_error"). The device `AdapterPool`
holds N adapters and writes a slot in place (one donated jitted update serves every slot),
padding the host copy to its max rank only for that write; with `EngineConfig.unified_paging` it
is a `RowPool` instead: each adapter in exactly its rank of device rows that the scheduler's
unified allocator hands out (`jaxlora.lora.rows`; the LoRA kernels read them through a row table).
A step whose rows all use the base model runs the model
without LoRA inputs (its own compiled variant), so base-only traffic costs exactly the base model.
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

Classification (`classify`, V-LoRA's task heads): a prompt classified by an adapter's task head
(`jaxlora.lora.head`, read from the adapter's folder on first use: `task_head`) is a one-token
greedy sequence in the same steps as every other request; the forward also returns each row's
features (the final norm's output), read back only for a step where a classification's prompt
ends, and its callback gets one Event with the head's `probs` (finish reason "classified") instead
of a token.

A compressed collection (`Engine(..., compressed=SharedBasisSet)`, Compress-then-Serve; needs a
`shared_basis` LoRA backend) is registered adapter by adapter under its names; its bases and cores
stay on the device next to the pool's arrays, and adapter j's rows take the fixed slot
`max_adapters_on_device + j` (never loaded or evicted: `AdapterSlots.fix`).

Tensor parallel: `Engine(..., mesh=jaxlora.sharding.make_mesh(tensor=N, devices=...))` places a
copy of the weights Megatron-style (`jaxlora.sharding.shard_model`; the caller's model is not
moved), the adapter pool S-LoRA-style (`AdapterPool(mesh=...)`: slot loads keep the placement),
and the KV pages split by KV heads; the step's token, plan and sampling arrays are host arrays
that jit replicates. The same jitted step then runs under GSPMD, XLA inserting the all-reduces of
o_proj/down_proj and the gathers over the vocabulary. A `pallas_call` has no SPMD partitioning
rule, so with tensor > 1 only the LoRA backends GSPMD can partition (plain XLA ops; the
registry's `partitionable`, `jaxlora.lora.backends`) are accepted.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import threading
import time
from typing import Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxlora import sharding
from jaxlora.lora import backends
from jaxlora.lora.backends import LoraBackend
from jaxlora.lora.adapter import LoraAdapter, check_finite
from jaxlora.lora.compressed import SharedBasisSet, with_compressed
from jaxlora.lora.adapter_config import AdapterError
from jaxlora.lora.head import TaskHead, load_head
from jaxlora.lora.peft_io import load_peft_adapter
from jaxlora.buckets import bucket
from jaxlora.models.packed import add_adapter_window, fill_window_slot, pack_projections, window_keys, window_layout
from jaxlora.lora.plan import ServingPlan, build_plan, build_serving_plan, build_window_plan, serving_order
from jaxlora.lora.pool import AdapterPool, PreparedAdapter
from jaxlora.lora.rows import RowPool, adapter_rank
from jaxlora.nn.model_config import PROJECTIONS, projection_shapes
from jaxlora.models.llama import Llama, LoraInputs
from jaxlora.models.paged import PagedBatch, PagedKVCache
from jaxlora.sampling import SamplingParams
from jaxlora.scheduler.core import TRAIN, CoSchedulePolicy, ServingLoad, WorkItem
from jaxlora.scheduler.serving import (
    PENDING, CostPolicy, SchedulerConfig, Sequence, ServingScheduler, StepPlan,
    adapter_pages, pages_for,
)

from serve.adapter_copies import StagedCopies
from serve.engine_config import (  # noqa: F401 (re-exported: the engine's public names)
    EngineBusy, EngineConfig, Event, NoTaskHead, RequestError, UnknownAdapter, kv_pages_that_fit,
)
from serve.adapter_store import AdapterStore
from serve.modes import EngineModes
from serve.sampler_state import SamplerSlots, step_sampling
from serve.stats import EngineStats, _PhaseClock
from serve.step import SAMPLERS, Programs, RowSampling, RowState, Step, StepShape
from serve.structured import GrammarRows
from serve.window import WindowSlots

log = logging.getLogger("jaxlora.serve")


@dataclasses.dataclass
class _Request:
    seq: Sequence  # its `sampling` holds the request's SamplingParams
    callback: Callable[[Event], None]
    submitted: float
    head: TaskHead | None = None  # a classification (`Engine.classify`): the head its features go through
    prompt_entries: list = dataclasses.field(default_factory=list)  # prompt log-probabilities so far
    scored_to: int = 1  # the next prompt position whose log-probability is due (recomputed chunks skip)


class Handoff(NamedTuple):
    """A request an engine gives up (preempted for want of KV pages, or `migrate`d) for another to
    continue: `submit(request_id, prompt, adapter, sampling, callback, output=output)`; output:
    the tokens already delivered to the callback."""

    request_id: object
    prompt: list[int]
    output: list[int]
    adapter: str | None
    sampling: SamplingParams
    callback: Callable[[Event], None]


class _InFlight(NamedTuple):
    """A launched step: its inputs, its sampled tokens (a device array until read), when it
    launched, and its log-probabilities (device arrays; None unless its sampler made them)."""

    step: Step
    tokens: object
    launched: float
    logprobs: tuple | None = None
    features: object = None  # the rows' features [R, d] (device array), None from a `step_fn` stub
    scores: tuple | None = None  # a scoring step's (target log-probs [T], top values [T, K], ids [T, K])


def check_mesh(mesh: Mesh, model_config, lora_backend: LoraBackend | str) -> None:
    """ValueError unless the engine can serve on `mesh`: a `tensor` axis and no other axis > 1, a
    LoRA backend GSPMD can partition when tensor > 1, and heads, KV heads, FFN width and vocabulary
    that split evenly over `tensor`."""
    shape = dict(mesh.shape)
    if "tensor" not in shape or any(size > 1 for axis, size in shape.items() if axis != "tensor"):
        raise ValueError(f"the engine shards over a mesh's `tensor` axis only (jaxlora.sharding.make_mesh("
                         f"tensor=N)); got mesh axes {shape}")
    if shape["tensor"] > 1:
        backends.get(lora_backend, serves=True, partitionable=True)
    sharding.check_divisible(model_config, mesh)


def _scores_prompt(row) -> bool:
    """Whether a step row's tokens give prompt log-probabilities (its request asks for them and the
    row covers a prompt position followed by another prompt token)."""
    return _prompt_k(row.seq) is not None and row.start < len(row.seq.prompt) - 1


def _prompt_k(seq: Sequence) -> int | None:
    """The request's SamplingParams.prompt_logprobs (None: none asked, or no SamplingParams)."""
    return getattr(seq.sampling, "prompt_logprobs", None)


def _score_targets(plan: StepPlan, num_tokens: int) -> np.ndarray:
    """[T] int32: each token's next prompt token in the rows that score their prompt, else -1."""
    targets = np.full(num_tokens, -1, np.int32)
    offset = 0
    for row in plan.rows:
        if _scores_prompt(row):
            prompt = row.seq.prompt
            stop = min(row.start + row.count, len(prompt) - 1)
            targets[offset: offset + stop - row.start] = prompt[row.start + 1: stop + 1]
        offset += row.count
    return targets


def _row_tokens(seq: Sequence, start: int, count: int) -> list[int]:
    """seq.tokens[start: start + count] without building prompt + output (a decode row's one token
    is the newest output)."""
    prompt_len = len(seq.prompt)
    if start >= prompt_len:
        return seq.output[start - prompt_len: start - prompt_len + count]
    if start + count <= prompt_len:
        return seq.prompt[start: start + count]
    return seq.prompt[start:] + seq.output[: start + count - prompt_len]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _placed_zeros_cache(config, num_pages, page_size, dtype, placement):
    return jax.lax.with_sharding_constraint(PagedKVCache.zeros(config, num_pages, page_size, dtype), placement)


class Engine:
    """Continuous-batching multi-adapter generation over one model (see the module doc)."""

    def __init__(self, model: Llama, eos_ids=(), config: EngineConfig = EngineConfig(),
                 adapters: dict[str, LoraAdapter] | None = None, mesh: Mesh | None = None,
                 step_fn: Callable[[Step, PagedKVCache], tuple] | None = None,
                 compressed: SharedBasisSet | None = None):
        """mesh: serve tensor parallel over `mesh`'s `tensor` axis (see the module doc).
        step_fn(step, cache) -> (sampled tokens: row r's at index r, the cache): runs each step in
        place of `device_step` (e.g. a host-only stub for benchmarks); a public attribute.
        `self.config` is `config` with its unset sizes filled (see `EngineConfig`).
        compressed: a compressed collection to serve (see the module doc)."""
        devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
        config = config.for_platform(devices[0].platform)
        self.config = config
        self.model_config = model.config
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.mesh = mesh
        if mesh is not None:
            check_mesh(mesh, model.config, config.backend)
            # New Variables over the same arrays, then placed: the caller's model keeps its weights.
            model = sharding.shard_model(nnx.clone(model), mesh)
        else:  # q/k/v and gate/up as one kernel each: 4 GEMMs a layer instead of 7
            model = pack_projections(model)
        self.window = None  # the adapter window's layout (`AdapterWindow`), None: off
        window = min(config.adapter_window or 0, config.max_adapters_on_device)
        if window and mesh is None and compressed is None:
            self.window = window_layout(model.config, window, config.max_lora_rank,
                                        config.lora_target_modules or PROJECTIONS)
            add_adapter_window(model, self.window)
            self._window_slots = WindowSlots(window)
            self._fill_program = None  # `fill_window_slot`, compiled by `warmup` or on first use
        self._graphdef, self._state = nnx.split(model)
        self._dtype = model.dtype
        self.modes = self._inference_modes(config, mesh, compressed)  # None: unmerged only
        # donate: the pool's arrays are written in place; only `build_step` reads them, afresh each step
        self.pool = self._adapter_pool(model, config, mesh, compressed)
        self._compressed = self._place_compressed(compressed, mesh)  # before the KV pages are sized
        if config.num_pages is None:  # sized now: after the weights and the pool are on the devices
            config = self.config = dataclasses.replace(config, num_pages=self._pages_that_fit(devices))
        self.cache = self._new_cache()
        self.max_rows = bucket(min(config.max_num_seqs, config.token_budget), 8)  # most rows of a step
        fixed = 0 if compressed is None else min(len(compressed.names), self.max_rows)  # distinct per step
        self._num_segments, chunk_bound = self._segments(config, fixed)
        self.scheduler = ServingScheduler(SchedulerConfig(
            num_pages=config.num_pages, page_size=config.page_size,
            num_adapter_slots=config.max_adapters_on_device, max_num_seqs=config.max_num_seqs,
            token_budget=config.token_budget, prefill_chunk=config.prefill_chunk,
            unified_paging=config.unified_paging, reserve_output=config.reserve_output_kv,
            adapter_rows=self.pool.num_rows if isinstance(self.pool, RowPool) else 0,
            max_prefill_adapters=chunk_bound, prefix_caching=config.prefix_caching))
        if self.modes is not None:  # merged weights compute other bits: blocks keyed by the step's mode too
            self.scheduler.prefix_root = self.modes.prefix_root
        self.scheduler.adapter_pages = self._adapter_pages
        self.scheduler.adapter_rows = lambda uid: adapter_rank(self._host_copy(uid))
        self.handoff: Callable[[Handoff], None] | None = None  # set by a replica set (module doc)
        self._max_pages = bucket(pages_for(config.max_model_len, config.page_size), 1)
        self._decode_variant: bool | None = None  # `_has_decode_variant`, once known
        self._min_tokens = config.min_step_tokens  # the smallest token bucket (`_padded_tokens`)
        self._min_lora_mixed = min(bucket(config.min_lora_mixed_tokens, self._min_tokens),
                                   bucket(config.token_budget, self._min_tokens))
        self.programs = Programs(self._graphdef, config.backend, self.max_rows, config.scan_layers_from_tokens)
        self._background: threading.Thread | None = None  # `warmup`'s background compile
        self.sampler_slots = SamplerSlots(config.max_num_seqs, model.config.vocab_size,
                                          None if mesh is None else NamedSharding(mesh, jax.sharding.PartitionSpec()))
        self.grammars = GrammarRows(model.config.vocab_size, self.eos_ids)  # structured outputs' matchers
        self.step_fn = step_fn or self.device_step
        self._last_tokens = np.zeros(self.max_rows, np.int32)  # the previous step's sampled tokens
        self._last_logprobs = None  # the last step's log-probabilities (device arrays), if it made them
        self._last_features = None  # the last step's row features [R, d] (device array; `classify`)
        self._last_scores = None  # the last scoring step's prompt log-probabilities (device arrays)
        self._scoring = 0  # requests whose prompt log-probabilities are not delivered yet (>=: steps check rows)
        self._heads: dict[int, TaskHead | None] = {}  # adapter uid -> its task head, once looked up
        self._in_flight: _InFlight | None = None  # launched, tokens not read yet (async scheduling)
        self._last_done = 0.0  # when the last step's tokens were read
        self._lock = threading.Lock()
        self.adapters = AdapterStore(self._read_adapter, config.adapter_dir, config.max_host_adapter_bytes,
                                     config.max_host_adapters)
        self.scheduler.is_ready = self._adapter_ready  # admit a request once its adapter is on the host
        self._host_copies: dict = {}  # uid -> host copy of an adapter found ready this step
        self._commands: collections.deque = collections.deque()
        # Background copies need a device apart from the host (on a CPU backend the copy is a memcpy
        # on the cores that run the step) and a pool without a mesh (see `_stage`).
        self.background_prefetch = mesh is None and jax.default_backend() != "cpu"
        self._requests: dict = {}
        self._num_waiting_submitted = 0
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.stats = EngineStats(prefix=self.scheduler.prefix)
        self.copies = StagedCopies(self.pool, self.stats)  # prefetched adapters on their way to the device
        # Training in the steps serving leaves idle (`jaxlora.scheduler.core`): set by the server.
        self.training: TrainingSource | None = None
        self.co_policy = CoSchedulePolicy()
        for name, adapter in (adapters or {}).items():
            self.add_adapter(name, adapter)
        for index, name in enumerate(() if compressed is None else compressed.names):
            self._register_compressed(name, index)

    def _adapter_pool(self, model: Llama, config: EngineConfig, mesh, compressed) -> AdapterPool:
        """The device adapter pool: max-rank slots, or with unified paging rows (`RowPool`, whose
        rows for a slot are those the scheduler's allocator gave the slot's adapter)."""
        targets = config.lora_target_modules or PROJECTIONS
        pinned = config.pinned_host_adapters
        if pinned is None:
            pinned = mesh is None and jax.default_backend() == "gpu"
        if not config.unified_paging:
            return AdapterPool(model.config, config.max_adapters_on_device, config.max_lora_rank, targets,
                               dtype=model.dtype, donate=True, mesh=mesh, pinned=pinned)
        if mesh is not None or compressed is not None:
            raise ValueError("unified_paging (adapters in device rows) serves on one device without a compressed "
                             "collection")
        rows = config.adapter_rows or config.max_adapters_on_device * config.max_lora_rank
        return RowPool(model.config, config.max_adapters_on_device, config.max_lora_rank, rows, targets,
                       dtype=model.dtype, rows_of=self._slot_rows, pinned=pinned)

    def _slot_rows(self, slot: int) -> list[int]:
        """The device rows the allocator gave the adapter now placed in `slot` (`RowPool.rows_of`); []
        when none is (a prefetched adapter evicted before its staged copy was written)."""
        key, pages = self.scheduler.slots.keys[slot], self.scheduler.pages
        return pages.rows_of(key) if key is not None and pages.holds(key) else []

    def model_view(self) -> Llama:
        """The served model as a module over the engine's own weight Variables (no copy; packed
        projections and the adapter window's columns included): a program given it reads the
        weights as they are when it runs. Training in the server runs on it (`serve.finetune`)."""
        return nnx.merge(self._graphdef, self._state)

    def _inference_modes(self, config: EngineConfig, mesh, compressed) -> EngineModes | None:
        """The mode state of `config.inference_mode` (its base copy made now, before the KV pages
        are sized); ValueError where the mode cannot run."""
        if config.inference_mode == "unmerged":
            return None
        if mesh is not None or compressed is not None:
            raise ValueError(f"inference_mode {config.inference_mode!r} needs one device and no compressed collection")
        if config.inference_mode != "merged" and (self.window is None
                                                  or self.window.slots < config.max_adapters_on_device):
            raise ValueError(f"inference_mode {config.inference_mode!r} needs an adapter window of at least "
                             f"max_adapters_on_device ({config.max_adapters_on_device}) slots")
        policy = config.mode_policy or CostPolicy(max_batch=config.max_num_seqs)
        return EngineModes.build(config.inference_mode, policy, self.model_config, self._state["weights"],
                                 PROJECTIONS)

    @property
    def tensor_parallel(self) -> int:
        return 1 if self.mesh is None else self.mesh.shape["tensor"]

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
        """Bytes of one KV page on one device (keys and values of `page_size` tokens, every layer;
        KV heads split over tensor)."""
        model = self.model_config
        return (2 * model.num_layers * self.config.page_size * model.num_kv_heads * model.head_dim
                * np.dtype(self._dtype).itemsize // self.tensor_parallel)

    def _adapter_pages(self, uid) -> int:
        """Unified paging: pages of adapter `uid` at its own rank in the pool's dtype (r rows of A
        and of B per target module and layer; in a `RowPool` its r rows in every module the pool
        holds), in units of a KV page."""
        prepared = self._host_copy(uid)
        if isinstance(self.pool, RowPool):  # the rows it takes on the device, in every module of the pool
            return adapter_pages(adapter_rank(prepared) * self.pool.row_bytes, self._page_bytes())
        rows = sum(parts["a"].size + parts["b"].size for parts in prepared.values.values())
        return adapter_pages(rows * np.dtype(self._dtype).itemsize // self.tensor_parallel, self._page_bytes())

    def _new_cache(self) -> PagedKVCache:
        """Zeroed KV pages; with a mesh, made in place split by KV heads."""
        sizes = (self.model_config, self.config.num_pages, self.config.page_size, self._dtype)
        if self.mesh is None:
            return PagedKVCache.zeros(*sizes)
        return _placed_zeros_cache(*sizes, NamedSharding(self.mesh, sharding.ShardingRules().spec(
            sharding.KV_CACHE_AXES)))

    def _place_compressed(self, compressed: SharedBasisSet | None, mesh) -> dict | None:
        """The compressed collection's device arrays, checked against the model, pool and backend."""
        if compressed is None:
            return None
        if not self.config.backend.shared_basis:
            raise ValueError(f"serving a compressed collection needs a shared-basis LoRA backend "
                             f"({', '.join(backends.names(shared_basis=True))}), "
                             f"not {self.config.lora_backend!r}")
        if mesh is not None:
            raise ValueError("a compressed collection is served on one device (no tensor parallel)")
        shapes = projection_shapes(self.model_config)
        for module, shape in compressed.shapes().items():
            if shape != (self.model_config.num_layers, *shapes[module]):
                raise AdapterError(f"the compressed collection's {module} has (layers, in, out) {shape}, the base "
                                   f"model {(self.model_config.num_layers, *shapes[module])}")
        arrays = compressed.device_arrays(self._dtype)
        with_compressed(self.pool.arrays, arrays)  # ValueError for a module the pool does not hold
        return arrays

    def _register_compressed(self, name: str, index: int) -> None:
        entry = self.adapters.add(name, fixed=True)
        self.scheduler.slots.fix(entry.uid, self.config.max_adapters_on_device + index)

    def _lora_arrays(self) -> dict:
        """The LoRA arrays a step reads: the pool's (read afresh: loads replace them), plus the
        compressed collection's."""
        return self.pool.arrays if self._compressed is None else with_compressed(self.pool.arrays, self._compressed)

    # ---- adapters (any thread) ---------------------------------------------------------
    def add_adapter(self, name: str, adapter: LoraAdapter, path: str | None = None,
                    head: TaskHead | None = None) -> None:
        """Registers `adapter` under `name`; AdapterError if the pool cannot hold it, ValueError if
        the name is taken. With `path` (the folder it was read from) it goes into the bounded host
        cache and is read from there again after an eviction; without, it is held in host memory.
        head: its task head (`classify`); None: the one in `path`'s folder, if any."""
        if name in self.adapters.names():
            raise ValueError(f"an adapter named {name!r} is already loaded")
        if head is not None:
            self._check_head(head)
        entry = self.adapters.add(name, self.prepare_adapter(adapter), path)
        if head is not None:
            with self._lock:
                self._heads[entry.uid] = head

    def task_head(self, name: str) -> TaskHead:
        """The task head of adapter `name` (read from its folder on first use; any thread):
        UnknownAdapter, AdapterError (a malformed head), or NoTaskHead."""
        entry = self.resolve_adapter(name)
        with self._lock:
            known = entry.uid in self._heads
            head = self._heads.get(entry.uid)
        if not known:
            head = None if entry.path is None else load_head(entry.path, self.model_config.hidden_size)
            if head is not None:
                self._check_head(head)
            with self._lock:
                self._heads[entry.uid] = head
        if head is None:
            raise NoTaskHead(f"the adapter {name!r} has no task head (no head_config.json in its folder)")
        return head

    def _check_head(self, head: TaskHead) -> None:
        if head.weight.shape != (head.num_labels, self.model_config.hidden_size) or head.bias.shape != (head.num_labels,):
            raise AdapterError(f"task head weights {head.weight.shape}/{head.bias.shape} do not fit {head.num_labels} "
                               f"labels and hidden size {self.model_config.hidden_size}")

    def remove_adapter(self, name: str) -> None:
        """Forgets `name` (UnknownAdapter if absent). Requests already submitted still finish."""
        try:
            entry = self.adapters.remove(name)
        except LookupError:
            raise UnknownAdapter(name) from None
        with self._lock:
            self._heads.pop(entry.uid, None)
        self._wake.set()

    def adapter_names(self) -> list[str]:
        """Registered adapters (those of `adapter_dir` once requested)."""
        return self.adapters.names()

    def resolve_adapter(self, name: str):
        """The store entry of `name` (a directory adapter is registered now): UnknownAdapter if there
        is none, AdapterError for a name the directory refuses (`AdapterStore.resolve`)."""
        try:
            return self.adapters.resolve(name)
        except LookupError:
            raise UnknownAdapter(name) from None

    def _read_adapter(self, path: str, name: str) -> PreparedAdapter:
        """Reads and checks one adapter folder for the store's reader thread (stored dtype kept;
        `load_peft_adapter` has checked that its weights are finite)."""
        adapter = load_peft_adapter(path, self.model_config, name, keep_dtype=True)
        self.check_adapter(adapter, finite=False)
        return self.pool.prepare(adapter, check=False)

    def check_adapter(self, adapter: LoraAdapter, finite: bool = True) -> None:
        """AdapterError unless `adapter` fits this engine's pool (modules, rank, shapes; finite
        weights unless `finite` is False, for a caller that checked them)."""
        extra = sorted(set(adapter.modules) - set(self.pool.target_modules))
        if extra:
            raise AdapterError(f"adapter targets {extra}, which the pool does not hold")
        if adapter.max_rank > self.config.max_lora_rank:
            raise AdapterError(f"adapter rank {adapter.max_rank} exceeds the server's max LoRA rank "
                               f"{self.config.max_lora_rank}")
        shapes = projection_shapes(self.model_config)
        for module, weights in adapter.modules.items():
            fan_in, fan_out = shapes[module]
            layers = self.model_config.num_layers
            if weights.a.shape[:2] != (layers, fan_in) or weights.b.shape[::2] != (layers, fan_out):
                raise AdapterError(f"{module} weights {weights.a.shape}/{weights.b.shape} do not fit the base model")
        if finite:
            check_finite(adapter, "adapter")

    def prepare_adapter(self, adapter: LoraAdapter) -> PreparedAdapter:
        """`check_adapter`, then the adapter as the pool loads it (compact host arrays)."""
        self.check_adapter(adapter)
        return self.pool.prepare(adapter, check=False)  # check_adapter covers the pool's checks

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
               callback: Callable[[Event], None], output: list[int] = (), head: TaskHead | None = None) -> None:
        """Queues a request for up to `sampling.max_new_tokens` tokens (temperature 0: greedy; a
        sampled row draws from key(seed) folded with the token's index, so a seeded request gives
        the same tokens whatever else is in the batch); `callback(Event)` is called from the engine
        thread for every new token and once with a finish reason. output: tokens it already
        generated elsewhere (a migrated request, `Handoff`): it continues after them, their keys
        and values recomputed, and they count towards max_new_tokens. Raises RequestError,
        UnknownAdapter, AdapterError (a name the adapter directory refuses) or EngineBusy.
        head: classify instead of generating (`classify` says how; one token, no output).
        """
        self.validate(len(prompt), sampling.max_new_tokens)
        if head is not None and (sampling.max_new_tokens != 1 or output):
            raise RequestError("a classification (head) is one prefill-only sequence: max_new_tokens 1, no output")
        if sampling.prompt_logprobs is not None and (self.modes is not None or output):
            raise RequestError("prompt log-probabilities are computed in the unmerged inference mode, for a request "
                               "without resumed output")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in [t for t, _ in sampling.logit_bias] + list(sampling.stop_token_ids)):
            raise RequestError(f"logit_bias and stop_token_ids take token ids in [0, {vocab})")
        if len(output) >= sampling.max_new_tokens or any(not 0 <= t < vocab for t in output):
            raise RequestError(f"a resumed request has fewer than max_tokens ({sampling.max_new_tokens}) output "
                               f"tokens, each in [0, {vocab})")
        uid = None if adapter is None else self.resolve_adapter(adapter).uid
        with self._lock:
            waiting = self._num_waiting_submitted + len(self.scheduler.waiting)
            if waiting >= self.config.max_waiting:
                raise EngineBusy(f"{waiting} requests are waiting; try again later")
            self._num_waiting_submitted += 1
        seq = Sequence(request_id, list(prompt), sampling.max_new_tokens, uid, sampling.stop_ids(self.eos_ids),
                       output=list(output), sampling=sampling, cache_prefix=sampling.prompt_logprobs is None)
        request = _Request(seq, callback, time.monotonic(), head)
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

    def _add(self, request: _Request) -> None:
        with self._lock:
            self._num_waiting_submitted -= 1
        uid = request.seq.adapter
        if uid is not None and self.adapters.by_uid(uid) is None:
            self._deliver(request, Event(None, "error", "the adapter was unloaded"))
            return
        self._requests[request.seq.seq_id] = request
        request.seq.arrival = request.submitted
        self._scoring += _prompt_k(request.seq) is not None
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
        there was nothing to do. Host time per phase accumulates in `stats.phase_seconds` (see
        `EngineStats.PHASES`)."""
        phases = self.stats.phases()
        self._host_copies.clear()  # last step's: copied to the device by now
        while self._commands:
            self._commands.popleft()()
        self._drop_removed_adapters()
        self._drop_late_requests()
        self._want_adapters()
        if not self.scheduler.has_work() and self._in_flight is None:
            return False
        launched = self._launch(phases)
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            self._finish(previous, phases)
        if launched is not None and not self.config.async_scheduling:
            self._in_flight = None
            self._finish(launched, phases)
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
        self._load(plan.loads)
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
        self._stage(self.scheduler.prefetch())  # overlaps the step running on the device
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

    # ---- one step's programs --------------------------------------------------------------
    def build_step(self, plan: StepPlan) -> Step:
        """The padded inputs of a step over `plan.rows` (laid out in `serving_order`; each row's
        sequence carries its `SamplingParams` in `sampling`), reading the adapter pool now."""
        return self._build_step(plan, _PhaseClock({}))

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
        greedy, logits, cache, self._last_features, self._last_scores = self.programs.run(
            forward, self._state, cache, step.batch, step.lora, step.prev_tokens, step.token_src, *scoring)
        if step.sampling is None:
            return greedy, cache
        sampler, masks = step.shapes[1], () if step.masks is None else (step.masks(),)  # overlaps the forward
        if not sampler.program.startswith("sample_state"):
            return self.programs.run(sampler, logits, *step.sampling, *masks), cache
        tokens, self._last_logprobs, self.sampler_slots.arrays = self.programs.run(
            sampler, logits, self.sampler_slots.arrays, *step.sampling, *masks)
        return tokens, cache

    def step_shapes(self) -> list[StepShape]:
        """Every program variant a step of this engine can run (see `StepShape`): forwards over
        each token bucket (8 .. the token budget's) and block-table width (`_table_width`: one on
        a GPU/TPU, else buckets 4 .. the context's), with LoRA inputs and without, plus the
        decode-only LoRA variant of the buckets a step of one-token rows fits (<= max_rows tokens)
        where the backend's plan has one; and the samplers (`SAMPLERS`) over each row bucket."""
        config = self.config
        tokens = sorted({bucket(t, self._min_tokens) for t in range(1, config.token_budget + 1)})
        widths = sorted({self._table_width(p) for p in range(1, self._max_pages + 1)})
        variants = [(False, False), (True, False)]
        if self._has_decode_variant():
            variants.append((True, True))
        shapes = [StepShape("forward", t, self._rows(t), w, lora, decode_only)
                  for lora, decode_only in variants for t in tokens if self._has_bucket(t, lora, decode_only)
                  for w in widths]
        if self.window is not None:
            shapes += [StepShape("forward", t, self._rows(t), w, True, False, True) for t in tokens for w in widths]
        return shapes + [StepShape(sampler, 0, rows) for sampler in SAMPLERS
                         for rows in sorted({self._rows(t) for t in tokens})]

    def warmup(self, shapes: list[StepShape] | None = None, threads: int | None = None,
               background: bool | None = None) -> dict:
        """Compiles the programs of `shapes` (default: all of `step_shapes()`), `threads` at a time
        (default: one per CPU core, at most 8), the adapter pool's slot update, the adapter window's
        slot copy and the inference modes' switch; changes nothing the engine serves from (nothing
        runs but an update of an empty slot with zeros). With `background` (None: the config's
        `background_compile`; only for the default shapes) it compiles now only the programs that
        can serve any step (`first_shapes`) and the rest on a background thread (`_compile_rest`).
        Returns {"programs": compiled now, "seconds": wall time, "background": programs left to the
        background thread}."""
        started = time.perf_counter()
        background = self.config.background_compile if background is None else background
        rest: list[StepShape] = []
        if shapes is None:
            shapes = self.step_shapes()
            if background:  # the scoring programs (prompt log-probabilities) last
                first = self.first_shapes(shapes)
                shapes, rest = first, [shape for shape in shapes if shape not in first] + self._score_shapes(shapes)
        before = len(self.programs)
        threads = min(8, os.cpu_count() or 1) if threads is None else threads
        log.info("compiling %d step programs (%d threads)%s", len(shapes), threads,
                 f"; {len(rest)} more in the background once serving" if rest else "")
        # with a background compile the first programs are scanned (fast to compile); those that run
        # unrolled in the end are compiled again in the background (`Programs` stand-ins)
        self._compile_shapes(shapes, threads, _progress_log(started), scan=True if rest else None)
        rest += [shape for shape in self.programs.stand_ins() if shape not in rest]
        free = self.pool.free_slot()
        if free is not None:  # an empty slot written with zeros: compiles the update, changes nothing
            self.pool.evict(free)
        if self.window is not None:  # the window's fill: compiled, not run
            self._window_fill_program()
        if self.modes is not None:
            self.modes.warmup(self)
        seconds = time.perf_counter() - started
        log.info("step programs ready: %d compiled in %.1f s", len(self.programs) - before, seconds)
        if rest:
            self._background = threading.Thread(target=self._compile_rest, args=(rest,), daemon=True,
                                                name="jaxlora-compile-background")
            self._background.start()
        return {"programs": len(self.programs) - before, "seconds": seconds, "background": len(rest)}

    def first_shapes(self, shapes: list[StepShape]) -> list[StepShape]:
        """The programs of `shapes` that serve any step until the rest are compiled: per forward
        variant (LoRA or not, decode-only, window, table width) its largest token bucket and its
        smallest one that holds a decode step of every row (`warmup` compiles them scanned: fast),
        and the samplers over their rows."""
        forwards = [shape for shape in shapes if shape.program == "forward"]
        first, all_rows = set(), bucket(self.max_rows, self._min_tokens)
        for variant in {(s.width, s.lora, s.decode_only, s.window) for s in forwards}:
            tokens = sorted(s.tokens for s in forwards if (s.width, s.lora, s.decode_only, s.window) == variant)
            fits = [t for t in tokens if t >= all_rows]
            first |= {s for s in forwards if (s.width, s.lora, s.decode_only, s.window) == variant
                      and s.tokens in (tokens[-1], fits[0] if fits else tokens[-1])}
        rows = {shape.rows for shape in first}
        return [shape for shape in shapes if shape in first or (shape.program != "forward" and shape.rows in rows)]

    def _score_shapes(self, shapes: list[StepShape]) -> list[StepShape]:
        """The scoring variants of `shapes`' base and LoRA (not decode-only, not window) forwards over
        buckets of scanned layers (where a scoring step runs: `_batch_arrays`)."""
        return [shape._replace(score=True) for shape in shapes if shape.program == "forward" and not shape.window
                and not shape.decode_only and shape.tokens >= self.programs.scan_from_tokens]

    def _compile_shapes(self, shapes: list[StepShape], threads: int, progress=None, scan: bool | None = None) -> None:
        """Compiles `shapes` (forwards first: the samplers take the forwards' logits sharding);
        `scan`: see `Programs.compile`."""
        for program in ("forward",) + SAMPLERS:
            todo = [shape for shape in shapes if shape.program == program]
            self.programs.compile_all([(shape, self._padding_args(shape)) for shape in todo], threads,
                                      None if progress is None else progress(program), scan=scan)

    def _compile_rest(self, shapes: list[StepShape]) -> None:
        """The background thread of `warmup`: the forwards of each token bucket, smallest first, then
        the samplers over their rows, one program at a time, the scoring forwards last; stops with
        the engine."""
        started = time.perf_counter()
        for tokens in sorted({shape.tokens for shape in shapes if shape.program == "forward"}):
            if self._stopping:
                return
            forwards = [shape for shape in shapes
                        if shape.program == "forward" and shape.tokens == tokens and not shape.score]
            samplers = [shape for shape in shapes if shape.program != "forward" and shape.rows == self._rows(tokens)]
            try:
                self._compile_shapes(forwards + samplers, 1)
            except Exception:  # the step compiles it when it needs it (and raises there)
                log.exception("background compile of the %d-token programs failed", tokens)
        left = [shape for shape in shapes if shape not in self.programs or shape in self.programs.stand_ins()]
        if left and not self._stopping:
            self._compile_shapes(left, 1)
        log.info("background compile done: %d programs in %.1f s", len(shapes), time.perf_counter() - started)

    def _compiled_tokens(self, tokens: int, width: int, plan: StepPlan, window: bool) -> int:
        """`tokens`, or while the background compile runs and that bucket's forward (or its samplers)
        is not compiled yet, the smallest larger bucket of the step's variant that is."""
        if self._background is None or not self._background.is_alive():
            return tokens
        lora = window or any(row.slot >= 0 for row in plan.rows)
        decode_only = (lora and not window and all(row.count == 1 for row in plan.rows)
                       and self._has_decode_variant())
        variant = (width, lora, decode_only, window)

        def ready(t: int) -> bool:
            rows = self._rows(t)
            return (StepShape("forward", t, rows, *variant) in self.programs
                    and StepShape("sample", 0, rows) in self.programs and StepShape("sample_state", 0, rows) in self.programs)

        if ready(tokens):
            return tokens
        larger = [s.tokens for s in self.programs.shapes() if s.program == "forward" and not s.score
                  and s.tokens > tokens and (s.width, s.lora, s.decode_only, s.window) == variant and ready(s.tokens)]
        return min(larger, default=tokens)

    def _has_bucket(self, tokens: int, lora: bool, decode_only: bool) -> bool:
        """Whether a forward variant over `tokens` padded tokens exists (see `_padded_tokens`)."""
        if decode_only:
            return tokens <= bucket(self.max_rows, self._min_tokens)
        # the mixed minimum applies where decode steps have a variant of their own
        return not lora or not self._has_decode_variant() or tokens >= self._min_lora_mixed

    def _padded_tokens(self, plan: StepPlan) -> int:
        """Padded tokens of a step: the bucket of its token count, at least `min_step_tokens`, and
        at least `min_lora_mixed_tokens` for a LoRA step with a prefill row (or a decode-only LoRA
        step too large for the decode variant)."""
        tokens = bucket(plan.num_tokens, self._min_tokens)
        lora = any(row.slot >= 0 for row in plan.rows)
        decode_only = all(row.count == 1 for row in plan.rows) and self._has_decode_variant()
        if lora and not self._has_bucket(tokens, lora, decode_only):
            tokens = max(tokens, self._min_lora_mixed)
        return tokens

    def _has_decode_variant(self) -> bool:
        """Whether the backend's plan has a decode-only variant (a segment-free `ServingPlan`)."""
        if self._decode_variant is None:
            plan = self._lora_plan(np.full(8, -1, np.int32), np.ones(8, bool), True)
            self._decode_variant = isinstance(plan, ServingPlan) and plan.seg_starts is None
        return self._decode_variant

    def _rows(self, num_tokens: int) -> int:
        """Padded rows of a step of `num_tokens` padded tokens."""
        return min(num_tokens, self.max_rows)

    def _padding_args(self, shape: StepShape) -> tuple:
        """Dynamic arguments of the program `shape` for a step of padding only (writes nothing)."""
        if shape.program in SAMPLERS:
            rows = shape.rows
            logits = jax.ShapeDtypeStruct((rows, self.model_config.vocab_size), jnp.float32,
                                          sharding=self.programs.logits_sharding(rows))
            masks = (np.full((rows, self.grammars.words), -1, np.int32),) if shape.program.endswith("_masked") else ()
            if not shape.program.startswith("sample_state"):
                return (logits, RowSampling.greedy(rows)) + masks
            return (logits, self.sampler_slots.specs(), RowSampling.greedy(rows),
                    RowState.empty(rows, self.sampler_slots.num_slots)) + masks
        tokens = shape.tokens
        zeros = np.zeros(tokens, np.int32)
        no_rows = np.full(tokens, -1, np.int32)
        batch = PagedBatch(zeros, zeros, no_rows, np.zeros((shape.rows, shape.width), np.int32),
                           np.zeros(shape.rows, np.int32))
        lora = None
        if shape.window:
            lora = LoraInputs({}, build_window_plan(no_rows, self.window.slots, self.window.rank))
        elif shape.lora:
            lora = LoraInputs(self._lora_arrays(), self._lora_plan(no_rows, np.zeros(tokens, bool), shape.decode_only))
        scoring = (no_rows,) if shape.score else ()
        return (self._state, self.cache, batch, lora, self._last_tokens, no_rows) + scoring

    def _build_step(self, plan: StepPlan, phases: "_PhaseClock") -> Step:
        order = serving_order([row.slot for row in plan.rows], [row.count for row in plan.rows])
        plan = dataclasses.replace(plan, rows=[plan.rows[i] for i in order])
        phases.mark("order")
        delora = None if self.modes is None else self.modes.delora_key(self, plan)  # mixed: the -ΔW branch
        scoring = self._scoring > 0 and any(_scores_prompt(row) for row in plan.rows)  # no window (no score variant)
        in_window = None if scoring else self._place_in_window(sorted({row.slot for row in plan.rows if row.slot >= 0}),
                                                                delora, prefill=any(row.count > 1 for row in plan.rows))
        batch, token_slot, one_token = self._batch_arrays(plan, in_window is not None, scoring)
        score_targets = _score_targets(plan, len(batch.tokens)) if scoring else None
        phases.mark("batch")
        decode_only = bool(one_token[: plan.num_tokens].all())
        lora = None
        if in_window is not None:  # every adapter of the step in the window: no LoRA kernel
            token_extra = None
            if delora is not None:  # the branch's window slot for the tokens of the rows that add it
                rows = np.append(self.modes.branch_rows(plan), False)  # padding tokens (row -1): none
                token_extra = np.where(rows[batch.token_row], in_window.pop(delora[0]), -1)
            lookup = np.full(self.config.max_adapters_on_device + 1, -1, np.int32)
            lookup[list(in_window)] = list(in_window.values())
            lora = LoraInputs({}, build_window_plan(lookup[token_slot], self.window.slots, self.window.rank,
                                                    token_extra))
        elif (token_slot >= 0).any():
            lora = LoraInputs(self._lora_arrays(), self._lora_plan(token_slot, one_token, decode_only))
        else:  # base rows only: the base model's own compiled step, no pool or plan
            self.stats.base_only_steps += 1
        phases.mark("lora_plan")
        rows, width = batch.block_tables.shape
        forward = StepShape("forward", len(batch.tokens), rows, width, lora is not None,
                            isinstance(lora and lora.plan, ServingPlan) and lora.plan.seg_starts is None,
                            in_window is not None, scoring)
        masked = self.grammars.constrains(plan.rows)  # a row under a grammar: its masks when the forward runs
        sampler = step_sampling(plan.rows, rows, self.sampler_slots, self.eos_ids, masked)
        sampling = None if sampler is None else sampler[1]
        shapes = (forward,) if sampler is None else (forward, StepShape(sampler[0], 0, rows))
        phases.mark("sampling")
        kind = ("base " if lora is None else "window " if in_window is not None else "lora ") + (
            "decode" if decode_only else "mixed")
        return Step(plan, shapes, kind, batch, lora, self._last_tokens, self._token_sources(plan, batch.tokens),
                    sampling, score_targets, functools.partial(self._grammar_masks, plan.rows, rows, phases) if masked
                    else None)

    def _grammar_masks(self, plan_rows, rows: int, phases: "_PhaseClock") -> np.ndarray:
        """A step's token masks (`serve.structured`), called once its forward is dispatched: the step in flight
        before it is read first (its tokens advance the grammars) while the device runs this one's forward."""
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self._finish(previous, phases)
        return self.grammars.masks(plan_rows, rows)

    def _place_in_window(self, slots: list[int], extra: tuple | None = None, prefill: bool = False
                         ) -> dict[int, int] | None:
        """{pool slot: window slot} for a step whose rows use the pool slots `slots` (and the window
        key `extra`: a mixed step's -ΔW branch, `EngineModes.delora_key`), copying the adapters not
        in the window yet into it (on the device, before the step); None when the window is off,
        the step has no adapter, more adapters than the window holds, or (`prefill`: a step with a
        prefill row) more than `window_mixed_adapters`."""
        if self.window is None:
            return None
        limit = self.config.window_mixed_adapters
        if prefill and extra is None and limit is not None and len(slots) > limit:
            return None
        wanted = [(slot, self.pool.slot_writes[slot]) for slot in slots] + ([] if extra is None else [extra])
        if not wanted:
            return None
        assigned = self._window_slots.assign(wanted)
        if assigned is None:
            if extra is not None:
                raise RuntimeError("a mixed step's adapters and -ΔW branch exceed the adapter window")
            return None
        placed, fills = assigned
        for window_slot, pool_slot in fills:
            self._fill_window(window_slot, pool_slot)
        return placed

    def _fill_window(self, window_slot: int, pool_slot: int) -> None:
        """Copies pool slot `pool_slot` into window slot `window_slot` of the model's weights (in
        place: `fill_window_slot` donates them); a negative `pool_slot` -1 - s: slot s with its
        scale negated (the -ΔW branch of mixed steps, `serve.modes`)."""
        weights = self._state["weights"]
        args = self._window_fill_args(window_slot, pool_slot if pool_slot >= 0 else -1 - pool_slot)
        if pool_slot < 0:  # the -ΔW branch: the pool's scales negated
            args = (args[0], {name: {**arrays, "scale": -arrays["scale"]} for name, arrays in args[1].items()}, *args[2:])
        filled = self._window_fill_program()(*args)
        for key in window_keys(self.window):
            weights[key].set_value(filled[key])
        self.stats.window_fills += 1

    def _window_fill_args(self, window_slot: int, pool_slot: int) -> tuple:
        """`fill_window_slot`'s dynamic arguments: the window's weights, the pool, the two slots."""
        weights = self._state["weights"]
        pool, pool_slot = self.pool.window_source(pool_slot)
        return ({key: weights[key][...] for key in window_keys(self.window)}, pool, np.int32(window_slot),
                np.int32(pool_slot))

    def _window_fill_program(self):
        """`fill_window_slot` compiled for this engine (once; `warmup` compiles it ahead)."""
        if self._fill_program is None:
            self._fill_program = fill_window_slot.lower(self.window, *self._window_fill_args(0, 0)).compile()
        return self._fill_program

    def _token_sources(self, plan: StepPlan, tokens: np.ndarray) -> np.ndarray:
        """token_src [T]: for each token that is a PENDING output (its row's last: a decode row's
        input sampled by the step in flight), that step's row of it; -1 for tokens on the host."""
        token_src = np.full(len(tokens), -1, np.int32)
        pending = np.flatnonzero(tokens == PENDING)
        if len(pending):
            rows = {row.seq.seq_id: r for r, row in enumerate(self._in_flight.step.plan.rows) if row.sample}
            ends = np.cumsum([row.count for row in plan.rows]) - 1
            owner = np.searchsorted(ends, pending)  # the row of each pending token
            token_src[pending] = [rows[plan.rows[r].seq.seq_id] for r in owner]
        return token_src

    @staticmethod
    def _segments(config: EngineConfig, fixed: int) -> tuple[int, int]:
        """(segments of a step's LoRA plan, the scheduler's `max_prefill_adapters`): every adapter
        that can be on the device (+ the base model and `fixed` compressed ones) and no bound; a
        backend with a segment window (hybrid) plans that many segments and the scheduler keeps
        a step's prompt chunks to that many adapters."""
        segments = bucket(config.max_adapters_on_device + 1 + fixed, 4)
        window = config.backend.segment_window
        if window is None or window >= segments:
            return segments, 0
        return window, window

    def _lora_plan(self, token_slot: np.ndarray, one_token: np.ndarray, decode_only: bool):
        """The step's LoRA plan over its tokens [T] (in `serving_order` of the rows): a `ServingPlan`
        for the backends that take one (without segments when `decode_only`: the BGMV-only
        variant; a mixed one lists its one-token rows when the step has more tokens than rows, so
        BGMV runs over `max_rows` rows, not T), else a `LoraPlan`. one_token [T]: the token is its
        row's only one."""
        if self.config.backend.plan_type is not ServingPlan:
            return build_plan(token_slot, self._num_segments)
        bgmv_rows = self.max_rows if self.max_rows < token_slot.size else None
        return build_serving_plan(token_slot, one_token, 0 if decode_only else self._num_segments, bgmv_rows)

    def _table_width(self, pages: int) -> int:
        """Block-table width of a step whose longest row spans `pages` pages. On a GPU/TPU the
        attention kernel reads only each row's own pages, so one width (the longest context's)
        serves every step and compiles once; the CPU reference gathers the whole table per token,
        so there widths are powers of two (>= 4)."""
        if jax.default_backend() in ("gpu", "tpu"):
            return self._max_pages
        return min(bucket(pages, 4), self._max_pages)

    def _batch_arrays(self, plan: StepPlan, in_window: bool = False, scoring: bool = False):
        """(PagedBatch, token_slot [T], one_token [T]) of the step's rows in their order (a window
        step: any token bucket; a scoring step: at least the smallest bucket of scanned layers)."""
        num_tokens = bucket(plan.num_tokens, self._min_tokens) if in_window else self._padded_tokens(plan)
        widest = max(pages_for(row.start + row.count, self.config.page_size) for row in plan.rows)
        width = self._table_width(widest)
        if scoring:  # a scoring step: a scanned program (fast to compile)
            num_tokens = max(num_tokens, min(bucket(self.programs.scan_from_tokens, self._min_tokens),
                                             bucket(self.config.token_budget, self._min_tokens)))
        else:
            num_tokens = self._compiled_tokens(num_tokens, width, plan, in_window)
        rows = self._rows(num_tokens)  # a function of the tokens bucket: no variants of its own
        if len(plan.rows) > rows:
            raise ValueError(f"a step of this engine has at most {rows} rows ({num_tokens} tokens, max_num_seqs "
                             f"{self.config.max_num_seqs}); the plan has {len(plan.rows)}")
        tokens = np.zeros(num_tokens, np.int32)
        positions = np.zeros(num_tokens, np.int32)
        token_row = np.full(num_tokens, -1, np.int32)
        token_slot = np.full(num_tokens, -1, np.int32)
        one_token = np.zeros(num_tokens, bool)
        tables = np.zeros((rows, width), np.int32)
        logit_indices = np.zeros(rows, np.int32)
        offset = 0
        for r, row in enumerate(plan.rows):
            span = slice(offset, offset + row.count)
            tokens[span] = _row_tokens(row.seq, row.start, row.count)
            positions[span] = np.arange(row.start, row.start + row.count)
            token_row[span], token_slot[span], one_token[span] = r, row.slot, row.count == 1
            pages = row.seq.pages[:width]
            tables[r, : len(pages)] = pages
            offset += row.count
            logit_indices[r] = offset - 1
        return PagedBatch(tokens, positions, token_row, tables, logit_indices), token_slot, one_token

    def _complete(self, step: Step, next_tokens: np.ndarray, seconds: float, logprobs: tuple | None = None,
                  features: np.ndarray | None = None, scores: tuple | None = None) -> None:
        """Hands a step's sampled tokens (row r's at r) to the scheduler and its events to the
        requests; logprobs: the step's (chosen [R], top values [R, K], top ids [R, K]) or None;
        features: the rows' features [R, d] (read when a classification's prompt ends here)."""
        plan = step.plan
        if scores is not None:
            self._collect_scores(plan, scores)
        sampled = {row.seq.seq_id: int(next_tokens[r]) for r, row in enumerate(plan.rows) if row.sample}
        row_of = {row.seq.seq_id: r for r, row in enumerate(plan.rows) if row.sample}
        events = self.scheduler.complete(plan, sampled)
        classified = 0 if features is None else sum(self._requests[seq.seq_id].head is not None for seq, *_ in events)
        self.stats.record_step(step.kind, plan.num_tokens, len(events) - classified, seconds)  # tokens delivered
        if self.modes is not None:
            self.modes.observe(self, plan, seconds)  # the step's cost, for the "auto" policy
        for seq, token, reason in events:
            request = self._requests[seq.seq_id]
            if reason is not None:
                del self._requests[seq.seq_id]
            if request.head is not None:
                self._deliver(request, _classified(request.head, features, row_of[seq.seq_id]))
                continue
            prompt_logprobs = None
            if self._scoring and _prompt_k(seq) is not None and request.scored_to >= 0:
                prompt_logprobs, request.prompt_entries, request.scored_to = request.prompt_entries, [], -1
                self._scoring -= 1
            self._deliver(request, Event(token, reason, logprobs=_row_logprobs(logprobs, row_of[seq.seq_id], seq),
                                         prompt_logprobs=prompt_logprobs))

    def _collect_scores(self, plan: StepPlan, scores: tuple) -> None:
        """Appends a scoring step's prompt log-probabilities to its rows' requests (once per prompt
        position: a recomputed chunk adds nothing): (target log-prob [T], top values [T, K], ids [T, K])."""
        chosen, values, ids = scores
        offset = 0
        for row in plan.rows:
            request = self._requests.get(row.seq.seq_id)
            k = _prompt_k(row.seq)
            if request is not None and k is not None and request.scored_to >= 0:
                prompt = row.seq.prompt
                for t in range(offset, offset + row.count):
                    target = row.start + (t - offset) + 1
                    if target == request.scored_to and target < len(prompt):
                        top = [(int(i), float(v)) for i, v in zip(ids[t, :k], values[t, :k])]
                        request.prompt_entries.append((prompt[target], float(chosen[t]), top))
                        request.scored_to += 1
            offset += row.count

    def _deliver(self, request: _Request, event: Event) -> None:
        try:
            request.callback(event)
        except Exception:
            log.exception("request callback failed")

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
        for seq in list(self.scheduler.running):
            self.scheduler.finish(seq, "error")
            request = self._requests.pop(seq.seq_id, None)
            if request is not None:
                self._deliver(request, Event(None, "error", message))
        self.scheduler.clear_prefix_cache()  # the failed step's writes are unknown
        if self.cache.k.is_deleted():
            self.cache = self._new_cache()

    def _want_adapters(self) -> None:
        """Tells the store which adapters the queued requests need (queue order, those not on the
        device: it starts their disk reads) and ends the queued requests whose adapter failed to
        read (finish reason "adapter_error", the read's message)."""
        slots, store = self.scheduler.slots, self.adapters
        wanted = [seq.adapter for seq in self.scheduler.waiting
                  if seq.adapter is not None and slots.slot_of(seq.adapter) is None]
        store.want(wanted)
        errors = {uid: error for uid in set(wanted) if (error := store.error(uid)) is not None}
        for seq in [seq for seq in self.scheduler.waiting if seq.adapter in errors] if errors else ():
            self.scheduler.finish(seq, "adapter_error")
            request = self._requests.pop(seq.seq_id, None)
            if request is not None:
                self._deliver(request, Event(None, "adapter_error", errors[seq.adapter]))

    def _adapter_ready(self, uid) -> bool:
        """The scheduler's `is_ready`: whether `uid` is on the host; if so its host copy is kept for
        this step (`_host_copy`), so a reader thread evicting it meanwhile cannot take it away
        between admission and the copy to the device."""
        prepared = self.adapters.host(uid)
        if prepared is not None:
            self._host_copies[uid] = prepared
        return prepared is not None

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

    def _host_copy(self, uid) -> PreparedAdapter:
        """The host copy of an adapter the scheduler placed this step (admitted or prefetched only
        when `_adapter_ready`)."""
        prepared = self._host_copies.get(uid) or self.adapters.host(uid)
        if prepared is None:
            raise RuntimeError(f"adapter uid {uid} was placed in a device slot but is not on the host")
        return prepared

    def _load(self, loads) -> None:
        """Copies the adapters of `loads` [(slot, uid)] into their slots now (synchronously)."""
        for slot, uid in loads:
            self.copies.drop(slot)
            started = time.perf_counter()
            self.pool.load(self._host_copy(uid), slot=slot)
            self.stats.record_device_load(time.perf_counter() - started)

    def _stage(self, loads) -> None:
        """Prefetch: starts the host -> device copies of the adapters of `loads` [(slot, uid)]
        (`serve.adapter_copies`); `_commit_staged` writes them into their slots. Without
        `background_prefetch` (a CPU backend, or a mesh: the placed pool's slot update splits the
        host arrays itself): `_load`."""
        if not self.background_prefetch:
            self._load(loads)
            return
        self.copies.stage(loads, self._host_copy)

    def _commit_staged(self, needed) -> None:
        """Writes prefetched adapters into their slots: those copied, and those of the slots in
        `needed` (the step's rows use them); see `StagedCopies.commit`."""
        self.copies.commit(needed)

    def _drop_removed_adapters(self) -> None:
        """Frees the slots and host copies of removed adapters that no request still uses."""
        removed = self.adapters.removed()
        if not removed:
            return
        in_use = {s.adapter for s in self.scheduler.running + self.scheduler.waiting}
        for entry in removed:
            if entry.uid in in_use or self.scheduler.slots.pinned(entry.uid):  # pinned: an unfinished step reads it
                continue
            slot = self.scheduler.drop_adapter(entry.uid)
            if slot is not None:
                self.copies.drop(slot)
                self.pool.evict(slot)
            self.adapters.drop(entry.uid)

    # ---- thread ---------------------------------------------------------------------------
    def start(self) -> None:
        """Runs steps in a daemon thread until `stop()`."""
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="jaxlora-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
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
                busy = self.step()
                busy = self.train_step() or busy
            except Exception:
                log.exception("engine loop error")
                busy = False
            if not busy:
                self._wake.wait(0.05)

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

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        """Steps in the calling thread until no request is left (tests, offline use)."""
        for _ in range(max_steps):
            if not self.step() and not self._commands:
                return
        raise RuntimeError(f"still busy after {max_steps} steps")

    # ---- introspection ----------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return self.scheduler.pages.num_free

    def slot_adapters(self) -> list[str | None]:
        """The name of the adapter in each device pool slot (None: free), as the scheduler last
        placed them (read without stopping the engine; may be one step stale)."""
        entries = [None if key is None else self.adapters.by_uid(key) for key in list(self.scheduler.slots.keys)]
        return [None if entry is None else entry.name for entry in entries]

    def snapshot(self) -> dict:
        """Counts for /metrics and /health (read without locking; values may be one step stale)."""
        scheduler = self.scheduler
        return {
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting) + self._num_waiting_submitted,
            "adapters_on_device": len(scheduler.slots.resident()),
            "adapters_known": len(self.adapters.names()),
            "adapters_on_host": self.adapters.on_host_count(),
            "adapters_on_disk": self.adapters.disk_count(),
            "host_adapter_bytes": self.adapters.cached_bytes(),
            "free_pages": scheduler.pages.num_free,
            "pages": scheduler.page_split(),
            "adapter_rows": {"used": getattr(scheduler.pages, "adapter_rows_used", 0),
                             "total": getattr(self.pool, "num_rows", 0)},  # unified paging's device rows
            "total_pages": self.config.num_pages,
            "tokens_per_second": self.stats.tokens_per_second(),
            "dropped_overloaded": self.stats.dropped,
            "max_num_seqs": self.config.max_num_seqs,
            "page_size": self.config.page_size,
            "reserve_output_kv": self.config.reserve_output_kv,
            "waiting_pages": sum(scheduler.pages_needed(seq) for seq in list(scheduler.waiting)),
            "prefix_cache": self.stats.prefix_cache(),
            **({} if self.modes is None else self.modes.snapshot()),
        }


def _row_logprobs(logprobs: tuple | None, row: int, seq: Sequence) -> tuple | None:
    """Row `row`'s (log-probability, [(id, log-probability)] of the top `logprobs`) of a step's
    log-probability arrays, None if the sequence asks for none."""
    wanted = seq.sampling.logprobs
    if wanted is None or logprobs is None:
        return None
    chosen, top_values, top_ids = logprobs
    return float(chosen[row]), [(int(i), float(v)) for i, v in zip(top_ids[row, :wanted], top_values[row, :wanted])]


def _classified(head: TaskHead, features: np.ndarray | None, row: int) -> Event:
    """The event of a classification whose prompt ended in row `row` of a step with `features`."""
    if features is None:
        return Event(None, "error", "this engine's step function returns no features to classify")
    return Event(None, "classified", probs=head.probs(features[row][None])[0])


def _progress_log(started: float) -> Callable[[str], Callable[[int, int], None]]:
    """`Programs.compile_all`'s progress callbacks by program name: one log line per compiled program."""
    return lambda program: lambda done, total: log.info("compiled %s program %d/%d (%.1f s)", program, done, total,
                                                        time.perf_counter() - started)




class TrainingSource(Protocol):
    """Training work the engine runs in the steps serving leaves idle (`serve.finetune`)."""

    def next_item(self) -> WorkItem | None:
        """The next training step's work, None when there is none ready (must not block)."""

    def run_next(self) -> None:
        """Runs that step (errors are the source's to report: they must not stop serving)."""
