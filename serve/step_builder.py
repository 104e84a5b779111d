"""Step assembly for the serving engine: a scheduled `StepPlan` -> a padded `Step` (rows, LoRA plan,
program choice), and the program variants a step can need.

Compiled shapes are bucketed: tokens per step to a power of two (>= 8), rows per step to the same
number capped at `max_rows` (the most rows a step can have), block-table width to the longest
context's on a GPU/TPU (the attention kernel reads only each row's pages) or a power of two of
pages (>= 4) on a CPU, the plan's segment count fixed; sampling is a program of its own keyed by rows.
`StepBuilder.step_shapes()` lists every program variant a step can need (`Engine.warmup` compiles
them all), and `first_shapes` the few that serve any step while the rest compile in the background.

LoRA kernels (the backends that take a `ServingPlan`, `jaxlora.lora.backends`): the builder orders
each step's rows once, on the host (`jaxlora.lora.plan.serving_order`: prefill chunks grouped by
adapter, then one-token rows), and hands the model a `ServingPlan` over that order, so no
projection gathers rows into adapter order or scatters them back; one-token (decode) rows go
through BGMV, prefill chunks through SGMV. A step without multi-token rows (decode only, so at most
`max_num_seqs` tokens) runs BGMV alone: its own compiled variant of the buckets up to that size.
Sampled tokens map back to requests by row on the host. The other backends get the usual
`LoraPlan`. A step whose rows all use the base model runs the model without LoRA inputs (its own
compiled variant), and a step whose adapters all fit the adapter window (`serve.window`) runs
without a LoRA kernel.

`StepBuilder` holds no engine state: what changes from step to step (the previous step's tokens,
the step in flight, whether a request scores its prompt) comes in as arguments.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import contextlib
import os
import sys
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.buckets import bucket
from jaxlora.lora.plan import ServingPlan, build_plan, build_serving_plan, build_window_plan, serving_order
from jaxlora.models.llama import LoraInputs
from jaxlora.models.paged import PagedBatch, PagedKVCache
from jaxlora.scheduler.serving import PENDING, Sequence, StepPlan, pages_for

from serve.compile_worker import WorkerClosed
from serve.engine_config import EngineConfig
from serve.modes import EngineModes
from serve.requests import prompt_k
from serve.sampler_state import SamplerSlots, step_sampling
from serve.stats import EngineStats, _PhaseClock
from serve.step import SAMPLERS, Programs, RowSampling, RowState, Step, StepShape
from serve.structured import GrammarRows
from serve.window import WindowFill

log = logging.getLogger("jaxlora.serve")


def scores_prompt(row) -> bool:
    """Whether a step row's tokens give prompt log-probabilities (its request asks for them and the
    row covers a prompt position followed by another prompt token)."""
    return prompt_k(row.seq) is not None and row.start < len(row.seq.prompt) - 1


def score_targets(plan: StepPlan, num_tokens: int) -> np.ndarray:
    """[T] int32: each token's next prompt token in the rows that score their prompt, else -1."""
    targets = np.full(num_tokens, -1, np.int32)
    offset = 0
    for row in plan.rows:
        if scores_prompt(row):
            prompt = row.seq.prompt
            stop = min(row.start + row.count, len(prompt) - 1)
            targets[offset: offset + stop - row.start] = prompt[row.start + 1: stop + 1]
        offset += row.count
    return targets


def row_tokens(seq: Sequence, start: int, count: int) -> list[int]:
    """seq.tokens[start: start + count] without building prompt + output (a decode row's one token
    is the newest output)."""
    prompt_len = len(seq.prompt)
    if start >= prompt_len:
        return seq.output[start - prompt_len: start - prompt_len + count]
    if start + count <= prompt_len:
        return seq.prompt[start: start + count]
    return seq.prompt[start:] + seq.output[: start + count - prompt_len]


