"""The serving engine's configuration and the values it hands its callers: `EngineConfig` (sizes of
the device state and of one step, with its bounds and the platform defaults), the KV pages that fit
a device and the bytes of one page, the `Event` a request's callback receives, and the engine's
request errors. Kept apart from `serve.engine` (issue 40: rooms named for what they hold);
`serve.engine` re-exports them."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol

import numpy as np

from jaxlora.lora import backends
from jaxlora.nn.model_config import PROJECTIONS
from jaxlora.scheduler.core import WorkItem
from jaxlora.scheduler.serving import INFERENCE_MODES, SCHEDULE_POLICIES, CostPolicy, ModePolicy


class RequestError(ValueError):
    """A request the engine refuses (too long, bad sampling values); the message says why."""


class UnknownAdapter(KeyError):
    """No adapter of that name is registered."""


class EngineBusy(RuntimeError):
    """The waiting queue is full."""


class NoTaskHead(ValueError):
    """A classification names an adapter without a task head (`jaxlora.lora.head`)."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes of the device state and of one step (see the module doc).

    Left None, the step sizes follow the platform (`for_platform`), as vLLM sizes them on a GPU or
    TPU: up to 256 rows (max_num_seqs) and 2048 tokens (token_budget) per step, a prompt chunked
    by the whole budget (prefill_chunk); small on a CPU (32 rows, 128 tokens, 64-token chunks).
    num_pages None: as many KV pages as fit in `gpu_memory_utilization` of each device's memory
    after the weights and the adapter pool (the rest is the headroom of a step's activations);
    on a device that reports no memory (a CPU) 8 full contexts of max_model_len.
    """

    max_adapters_on_device: int = 4
    max_lora_rank: int = 16
    page_size: int = 16
    num_pages: int | None = None
    max_model_len: int = 2048
    max_num_seqs: int | None = None
    token_budget: int | None = None
    prefill_chunk: int | None = None
    max_waiting: int = 1024
    lora_backend: str = backends.DEFAULT  # a name (or a LoraBackend, kept as its name): the object is `backend`
    ttft_slo_s: float | None = None  # S-LoRA early abort: drop waiting requests that cannot meet it
    async_scheduling: bool = True  # launch step N+1 before reading step N's tokens (module doc)
    gpu_memory_utilization: float = 0.9  # fraction of device memory for weights, adapters and KV pages
    reserve_output_kv: bool = True  # admission reserves prompt + max_tokens pages; False: pages grow (module doc)
    # The smallest token bucket of any step, and of a LoRA step with a prefill row (its own program
    # variant: BGMV + segment kernels): smaller steps pad up to them. On a GPU/TPU a decode step of
    # 8 rows costs what one of 32 does (weight reads) and a LoRA program takes minutes to compile
    # for the 8B model, so fewer, larger buckets (bench/NOTES_serve.md); powers of two.
    min_step_tokens: int | None = None
    min_lora_mixed_tokens: int | None = None
    # Start-up (issue 35). Forwards over at least `scan_layers_from_tokens` tokens run their layers
    # as one scan body, compiled 5-10x faster at the same step time; smaller ones (decode steps and
    # the small mixed steps, whose GEMMs must read the weights in place) are unrolled
    # (`serve.step.Programs`). None: 512 on a GPU/TPU (256-token steps scanned cost S-LoRA's trace
    # 28% of its throughput on an H200: bench/NOTES_serve.md), 1 on a CPU (every program a scan).
    # `background_compile`: `warmup` compiles the programs that can serve any step (per variant the
    # largest token bucket and the smallest that holds a decode step of every row), scanned (fast),
    # the server turns ready, and the rest, with the unrolled programs of those below
    # `scan_layers_from_tokens`, compile on a background thread, smallest buckets first; until a
    # step's own bucket is compiled it runs in the smallest compiled larger one (a request never
    # waits on a compile). None: on a GPU/TPU, off on a CPU. `compile_worker`: the background compile
    # runs in a child process (`serve.compile_worker`: its lowering off the server's GIL, its CPU at a
    # lower priority), in-process wherever the child fails. None: on a GPU (a TPU opens to one process).
    scan_layers_from_tokens: int | None = None
    # `split_layers`: the engine holds each decoder layer's weights as arrays of their own
    # (`jaxlora.models.llama.split_layers`), every step program unrolled over them (no scans, no
    # stand-ins): the 32 layers' GEMM fusions are then equal and XLA autotunes them once, so an
    # unrolled decode program compiles ~5x faster (9.0 s against 45.5 s, H200, bench/NOTES_serve.md).
    # Opt-in until the serving trace is measured with it; unmerged inference, one device.
    split_layers: bool = False
    background_compile: bool | None = None
    compile_worker: bool | None = None
    # The adapter window (`jaxlora.models.packed.add_adapter_window`): a step whose rows use at most
    # this many adapters runs them as extra columns of the packed base GEMMs and one expand GEMM per
    # group, no LoRA kernel (bench/NOTES_serve.md). None: 8 on a GPU/TPU, 4 on a CPU; 0: off. Capped
    # by max_adapters_on_device; off with a mesh or a compressed collection. `window_mixed_adapters`:
    # a step with a prefill row uses the window only with at most this many adapters, more run the
    # kernels (its GEMMs are compute-bound at 2048 tokens, where window columns cost FLOPs); None: as
    # many as the window holds. A large window for decode steps, kernels for large mixed steps:
    # `bench/device_runs.sh window_probe` measures whether that pays (issue 34; not measured yet).
    adapter_window: int | None = None
    window_mixed_adapters: int | None = None
    # The disk and host tiers (serve.adapter_store): a directory of PEFT adapter folders served by
    # folder name, and the host cache's bounds (None: unbounded).
    adapter_dir: str | None = None
    max_host_adapter_bytes: int | None = None
    max_host_adapters: int | None = None
    # Unified paging (S-LoRA): KV pages and resident adapters' pages (own rank) in one budget, idle
    # adapters evicted when KV runs short (jaxlora.scheduler.serving.unified); on the device adapters
    # live in rows (jaxlora.lora.rows.RowPool: rank r takes r rows, the LoRA kernels read them through
    # a row table), `adapter_rows` of them (None: max_adapters_on_device * max_lora_rank, the padded
    # pool's bytes; fewer rows hold as many adapters of lower ranks). One device, unmerged mode only.
    unified_paging: bool = False
    adapter_rows: int | None = None
    # The projections adapters may target (None: all seven): the device pool holds A/B for these only
    # (with unified paging a row id takes a rank row in each of them).
    lora_target_modules: tuple[str, ...] | None = None
    # Inference modes (serve.modes, V-LoRA): "unmerged" (every adapter as LoRA), "merged" (one adapter's
    # ΔW folded into the base weights a step; the others wait), "mixed" (deLoRA: the most requested one
    # merged, the others beside it), "auto" (a policy picks one each step: `mode_policy`, a CostPolicy
    # (measured step costs) or a ModePolicy (V-LoRA's credits); None: CostPolicy(max_batch=max_num_seqs)).
    # Not "unmerged": a copy of the targeted base kernels is kept on the device; mixed and auto need the
    # adapter window to cover the pool.
    inference_mode: str = "unmerged"
    mode_policy: CostPolicy | ModePolicy | None = None
    # Host copies of adapters in the device's pinned (page-locked) memory, so a load is one DMA
    # (jaxlora.lora.pool: 84 MB in 2.1 ms instead of 18.4 ms on an H200). None: on a GPU without a
    # mesh; a CPU backend copies host memory either way.
    pinned_host_adapters: bool | None = None
    # A step's small inputs (tokens, positions, block tables, LoRA plan, previous tokens) copied into
    # device buffers that stay put, so XLA's CUDA graphs need no re-recording each step (serve.step_inputs:
    # a step's call 3 ms shorter in bench/dispatch_probe.py on an H200). Off by default: in the serving
    # guard's trace (H200, 2026-11-29 13:42, beside the default on the same machine) the engine's dispatch
    # did not fall and distinct / identical ran 3.4% / 2.6% slower (bench/NOTES_serve.md, "Eighteenth
    # session"); None: on a GPU without a mesh.
    stable_step_inputs: bool | None = False
    # Prefix caching (vLLM's automatic prefix caching; jaxlora.scheduler.serving.prefix): full KV blocks
    # reused by requests of the same adapter (uid) and inference-mode numerics with the same leading tokens.
    prefix_caching: bool = True
    # Adapter prefetch looks this many steps' token budgets down the waiting queue (the scheduler's
    # `prefetch`; 0: the whole queue). 2 spread the disk trace's first loads over later steps without a
    # throughput change on an H200 (bench/NOTES_serve.md, nineteenth session), so the default stays 0.
    prefetch_steps: int = 0
    # The waiting queue's order (jaxlora.scheduler.serving.policy's module doc): "fcfs", or "lof" (SGLang's
    # longest output first: the most max_tokens still to come first; a batch's makespan when requests wait
    # for adapter slots, at the cost of short requests' waiting).
    schedule_policy: str = "fcfs"

    # Bounds of the step sizes (each compiled program is as large as its step; tokens bound rows).
    BOUNDS = {"max_num_seqs": (1, 1024), "token_budget": (1, 65536), "prefill_chunk": (1, 65536)}
    ACCELERATOR_STEP = {"max_num_seqs": 256, "token_budget": 2048, "min_step_tokens": 32, "min_lora_mixed_tokens": 256,
                        "adapter_window": 8, "scan_layers_from_tokens": 512, "background_compile": True}
    CPU_STEP = {"max_num_seqs": 32, "token_budget": 128, "prefill_chunk": 64, "min_step_tokens": 8,
                "min_lora_mixed_tokens": 8, "adapter_window": 4, "scan_layers_from_tokens": 1,
                "background_compile": False}
    CPU_CONTEXTS = 8  # KV pages of a device without memory stats: this many full contexts

    def __post_init__(self):
        backend = backends.get(self.lora_backend, serves=True)  # ValueError naming the serving backends
        object.__setattr__(self, "lora_backend", backend.name)
        object.__setattr__(self, "backend", backend)  # resolved once; not a field (`asdict` gives the name)
        if self.ttft_slo_s is not None and not self.ttft_slo_s > 0:
            raise ValueError(f"ttft_slo_s must be > 0 (or None: off), got {self.ttft_slo_s}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name, (low, high) in self.BOUNDS.items():
            value = getattr(self, name)
            if value is not None and not low <= value <= high:
                raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
        if self.scan_layers_from_tokens is not None and self.scan_layers_from_tokens < 0:
            raise ValueError(f"scan_layers_from_tokens must be >= 0, got {self.scan_layers_from_tokens}")
        for name in ("min_step_tokens", "min_lora_mixed_tokens"):
            value = getattr(self, name)
            if value is not None and not (0 < value <= 65536 and value & (value - 1) == 0):
                raise ValueError(f"{name} must be a power of two in [1, 65536], got {value}")
        if self.adapter_window is not None and not 0 <= self.adapter_window <= 64:
            raise ValueError(f"adapter_window must be in [0, 64] (0: off), got {self.adapter_window}")
        if self.window_mixed_adapters is not None and self.window_mixed_adapters < 0:
            raise ValueError(f"window_mixed_adapters must be >= 0 (None: no bound), got {self.window_mixed_adapters}")
        if self.split_layers and self.inference_mode != "unmerged":
            raise ValueError(f"split_layers serves unmerged inference only, got inference_mode {self.inference_mode!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, "
                             f"got {self.schedule_policy!r}")
        if self.inference_mode not in INFERENCE_MODES:
            raise ValueError(f"inference_mode must be one of {', '.join(INFERENCE_MODES)}, got {self.inference_mode!r}")
        if self.lora_target_modules is not None and not set(self.lora_target_modules) <= set(PROJECTIONS):
            raise ValueError(f"lora_target_modules must be among {PROJECTIONS}, got {self.lora_target_modules}")
        if self.adapter_rows is not None and not (self.unified_paging and self.adapter_rows >= self.max_lora_rank):
            raise ValueError(f"adapter_rows needs unified_paging and >= max_lora_rank rows, got {self.adapter_rows}")
        if (self.unified_paging or self.lora_target_modules is not None) and self.inference_mode != "unmerged":
            raise ValueError("unified_paging and lora_target_modules serve the unmerged inference mode only (the "
                             "merged modes read the padded pool of every projection)")
        if self.num_pages is not None and self.max_model_len > self.num_pages * self.page_size:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the KV cache "
                             f"({self.num_pages} pages x {self.page_size} tokens)")

    def for_platform(self, platform: str) -> "EngineConfig":
        """This config with unset step sizes (None) filled for `platform` ("cpu", "gpu", "tpu"):
        small on a CPU; else up to 256 rows and 2048 tokens per step, prompts chunked by the budget,
        token buckets from 32 (256 for a LoRA step with prefill rows)."""
        defaults = self.CPU_STEP if platform == "cpu" else self.ACCELERATOR_STEP
        sizes = {name: defaults[name] for name in defaults if getattr(self, name) is None}
        config = dataclasses.replace(self, **sizes)
        if config.compile_worker is None:
            config = dataclasses.replace(config, compile_worker=platform == "gpu")
        if config.prefill_chunk is None:
            config = dataclasses.replace(config, prefill_chunk=config.token_budget)
        return config


def kv_pages_that_fit(memory_stats: list, utilization: float, page_bytes: int) -> int | None:
    """KV pages that fit on every device: min over devices of (utilization * bytes_limit -
    bytes_in_use) // page_bytes (page_bytes: one page's keys and values on one device); None if a
    device reports no memory (`Device.memory_stats()` None or without bytes_limit)."""
    if any(not stats or "bytes_limit" not in stats for stats in memory_stats):
        return None
    free = min(utilization * stats["bytes_limit"] - stats["bytes_in_use"] for stats in memory_stats)
    return max(0, int(free // page_bytes))


class Event(NamedTuple):
    """What a request's callback receives: a new token and/or a finish reason, or an error;
    logprobs (when its SamplingParams ask): (the token's log-probability, [(token id,
    log-probability)] of the `logprobs` most likely tokens, largest first)."""

    token: int | None
    finish_reason: str | None  # "stop" (EOS or a stop token), "length" (max_tokens), "abort", "error",
    # "overloaded" (dropped before its first token: it could not meet the TTFT objective)
    error: str | None = None
    logprobs: tuple | None = None
    probs: np.ndarray | None = None  # a classification's label probabilities [num_labels] (`Engine.classify`)
    # prompt log-probabilities (SamplingParams.prompt_logprobs), with a request's first event: one
    # (token id, log-probability, [(id, log-probability)] of the most likely) per prompt token after the first
    prompt_logprobs: list | None = None


def kv_page_bytes(model_config, page_size: int, dtype, tensor_parallel: int = 1) -> int:
    """Bytes of one KV page on one device: keys and values of `page_size` tokens, every layer, KV
    heads split over `tensor_parallel` devices."""
    return (2 * model_config.num_layers * page_size * model_config.num_kv_heads * model_config.head_dim
            * np.dtype(dtype).itemsize // tensor_parallel)


class TrainingSource(Protocol):
    """Training work the engine runs in the steps serving leaves idle (`serve.finetune`)."""

    def next_item(self) -> WorkItem | None:
        """The next training step's work, None when there is none ready (must not block)."""

    def run_next(self) -> None:
        """Runs that step (errors are the source's to report: they must not stop serving)."""
