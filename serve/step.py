"""The serving engine's compiled step programs: their shapes, their inputs, and the table of executables.

One engine step runs one or two programs on the device:
  - "forward": the model over the step's padded tokens (`jaxlora.models.paged.paged_hidden`),
    writing their keys/values into the donated KV cache; returns the greedy token of every row,
    the rows' logits and their features (the final norm's output, what a task head reads:
    `jaxlora.lora.head`; read back only by a step with a classification row). A token whose input is the previous step's sampled token (async
    scheduling: not on the host yet) takes it on the device: `token_src[t] >= 0` picks
    `prev_tokens[token_src[t]]` instead of `batch.tokens[t]`.
  - "sample": the tokens of a step where some row samples (temperature > 0), from the forward's
    logits (temperature, top-p, top-k, min-p per row: `RowSampling`). It is its own program so
    that sampling does not double every forward variant: it depends only on the number of rows.
  - "sample_state": "sample" for a step where some row has a logit bias, a penalty, min_tokens
    or asks for log-probabilities: it also reads the rows' state kept on the device
    (`SamplerState`, one slot per sequence: prompt tokens, output token counts, bias, stop
    tokens; `serve.sampler_state`), adds the drawn tokens to the counts (donated, in place), and
    returns the log-probabilities. Steps without such rows never run it: the default step pays
    nothing for it.
  - "sample_masked", "sample_state_masked": "sample" and "sample_state" for a step where a row
    follows a grammar (structured outputs, `serve.structured`): they also take a token bitmask
    [R, ceil(V / 32)] int32 (rows without a grammar: every bit set) that puts the forbidden tokens
    at -inf before anything else (`jaxlora.sampling.mask_logits`; log-probabilities stay those of
    the raw logits). The host computes it while the step's forward runs (`Step.masks`).
All return the sampled tokens padded to `max_rows` (the most rows a step can have), so the next
step's forward takes them whatever its own shape: a forward variant is keyed by its shape alone.

`StepShape` names a program variant; `Programs` compiles each variant once (ahead of time, through
`jax.jit(...).lower(...).compile()`, so warm-up can compile many in threads) and keeps the
executables; JAX caches lowering and compilation per function and argument types, so a second
engine over the same model and sizes finds its programs compiled already.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlora.lora.backends import LoraBackend
from jaxlora.models.llama import LoraInputs
from jaxlora.models.paged import PagedBatch, PagedKVCache, paged_hidden
from jaxlora.sampling import (
    MAX_LOGPROBS, apply_penalties, bias_rows, greedy_rows, mask_logits, row_keys, sample_rows, token_logprobs,
)
from jaxlora.scheduler.serving import StepPlan


SAMPLERS = ("sample", "sample_state", "sample_masked", "sample_state_masked")  # the sampler programs
# XLA options of a stand-in's compile on a GPU (`Programs`): GEMMs on cuBLAS, not Triton fusions, and
# the layer loop inside XLA's command buffers (CUDA graphs): XLA's default list (jax 0.11/0.12) plus WHILE
# and CONDITIONAL. Outside a command buffer the scan's cuBLAS calls on in-place weight slices
# (dynamic-slice fusions) wait for the device each layer, so the step's call returned only when the
# device was done: 12.3 ms for a decode32 call against 4.0 ms with the loop captured (H100, 2026-11-28,
# bench/dispatch_probe.py)
STAND_IN_COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
STAND_IN_GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_command_buffer": STAND_IN_COMMAND_BUFFERS}


def _backend() -> str:
    """The platform programs compile for (a function: tests stand in a GPU)."""
    return jax.default_backend()


class StepShape(NamedTuple):
    """A compiled program variant of the serving step.

    program "forward": the model over `tokens` padded tokens in `rows` padded rows with a block
    table `width` pages wide; `lora`: with LoRA inputs (False: every row on the base model);
    `decode_only`: a `ServingPlan` without prefill segments (a serving-plan backend's BGMV-only
    step); `window`: a `WindowPlan` (every adapter of the step in the adapter window: no LoRA
    kernel); `score`: also the log-probabilities of each token's target (the next prompt token)
    and the top MAX_LOGPROBS at every token (prompt log-probabilities). program "sample" or
    "sample_state": sampling over `rows` rows' logits (tokens, width 0; lora, decode_only, window,
    score False).
    """

    program: str
    tokens: int
    rows: int
    width: int = 0
    lora: bool = False
    decode_only: bool = False
    window: bool = False
    score: bool = False
    images: int = 0  # image rows (a power of two; 0: no image tokens, the text-only program)


class Step(NamedTuple):
    """One step's padded inputs, ready to run (`Engine.build_step`).

    plan: the step's rows in the order they are laid out (row r of the batch is plan.rows[r]).
    shapes: the programs it runs (the forward, then the sampler when `sampling` is set).
    kind: "base" or "lora" (LoRA inputs or not), then "decode" (one-token rows only) or "mixed".
    batch: tokens, positions, rows and block tables [T] / [R, P] (host arrays).
    lora: the adapter pool and the step's LoRA plan, None when every row uses the base model.
    prev_tokens [max_rows]: the sampled tokens of the step before (device array or zeros).
    token_src [T] int32: row of `prev_tokens` that is token t's input, -1: `batch.tokens[t]`.
    sampling: the sampler's inputs, None when every row takes the forward's greedy token:
    (`RowSampling`,) for "sample", (`RowSampling`, `RowState`) for "sample_state".
    score_targets [T] int32: the token whose log-probability each token's logits give (the next
    prompt token of a row that asks for prompt log-probabilities, -1: none); None: no scoring.
    masks: for a "*_masked" sampler, a callable returning the rows' token bitmask [R, W] int32,
    called once the step's forward is dispatched (`serve.structured.GrammarRows.masks`); else None.
    image_rows: (rows [M, d] device array, index [T] int32: token t's row, -1 text) of a step whose
    prefill chunks hold image tokens (`serve.vision`); None: none.
    """

    plan: StepPlan
    shapes: tuple[StepShape, ...]
    kind: str
    batch: PagedBatch
    lora: LoraInputs | None
    prev_tokens: jax.Array | np.ndarray
    token_src: np.ndarray
    sampling: tuple | None
    score_targets: np.ndarray | None = None
    masks: Callable[[], np.ndarray] | None = None
    image_rows: tuple | None = None


class RowSampling(NamedTuple):
    """Per-row sampler inputs [R] each: temperature, top_p, min_p float32; top_k int32 (0: off);
    seeds uint32 and counters int32 (the row's key: `row_keys`)."""

    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    min_p: np.ndarray
    seeds: np.ndarray
    counters: np.ndarray

    @staticmethod
    def greedy(rows: int) -> "RowSampling":
        """Inputs of `rows` greedy rows without filters (padding)."""
        return RowSampling(np.zeros(rows, np.float32), np.ones(rows, np.float32), np.zeros(rows, np.int32),
                           np.zeros(rows, np.float32), np.zeros(rows, np.uint32), np.zeros(rows, np.int32))


class RowState(NamedTuple):
    """Per-row inputs [R] each of "sample_state": slot, the row's `SamplerState` slot (S: none, the
    row's logits are not changed); count_slot, the slot whose output counts get the drawn token
    (S: none; rows that do not sample a token of their sequence); presence, frequency, repetition
    penalties float32; suppress_stop bool (the stop tokens are banned: under min_tokens)."""

    slot: np.ndarray
    count_slot: np.ndarray
    presence: np.ndarray
    frequency: np.ndarray
    repetition: np.ndarray
    suppress_stop: np.ndarray

    @staticmethod
    def empty(rows: int, num_slots: int) -> "RowState":
        """Inputs of `rows` rows without state (padding)."""
        none = np.full(rows, num_slots, np.int32)
        return RowState(none, none.copy(), np.zeros(rows, np.float32), np.zeros(rows, np.float32),
                        np.ones(rows, np.float32), np.zeros(rows, bool))


class SamplerState(NamedTuple):
    """The device state of sequences whose logits change with their history, one slot per
    sequence, [S, V] each: prompt_seen bool (the token is in the prompt), output_counts int32
    (its occurrences in the output), bias float32 (logit bias), stop_mask bool (the tokens that
    end the sequence, banned while under min_tokens)."""

    prompt_seen: jax.Array
    output_counts: jax.Array
    bias: jax.Array
    stop_mask: jax.Array


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(5,))
def _forward(graphdef, backend: LoraBackend, max_rows: int, unroll: bool, state, cache: PagedKVCache, batch: PagedBatch,
             lora, prev_tokens, token_src, score_targets=None, image_rows=None):
    """(greedy tokens [max_rows] int32, logits [R, V] float32, the updated cache, features [R, d]
    float32, scores) of one step; unroll: the layers unrolled (False: one scan body). With
    score_targets [T] (a "score" program): scores = (log-probability of each token's target [T]
    (0 where the target is -1), the MAX_LOGPROBS largest [T, K], their ids [T, K]); else None."""
    tokens = jnp.where(token_src >= 0, prev_tokens[jnp.maximum(token_src, 0)], batch.tokens)
    model = nnx.merge(graphdef, state)
    batch = batch._replace(tokens=tokens)
    scoring = score_targets is not None
    hidden, cache = paged_hidden(model, batch, cache, lora, backend, unroll_layers=unroll, every_token=scoring,
                                 image_rows=image_rows)
    logits, scores = model.unembed(hidden), None
    if scoring:  # every token's logits: the rows' are among them
        scores = token_logprobs(logits, jnp.maximum(score_targets, 0), MAX_LOGPROBS)
        hidden, logits = hidden[batch.logit_indices], logits[batch.logit_indices]
    return (_pad_rows(greedy_rows(logits), max_rows), logits, cache, model.final_hidden(hidden).astype(jnp.float32),
            scores)


@functools.partial(jax.jit, static_argnums=(0,))
def _sample(max_rows: int, logits, rows: RowSampling, mask=None):
    """Sampled tokens [max_rows] int32 of the rows' logits [R, V]: `jaxlora.sampling.sample_rows`
    with row r's key from (seeds[r], counters[r]) (`row_keys`); mask [R, W] int32: the tokens
    each row may draw (`mask_logits`), None: all."""
    if mask is not None:
        logits = mask_logits(logits, mask)
    return _pad_rows(_draw(logits, rows), max_rows)


def _draw(logits, rows: RowSampling):
    keys = row_keys(rows.seeds, rows.counters)
    return sample_rows(logits, rows.temperature, rows.top_p, keys, rows.top_k, rows.min_p)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _sample_state(max_rows: int, logits, state: SamplerState, rows: RowSampling, row_state: RowState, mask=None):
    """"sample" over logits [R, V] changed first by each row's token mask (as `_sample`), its
    slot's bias and (under min_tokens) banned stop tokens, then its penalties (`jaxlora.sampling`). Returns (tokens
    [max_rows] int32, (log-probability of each row's token [R], the MAX_LOGPROBS largest [R, K],
    their ids [R, K]) of the raw logits, the state with the drawn tokens counted)."""
    slot = row_state.slot

    def gather(table):
        return table.at[slot].get(mode="fill", fill_value=0)

    allowed = logits if mask is None else mask_logits(logits, mask)
    changed = bias_rows(allowed, gather(state.bias), gather(state.stop_mask), row_state.suppress_stop)
    changed = apply_penalties(changed, gather(state.prompt_seen), gather(state.output_counts),
                              row_state.presence, row_state.frequency, row_state.repetition)
    tokens = _draw(changed, rows)
    counts = state.output_counts.at[row_state.count_slot, tokens].add(1, mode="drop")
    logprobs = token_logprobs(logits, tokens, MAX_LOGPROBS)
    return _pad_rows(tokens, max_rows), logprobs, state._replace(output_counts=counts)


def _pad_rows(tokens: jax.Array, max_rows: int) -> jax.Array:
    return jnp.pad(tokens, (0, max_rows - tokens.shape[0]))


# The jitted function of each program by name (a sampler's masked variant is the same function with
# a mask): `Programs`, and the compile worker's child (`serve.compile_worker`), which finds it by name.
PROGRAMS = {"forward": _forward, "sample": _sample, "sample_state": _sample_state}


class Programs:
    """The compiled forward and sampler programs of one engine, by `StepShape`.

    A forward over fewer than `scan_from_tokens` tokens has its layers unrolled: each layer's
    weights are static slices of the stacked arrays that feed the GEMMs in place, which a decode
    step's memory-bound GEMMs need (a scan copies every layer's weights out of the stack: 2x a
    decode step on an H200). From `scan_from_tokens` up the layers are one scan body: XLA's GEMM
    autotuning, most of a program's compile, then tunes one layer instead of 32 (each unrolled
    layer's fusions differ by their slice), 5-10x faster to compile at the same step time
    (bench/NOTES_serve.md, issue 35).

    A program below `scan_from_tokens` may be compiled scanned as a stand-in (`compile(...,
    scan=True)`: the engine's start-up, so the server is ready sooner); it serves its steps until the
    unrolled program replaces it (`stand_ins()`: what a background compile still owes). On a GPU a
    stand-in's GEMMs are cuBLAS calls (`STAND_IN_GPU_OPTIONS`), which read each layer's weights in
    the stack in place, where XLA's Triton GEMMs need them copied out first: the scanned 8B decode32
    step 8.4 ms instead of 18.9 (unrolled 7.0; H100, 2026-11-28, bench/NOTES_serve.md); and its layer
    loop runs as one command buffer, so its call returns before the device is done (without, the
    host waited for every layer: no next step was built while one ran)."""

    def __init__(self, graphdef, backend: LoraBackend, max_rows: int, scan_from_tokens: int = 1,
                 layers_split: bool = False):
        self._static = {name: (PROGRAMS[name.removesuffix("_masked")], (max_rows,)) for name in SAMPLERS}
        self._static["forward"] = (_forward, (graphdef, backend, max_rows))
        # split layers (`EngineConfig.split_layers`): every forward unrolled over per-layer arrays, none
        # scanned and no stand-ins
        self.layers_split = layers_split
        self.scan_from_tokens = 1 << 30 if layers_split else scan_from_tokens
        self._compiled: dict[StepShape, Callable] = {}
        self._stand_ins: set[StepShape] = set()
        self._lock = threading.Lock()
        # seconds summed over threads: tracing and lowering (Python), XLA's compile or a cache's load
        self.lower_s = self.compile_s = 0.0
        self.store = None  # a `serve.executables.ExecutableStore`: compiled programs kept on disk

    def __len__(self) -> int:
        return len(self._compiled)

    def __contains__(self, shape: StepShape) -> bool:
        return shape in self._compiled

    def shapes(self) -> list[StepShape]:
        """The shapes compiled so far."""
        return list(self._compiled)

    def stand_ins(self) -> list[StepShape]:
        """The shapes served by a scanned stand-in, their unrolled program not compiled yet."""
        return list(self._stand_ins)

    @staticmethod
    def compile_options(stand_in: bool) -> dict:
        """XLA options of a program's compile: `STAND_IN_GPU_OPTIONS` for a stand-in on a GPU
        (class doc), else none."""
        return dict(STAND_IN_GPU_OPTIONS) if stand_in and _backend() == "gpu" else {}

    def _scanned(self, shape: StepShape, scan: bool | None) -> bool:
        """Whether `shape`'s forward runs its layers as a scan: `scan`, or by its tokens (class doc);
        never with split layers."""
        if self.layers_split:
            return False
        return shape.tokens >= self.scan_from_tokens if scan is None else scan

    def run(self, shape: StepShape, *args):
        """Runs the program `shape` on `args` (its dynamic arguments), compiling it first if needed."""
        program = self._compiled.get(shape)
        if program is None:
            program = self.compile(shape, args)
        return program(*args)

    def _program(self, shape: StepShape, scan: bool | None) -> tuple[Callable, tuple]:
        """(the jitted function of `shape`, its static arguments)."""
        fn, static = self._static[shape.program]
        if shape.program == "forward":
            static = static + (not self._scanned(shape, scan),)
        return fn, static

    def lower(self, shape: StepShape, args: tuple, scan: bool | None = None):
        """The program `shape` lowered for `args` (arrays or `jax.ShapeDtypeStruct`s), not compiled;
        `scan`: a forward's layers as a scan (None: by its tokens, class doc)."""
        fn, static = self._program(shape, scan)
        return fn.lower(*static, *args)

    def compile(self, shape: StepShape, args: tuple, scan: bool | None = None, worker=None) -> Callable:
        """Compiles the program `shape` for `args` (arrays or `jax.ShapeDtypeStruct`s) and keeps it
        (a scanned forward below `scan_from_tokens`: as a stand-in, class doc); with a `store`, loads
        it from there instead when it holds it (no trace), else stores what it compiled. With a
        `worker` (`serve.compile_worker.CompileWorker`) the child process lowers and compiles it
        (in-process where it cannot)."""
        started = lowered_at = time.perf_counter()
        stand_in = shape.program == "forward" and self._scanned(shape, scan) and not self._scanned(shape, None)
        options = self.compile_options(stand_in)
        lowering_static = self._program(shape, scan)[1]
        static = lowering_static + ((tuple(sorted(options.items())),) if options else ())
        key = None if self.store is None else self.store.key(shape.program, static, args)
        program = None if key is None else self.store.load(key)
        if program is None:
            if worker is not None:
                program = worker.compile(shape.program.removesuffix("_masked"), lowering_static, args, options)
            if program is None:
                lowered = self.lower(shape, args, scan)
                lowered_at = time.perf_counter()
                program = lowered.compile(compiler_options=options or None)
            if key is not None:
                self.store.save(key, program)
        with self._lock:
            self.lower_s += lowered_at - started
            self.compile_s += time.perf_counter() - lowered_at
            self._compiled[shape] = program
            if stand_in:
                self._stand_ins.add(shape)
            else:
                self._stand_ins.discard(shape)
        return program

    def logits_sharding(self, rows: int):
        """The sharding of the logits of a compiled forward over `rows` rows (what the sampler over
        them is called with), None if no such forward is compiled."""
        for shape, program in list(self._compiled.items()):
            if shape.program == "forward" and shape.rows == rows:
                return program.output_shardings[1]
        return None

    def compile_all(self, shape_args: list[tuple[StepShape, tuple]], threads: int,
                    progress: Callable[[int, int], None] | None = None, scan: bool | None = None,
                    worker=None) -> None:
        """Compiles every (shape, args) pair not compiled yet (or, with `scan` None, served by a
        stand-in), `threads` at a time (`compile`'s `worker`: one at a time there); `progress(done,
        total)` after each (start-up logs)."""
        todo = [(shape, args) for shape, args in shape_args
                if shape not in self._compiled or (scan is None and shape in self._stand_ins)]
        done, lock = [0], threading.Lock()

        def compile_one(item) -> None:
            self.compile(*item, scan=scan, worker=worker)
            with lock:
                done[0] += 1
                if progress is not None:
                    progress(done[0], len(todo))

        if threads <= 1:
            for item in todo:
                compile_one(item)
            return
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jaxlora-compile") as pool:
            list(pool.map(compile_one, todo))