def segments(config: EngineConfig, fixed: int) -> tuple[int, int]:
    """(segments of a step's LoRA plan, the scheduler's `max_prefill_adapters`): every adapter
    that can be on the device (+ the base model and `fixed` compressed ones) and no bound; a
    backend with a segment window (hybrid) plans that many segments and the scheduler keeps
    a step's prompt chunks to that many adapters. With `tail_segments` (paged pools and a backend
    that plans one-token rows as segments) twice that: each adapter's prompt chunks and its one-
    token rows are a run of their own."""
    num_segments = bucket((1 + tail_segments(config)) * (config.max_adapters_on_device + 1 + fixed), 4)
    window = config.backend.segment_window
    if window is None or window >= num_segments:
        return num_segments, 0
    return window, window


def tail_segments(config: EngineConfig) -> bool:
    """Whether a mixed step's LoRA plan covers its one-token rows with segments
    (`jaxlora.lora.plan.build_serving_plan`): the backend does so over paged pools (unified paging)."""
    return config.unified_paging and config.backend.tail_segments


class StepBuilder:
    """Builds a step's padded inputs from its plan and chooses its programs (see the module doc).

    config: the engine's (sizes filled); max_rows: the most rows of a step; num_segments: of a
    step's LoRA plan (`segments`); lora_arrays() -> the LoRA arrays a step reads (read afresh each
    step: loads replace them); window: the adapter window's fill (None: no window); modes: the
    inference modes (None: unmerged only). `background`: `Engine.warmup`'s background compile
    thread, while a step pads to a compiled bucket (`compiled_tokens`)."""

    def __init__(self, config: EngineConfig, model_config, programs: Programs, lora_arrays: Callable[[], dict],
                 stats: EngineStats, grammars: GrammarRows, sampler_slots: SamplerSlots, eos_ids: frozenset,
                 window: WindowFill | None, modes: EngineModes | None, max_rows: int, num_segments: int):
        self.config = config
        self.model_config = model_config
        self.programs = programs
        self.lora_arrays = lora_arrays
        self.stats = stats
        self.grammars = grammars
        self.sampler_slots = sampler_slots
        self.eos_ids = eos_ids
        self.window = window
        self.modes = modes
        self.max_rows = max_rows
        self.num_segments = num_segments
        self.tail_segments = tail_segments(config)
        self.max_pages = bucket(pages_for(config.max_model_len, config.page_size), 1)
        self.min_tokens = config.min_step_tokens  # the smallest token bucket (`padded_tokens`)
        self.min_lora_mixed = min(bucket(config.min_lora_mixed_tokens, self.min_tokens),
                                  bucket(config.token_budget, self.min_tokens))
        self.background: threading.Thread | None = None  # `Engine.warmup`'s background compile
        self._decode_variant: bool | None = None  # `has_decode_variant`, once known
        self.image_dtype = jnp.float32  # the image rows' dtype (the model's; `serve.vision`)

    # ---- one step -----------------------------------------------------------------------------
    @staticmethod
    def order(plan: StepPlan) -> StepPlan:
        """`plan` with its rows in `serving_order` (prefill chunks grouped by adapter, then one-token rows)."""
        order = serving_order([row.slot for row in plan.rows], [row.count for row in plan.rows])
        return dataclasses.replace(plan, rows=[plan.rows[i] for i in order])

    def build(self, plan: StepPlan, phases: _PhaseClock, last_tokens, in_flight: Step | None, scoring: bool,
              delora: tuple | None, masks: Callable, image_rows: Callable[[int], tuple | None] | None = None
              ) -> Step:
        """The padded inputs of a step over `plan` (rows already in `order`). last_tokens
        [max_rows]: the previous step's sampled tokens; in_flight: the step launched before, whose
        tokens are not read yet (a PENDING input takes its sampled token on the device); scoring:
        the step computes prompt log-probabilities (no window: no scoring window variant); delora:
        a mixed step's -ΔW branch key (`EngineModes.delora_key`); masks(plan rows, rows, phases) ->
        [R, W] the token masks of a step with a row under a grammar (called once its forward runs);
        image_rows(padded tokens) -> the step's (image rows [M, d], index [T]) or None (`serve.vision`)."""
        in_window = None if scoring or self.window is None else self.window.place(
            sorted({row.slot for row in plan.rows if row.slot >= 0}), delora,
            prefill=any(row.count > 1 for row in plan.rows))
        decode_variant = self.decode_variant(plan)  # once a step: the background compile may finish meanwhile
        batch, token_slot, one_token = self.batch_arrays(plan, in_window is not None, scoring, decode_variant)
        targets = score_targets(plan, len(batch.tokens)) if scoring else None
        images = None if image_rows is None else image_rows(len(batch.tokens))
        phases.mark("batch")
        decode_only = bool(one_token[: plan.num_tokens].all())
        lora = self._lora_inputs(plan, batch, token_slot, one_token, decode_variant, in_window, delora)
        phases.mark("lora_plan")
        rows, width = batch.block_tables.shape
        forward = StepShape("forward", len(batch.tokens), rows, width, lora is not None,
                            isinstance(lora and lora.plan, ServingPlan) and lora.plan.seg_starts is None,
                            in_window is not None, scoring, 0 if images is None else int(images[0].shape[0]))
        masked = self.grammars.constrains(plan.rows)  # a row under a grammar: its masks when the forward runs
        sampler = step_sampling(plan.rows, rows, self.sampler_slots, self.eos_ids, masked)
        sampling = None if sampler is None else sampler[1]
        shapes = (forward,) if sampler is None else (forward, StepShape(sampler[0], 0, rows))
        phases.mark("sampling")
        kind = ("base " if lora is None else "window " if in_window is not None else "lora ") + (
            "decode" if decode_only else "mixed")
        return Step(plan, shapes, kind, batch, lora, last_tokens, self.token_sources(plan, batch.tokens, in_flight),
                    sampling, targets, functools.partial(masks, plan.rows, rows, phases) if masked else None, images)

    def _lora_inputs(self, plan: StepPlan, batch: PagedBatch, token_slot: np.ndarray, one_token: np.ndarray,
                     decode_only: bool, in_window: dict | None, delora: tuple | None) -> LoraInputs | None:
        """The step's LoRA inputs: a window plan when every adapter of the step is in the window
        ({pool slot: window slot} `in_window`), the pool and a kernel plan when a row uses an
        adapter, None for base rows only (the base model's own compiled step, no pool or plan)."""
        if in_window is not None:  # every adapter of the step in the window: no LoRA kernel
            token_extra = None
            if delora is not None:  # the branch's window slot for the tokens of the rows that add it
                rows = np.append(self.modes.branch_rows(plan), False)  # padding tokens (row -1): none
                token_extra = np.where(rows[batch.token_row], in_window.pop(delora[0]), -1)
            lookup = np.full(self.config.max_adapters_on_device + 1, -1, np.int32)
            lookup[list(in_window)] = list(in_window.values())
            layout = self.window.layout
            return LoraInputs({}, build_window_plan(lookup[token_slot], layout.slots, layout.rank, token_extra))
        if (token_slot >= 0).any():
            return LoraInputs(self.lora_arrays(), self.lora_plan(token_slot, one_token, decode_only))
        self.stats.base_only_steps += 1
        return None

    def token_sources(self, plan: StepPlan, tokens: np.ndarray, in_flight: Step | None) -> np.ndarray:
        """token_src [T]: for each token that is a PENDING output (its row's last: a decode row's
        input sampled by the step `in_flight`), that step's row of it; -1 for tokens on the host."""
        token_src = np.full(len(tokens), -1, np.int32)
        pending = np.flatnonzero(tokens == PENDING)
        if len(pending):
            rows = {row.seq.seq_id: r for r, row in enumerate(in_flight.plan.rows) if row.sample}
            ends = np.cumsum([row.count for row in plan.rows]) - 1
            owner = np.searchsorted(ends, pending)  # the row of each pending token
            token_src[pending] = [rows[plan.rows[r].seq.seq_id] for r in owner]
        return token_src

    def lora_plan(self, token_slot: np.ndarray, one_token: np.ndarray, decode_only: bool):
        """The step's LoRA plan over its tokens [T] (in `serving_order` of the rows): a `ServingPlan`
        for the backends that take one (without segments when `decode_only`: the BGMV-only
        variant; a mixed one lists its one-token rows when the step has more tokens than rows, so
        BGMV runs over `max_rows` rows, not T; over paged pools a mixed one covers the one-token rows
        with segments instead, `tail_segments`), else a `LoraPlan`. one_token [T]: the token is its
        row's only one."""
        if self.config.backend.plan_type is not ServingPlan:
            return build_plan(token_slot, self.num_segments)
        bgmv_rows = self.max_rows if self.max_rows < token_slot.size else None
        return build_serving_plan(token_slot, one_token, 0 if decode_only else self.num_segments, bgmv_rows,
                                  self.tail_segments)

    def batch_arrays(self, plan: StepPlan, in_window: bool = False, scoring: bool = False,
                     decode_variant: bool | None = None):
        """(PagedBatch, token_slot [T], one_token [T]) of the step's rows in their order (a window
        step: any token bucket; a scoring step: at least the smallest bucket of scanned layers;
        `decode_variant`: the step runs the decode-only LoRA variant, None: `decode_variant(plan)`)."""
        decode_variant = self.decode_variant(plan) if decode_variant is None else decode_variant
        num_tokens = bucket(plan.num_tokens, self.min_tokens) if in_window else self.padded_tokens(plan, decode_variant)
        width = self.plan_width(plan)
        if scoring:  # a scoring step: a scanned program (fast to compile)
            num_tokens = max(num_tokens, self.scoring_tokens())
        else:
            num_tokens = self.compiled_tokens(num_tokens, width, plan, in_window, decode_variant)
        rows = self.rows(num_tokens)  # a function of the tokens bucket: no variants of its own
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
            tokens[span] = row_tokens(row.seq, row.start, row.count)
            positions[span] = np.arange(row.start, row.start + row.count)
            token_row[span], token_slot[span], one_token[span] = r, row.slot, row.count == 1
            pages = row.seq.pages[:width]
            tables[r, : len(pages)] = pages
            offset += row.count
            logit_indices[r] = offset - 1
        return PagedBatch(tokens, positions, token_row, tables, logit_indices), token_slot, one_token

    # ---- buckets --------------------------------------------------------------------------------
    def rows(self, num_tokens: int) -> int:
        """Padded rows of a step of `num_tokens` padded tokens."""
        return min(num_tokens, self.max_rows)

    def table_width(self, pages: int) -> int:
        """Block-table width of a step whose longest row spans `pages` pages. On a GPU/TPU the
        attention kernel reads only each row's own pages, so one width (the longest context's)
        serves every step and compiles once; the CPU reference gathers the whole table per token,
        so there widths are powers of two (>= 4)."""
        if jax.default_backend() in ("gpu", "tpu"):
            return self.max_pages
        return min(bucket(pages, 4), self.max_pages)

    def has_decode_variant(self) -> bool:
        """Whether the backend's plan has a decode-only variant (a segment-free `ServingPlan`)."""
        if self._decode_variant is None:
            plan = self.lora_plan(np.full(8, -1, np.int32), np.ones(8, bool), True)
            self._decode_variant = isinstance(plan, ServingPlan) and plan.seg_starts is None
        return self._decode_variant

    def has_bucket(self, tokens: int, lora: bool, decode_only: bool) -> bool:
        """Whether a forward variant over `tokens` padded tokens exists (see `padded_tokens`)."""
        if decode_only:
            return tokens <= bucket(self.max_rows, self.min_tokens)
        # the mixed minimum applies where decode steps have a variant of their own
        return not lora or not self.has_decode_variant() or tokens >= self.min_lora_mixed

    def plan_width(self, plan: StepPlan) -> int:
        """The block-table width of a step over `plan` (`table_width` of its longest row)."""
        return self.table_width(max(pages_for(row.start + row.count, self.config.page_size) for row in plan.rows))

    def decode_variant(self, plan: StepPlan) -> bool:
        """Whether a step over `plan` runs the decode-only LoRA variant (when it has LoRA rows): its
        rows are one token each, the backend's plan has the variant, and while the background compile
        runs one of the variant's programs that holds the step is compiled (with split layers the
        variant is left to the background, `first_shapes`: meanwhile such a step runs the mixed LoRA
        variant, the same tokens)."""
        if not (self.has_decode_variant() and all(row.count == 1 for row in plan.rows)):
            return False
        if self.background is None or not self.background.is_alive():
            return True
        tokens, width = bucket(plan.num_tokens, self.min_tokens), self.plan_width(plan)
        return any(s.program == "forward" and s.decode_only and not s.window and s.width == width and s.tokens >= tokens
                   and self._samplers_ready(s.rows) for s in self.programs.shapes())

    def _samplers_ready(self, rows: int) -> bool:
        """Whether the samplers of `rows` rows are compiled."""
        return StepShape("sample", 0, rows) in self.programs and StepShape("sample_state", 0, rows) in self.programs

    def padded_tokens(self, plan: StepPlan, decode_variant: bool | None = None) -> int:
        """Padded tokens of a step: the bucket of its token count, at least `min_step_tokens`, and
        at least `min_lora_mixed_tokens` for a LoRA step with a prefill row (or a decode-only LoRA
        step too large for the decode variant, or without it: `decode_variant`, None: asked here)."""
        tokens = bucket(plan.num_tokens, self.min_tokens)
        lora = any(row.slot >= 0 for row in plan.rows)
        decode_only = self.decode_variant(plan) if decode_variant is None else decode_variant
        if lora and not self.has_bucket(tokens, lora, decode_only):
            tokens = max(tokens, self.min_lora_mixed)
        return tokens

    def compiled_tokens(self, tokens: int, width: int, plan: StepPlan, window: bool, decode_variant: bool) -> int:
        """`tokens`, or while the background compile runs and that bucket's forward (or its samplers)
        is not compiled yet, the smallest larger bucket of the step's variant that is
        (`decode_variant`: see `decode_variant`)."""
        if self.background is None or not self.background.is_alive():
            return tokens
        lora = window or any(row.slot >= 0 for row in plan.rows)
        variant = (width, lora, lora and not window and decode_variant, window)

        def ready(t: int) -> bool:
            rows = self.rows(t)
            return StepShape("forward", t, rows, *variant) in self.programs and self._samplers_ready(rows)

        if ready(tokens):
            return tokens
        larger = [s.tokens for s in self.programs.shapes() if s.program == "forward" and not s.score
                  and s.tokens > tokens and (s.width, s.lora, s.decode_only, s.window) == variant and ready(s.tokens)]
        return min(larger, default=tokens)

    # ---- program variants -----------------------------------------------------------------------
    def step_shapes(self) -> list[StepShape]:
        """Every program variant a step can run (see `StepShape`): forwards over each token bucket
        (8 .. the token budget's) and block-table width (`table_width`: one on a GPU/TPU, else
        buckets 4 .. the context's), with LoRA inputs and without, plus the decode-only LoRA
        variant of the buckets a step of one-token rows fits (<= max_rows tokens) where the
        backend's plan has one; and the samplers (`SAMPLERS`) over each row bucket."""
        tokens = sorted({bucket(t, self.min_tokens) for t in range(1, self.config.token_budget + 1)})
        widths = sorted({self.table_width(p) for p in range(1, self.max_pages + 1)})
        variants = [(False, False), (True, False)]
        if self.has_decode_variant():
            variants.append((True, True))
        shapes = [StepShape("forward", t, self.rows(t), w, lora, decode_only)
                  for lora, decode_only in variants for t in tokens if self.has_bucket(t, lora, decode_only)
                  for w in widths]
        if self.window is not None:
            shapes += [StepShape("forward", t, self.rows(t), w, True, False, True) for t in tokens for w in widths]
        return shapes + [StepShape(sampler, 0, rows) for sampler in SAMPLERS
                         for rows in sorted({self.rows(t) for t in tokens})]

    def first_shapes(self, shapes: list[StepShape]) -> list[StepShape]:
        """The programs of `shapes` that serve any step until the rest are compiled: per forward
        variant (LoRA or not, decode-only, window, table width) its largest token bucket, its
        smallest one that holds a decode step of every row, and its smallest one (a decode step of a
        few rows in the 256-row bucket took 2x its own bucket's time: the first 100 s of a cold
        8B server on an H100, bench/NOTES_serve.md; `Engine.warmup` compiles them scanned: fast),
        and the samplers over their rows but the masked ones (structured outputs: only
        a request with a grammar needs them; they lead the background compile, `compile_rest`, and
        cost a cold start ~2 s on an H200 when compiled first). With split layers (every program
        unrolled) not the decode-only LoRA variant: its steps run the mixed LoRA variant meanwhile
        (`decode_variant`), 2 of 10 forwards fewer before ready."""
        forwards = [shape for shape in shapes if shape.program == "forward"
                     and not (shape.decode_only and self.programs.layers_split)]
        first, all_rows = set(), bucket(self.max_rows, self.min_tokens)
        for variant in {(s.width, s.lora, s.decode_only, s.window) for s in forwards}:
            tokens = sorted(s.tokens for s in forwards if (s.width, s.lora, s.decode_only, s.window) == variant)
            fits = [t for t in tokens if t >= all_rows]
            first |= {s for s in forwards if (s.width, s.lora, s.decode_only, s.window) == variant
                      and s.tokens in (tokens[0], tokens[-1], fits[0] if fits else tokens[-1])}
        rows = {shape.rows for shape in first}
        return [shape for shape in shapes if shape in first or (
            shape.program != "forward" and not shape.program.endswith("_masked") and shape.rows in rows)]

    def scoring_tokens(self) -> int:
        """The smallest token bucket a scoring step runs in: the smallest of scanned layers, at most the
        largest bucket (with split layers, where none is scanned, the largest)."""
        return min(bucket(self.programs.scan_from_tokens, self.min_tokens), bucket(self.config.token_budget, self.min_tokens))

    def score_shapes(self, shapes: list[StepShape]) -> list[StepShape]:
        """The scoring variants of `shapes`' base and LoRA (not decode-only, not window) forwards over
        buckets from `scoring_tokens` (where a scoring step runs: `batch_arrays`)."""
        return [shape._replace(score=True) for shape in shapes if shape.program == "forward" and not shape.window
                and not shape.decode_only and shape.tokens >= self.scoring_tokens()]

    def padding_args(self, shape: StepShape, state, cache: PagedKVCache, last_tokens) -> tuple:
        """Dynamic arguments of the program `shape` for a step of padding only (writes nothing),
        over the engine's weights `state`, KV `cache` and previous tokens [max_rows]."""
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
            lora = LoraInputs({}, build_window_plan(no_rows, self.window.layout.slots, self.window.layout.rank))
        elif shape.lora:
            lora = LoraInputs(self.lora_arrays(), self.lora_plan(no_rows, np.zeros(tokens, bool), shape.decode_only))
        scoring = (no_rows,) if shape.score else ()
        if shape.images:  # a step with image tokens (`serve.vision`): compiled when one first runs
            rows = jax.ShapeDtypeStruct((shape.images, self.model_config.hidden_size), self.image_dtype)
            scoring = (no_rows if shape.score else None, (rows, no_rows))
        return (state, cache, batch, lora, last_tokens, no_rows) + scoring

    def compile(self, shapes: list[StepShape], threads: int, args: Callable[[StepShape], tuple], progress=None,
                scan: bool | None = None, worker=None) -> None:
        """Compiles `shapes` (a sampler after a forward over its rows: it takes that forward's logits
        sharding) over the dynamic arguments `args(shape)` (`padding_args`), `threads` at a time;
        `scan`, `worker`: see `Programs.compile`. On several threads each sampler starts as soon as a
        forward over its rows is compiled (the largest forwards finish last: ~4 s of a split-layers
        cold start on an H200 went to samplers waiting for them)."""
        if threads > 1 and worker is None:
            return self._compile_overlapped(shapes, threads, args, progress, scan)
        for program in ("forward",) + SAMPLERS:
            todo = [shape for shape in shapes if shape.program == program]
            self.programs.compile_all([(shape, args(shape)) for shape in todo], threads,
                                      None if progress is None else progress(program), scan=scan, worker=worker)

    def _compile_overlapped(self, shapes: list[StepShape], threads: int, args: Callable[[StepShape], tuple],
                            progress, scan: bool | None) -> None:
        """`compile` on `threads` threads: the forwards at once, each sampler once a forward over its
        rows is compiled (or at once where one already is); the first error is raised at the end."""
        waiting: dict[int, list[StepShape]] = {}
        for shape in shapes:
            if shape.program != "forward":
                waiting.setdefault(shape.rows, []).append(shape)
        counters = {program: [0, sum(s.program == program for s in shapes)] for program in ("forward",) + SAMPLERS}
        lock, futures = threading.Lock(), []
        pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jaxlora-compile")

        def submit(shape: StepShape) -> None:
            futures.append(pool.submit(one, shape))

        def samplers_of(rows: int) -> None:  # under `lock`
            for sampler in waiting.pop(rows, []):
                submit(sampler)

        def one(shape: StepShape) -> None:
            self.programs.compile_all([(shape, args(shape))], 1, scan=scan)
            with lock:
                done = counters[shape.program]
                done[0] += 1
                if progress is not None:
                    progress(shape.program)(done[0], done[1])
                if shape.program == "forward":
                    samplers_of(shape.rows)

        with lock:
            for rows in [rows for rows in waiting if self.programs.logits_sharding(rows) is not None]:
                samplers_of(rows)
            for shape in shapes:
                if shape.program == "forward":
                    submit(shape)
        try:
            while True:
                with lock:
                    pending = [future for future in futures if not future.done()]
                if not pending:
                    break
                concurrent.futures.wait(pending)
            for future in futures:
                future.result()  # the first error
        finally:
            pool.shutdown(wait=True)
        if waiting:  # samplers of rows no forward serves: compiled as before (they raise there if they cannot)
            for program in SAMPLERS:
                todo = [shape for rows in waiting.values() for shape in rows if shape.program == program]
                self.programs.compile_all([(shape, args(shape)) for shape in todo], threads,
                                          None if progress is None else progress(program), scan=scan)

    def compile_first(self, shapes: list[StepShape] | None, threads: int | None, background: bool,
                      args: Callable[[StepShape], tuple]) -> tuple[float, int, list[StepShape]]:
        """`Engine.warmup`'s programs compiled before serving: `shapes` (None: every `step_shapes()`,
        or with `background` only `first_shapes`, scanned), `threads` at a time (None:
        `compile_threads`), over `args(shape)`. Returns (when it started, programs compiled before,
        the shapes left to the background compile: the others, the scoring ones, the stand-ins)."""
        started = time.perf_counter()
        rest: list[StepShape] = []
        if shapes is None:
            shapes = self.step_shapes()
            if background:  # the scoring programs (prompt log-probabilities) last
                first = self.first_shapes(shapes)
                rest = [shape for shape in shapes if shape not in first] + self.score_shapes(shapes)
                shapes = first
        before = len(self.programs)
        threads = self.compile_threads() if threads is None else threads
        log.info("compiling %d step programs (%d threads)%s", len(shapes), threads,
                 f"; {len(rest)} more in the background once serving" if rest else "")
        # with a background compile the first programs are scanned (fast to compile); those that run
        # unrolled in the end are compiled again in the background (`Programs` stand-ins)
        self.compile(shapes, threads, args, progress_log(started), scan=True if rest else None)
        rest += [shape for shape in self.programs.stand_ins() if shape not in rest]
        return started, before, rest

    def compile_threads(self) -> int:
        """Threads for the programs compiled before serving: one per CPU core this process may use, at
        most 8 (scanned first programs compile in seconds; with split layers, every first program
        unrolled, 16 threads were slower than 8 on an H200's 16 cores: bench/NOTES_serve.md)."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(8, cores))

    def start_first(self, background: bool, args: Callable[[StepShape], tuple]) -> concurrent.futures.Future:
        """`compile_first` of the default shapes on a daemon thread (an exit meanwhile, e.g. a bad
        checkpoint, does not wait for it); its result or error in the returned future."""
        future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(self.compile_first(None, None, background, args))
            except BaseException as err:
                future.set_exception(err)

        threading.Thread(target=run, daemon=True, name="jaxlora-warmup").start()
        return future

    def compile_rest(self, shapes: list[StepShape], args: Callable[[StepShape], tuple],
                     stopping: Callable[[], bool], worker=None) -> None:
        """`Engine.warmup`'s background compile: the forwards of each token bucket, smallest first, then
        the samplers over their rows, one program at a time, the scoring forwards last; stops once
        `stopping()`. First the samplers whose rows a compiled forward already serves (the masked
        ones `first_shapes` leaves out: a request with a grammar waits for them at most seconds).
        With a `worker` (`serve.compile_worker.CompileWorker`) a child process lowers and compiles
        them, off this process's GIL and CPU; what it does not, runs here with short GIL turns
        (`short_gil_turns`), so serving steps wait less on its lowering."""
        with short_gil_turns():
            try:
                self._compile_rest(shapes, args, stopping, worker)
            except WorkerClosed:  # the engine stopped
                log.info("background compile stopped")

    def _compile_rest(self, shapes: list[StepShape], args: Callable[[StepShape], tuple],
                      stopping: Callable[[], bool], worker) -> None:
        started = time.perf_counter()
        ready = [shape for shape in shapes
                 if shape.program != "forward" and self.programs.logits_sharding(shape.rows) is not None]
        progress = progress_log(started, "background: ")
        try:
            self.compile(ready, 1, args, progress, worker=worker)
        except WorkerClosed:
            raise
        except Exception:  # the step compiles it when it needs it (and raises there)
            log.exception("background compile of the samplers failed")
        for tokens in sorted({shape.tokens for shape in shapes if shape.program == "forward"}):
            if stopping():
                return
            forwards = [shape for shape in shapes
                        if shape.program == "forward" and shape.tokens == tokens and not shape.score]
            samplers = [shape for shape in shapes if shape.program != "forward" and shape.rows == self.rows(tokens)]
            try:
                self.compile(forwards + samplers, 1, args, progress, worker=worker)
            except WorkerClosed:
                raise
            except Exception:  # the step compiles it when it needs it (and raises there)
                log.exception("background compile of the %d-token programs failed", tokens)
        left = [shape for shape in shapes if shape not in self.programs or shape in self.programs.stand_ins()]
        if left and not stopping():
            self.compile(left, 1, args, progress, worker=worker)
        log.info("background compile done: %d programs in %.1f s%s", len(shapes), time.perf_counter() - started,
                 "" if worker is None else f" ({worker.compiled} in the compile worker)")


# The GIL's switch interval while the background compile runs (Python's default: 5 ms). Lowering
# a program is seconds of Python holding the GIL; the engine thread, whose step releases it at
# every device call, then waits up to a whole interval to take it back each time.
BACKGROUND_SWITCH_S = 0.0005


@contextlib.contextmanager
def short_gil_turns(interval: float = BACKGROUND_SWITCH_S):
    """Within: the GIL switch interval at most `interval` (process-wide), restored after."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, interval))
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def progress_log(started: float, prefix: str = "") -> Callable[[str], Callable[[int, int], None]]:
    """`Programs.compile_all`'s progress callbacks by program name: one log line per compiled program."""
    return lambda program: lambda done, total: log.info("%scompiled %s program %d/%d (%.1f s)", prefix, program,
                                                        done, total, time.perf_counter() - started)
