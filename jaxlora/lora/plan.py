"""The LoRA batch plan: which rows use which adapter slot, grouped by adapter (docs/architecture.md,
"The batch plan").

Built once per step on the host with numpy, with static padded shapes (the number of segments is
padded to a bucket), so a new mix of adapters in the same bucket reuses the compiled step.

`LoraPlan` (training, generation, any caller): rows in the caller's order plus the permutation that
groups them, which the kernel backends apply around every projection. `ServingPlan` (the serving
engine): the engine orders each step's rows once on the host (`serving_order`), so the kernels take
the rows as they are, one-token rows through BGMV and prefill chunks through SGMV. `WindowPlan`
(the serving engine, a step whose adapters all sit in the adapter window,
`jaxlora.models.packed.add_adapter_window`): which window slot each token uses."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxlora.buckets import bucket


class LoraPlan(NamedTuple):
    """Arrays over the N flattened tokens of a batch (a pytree: pass it through jit).

    token_slot [N]: adapter slot of each token in batch order, -1 = base model only.
    perm [N]: grouped order -> batch row (rows of one slot contiguous; slots ascending, base last).
    inv_perm [N]: batch row -> grouped position.
    seg_starts [S+1], seg_slot [S]: segment i covers grouped rows seg_starts[i]:seg_starts[i+1] and
      uses slot seg_slot[i] (-1: base). Padding segments are empty, with slot -1.
    """

    token_slot: np.ndarray
    perm: np.ndarray
    inv_perm: np.ndarray
    seg_starts: np.ndarray
    seg_slot: np.ndarray


def _segments(slots: np.ndarray, counts: np.ndarray, num_segments: int):
    """(seg_starts [S+1], seg_slot [S]) of consecutive groups of `counts` rows using `slots`;
    padding segments are empty (at the end of the last group) with slot -1."""
    if len(slots) > num_segments:
        raise ValueError(f"{len(slots)} distinct adapters do not fit in {num_segments} segments")
    seg_starts = np.full(num_segments + 1, counts.sum(), np.int32)
    seg_starts[0] = 0
    seg_starts[1: len(slots) + 1] = np.cumsum(counts)
    seg_slot = np.full(num_segments, -1, np.int32)
    seg_slot[: len(slots)] = slots
    return seg_starts, seg_slot


def build_plan(token_slot, num_segments: int | None = None) -> LoraPlan:
    """Plan for per-token slots (any shape; flattened in C order).

    Args:
      token_slot: int array, the adapter slot of every token, -1 for the base model.
      num_segments: S, the padded number of segments (default: a power-of-two bucket).
    """
    token_slot = np.asarray(token_slot, np.int32).reshape(-1)
    sort_key = np.where(token_slot < 0, np.iinfo(np.int32).max, token_slot)
    perm = np.argsort(sort_key, kind="stable").astype(np.int32)
    inv_perm = np.empty_like(perm)
    inv_perm[perm] = np.arange(perm.size, dtype=np.int32)
    slots, counts = np.unique(token_slot[perm], return_counts=True)
    order = np.argsort(np.where(slots < 0, np.iinfo(np.int32).max, slots), kind="stable")
    num_segments = bucket(len(slots), 4) if num_segments is None else num_segments
    seg_starts, seg_slot = _segments(slots[order], counts[order], num_segments)
    return LoraPlan(token_slot, perm, inv_perm, seg_starts, seg_slot)


class ServingPlan(NamedTuple):
    """A serving step's plan over rows the engine has already ordered (`serving_order`): the
    kernels use the rows as they are (no permutation, no gathers) and each row goes to one kernel.

    Row order: the tokens of multi-token adapter rows (prefill chunks) first, grouped by slot in
    ascending order; then every other token (one-token rows, base-model rows, padding).

    token_slot [N]: adapter slot of each token in that order, -1 = base model or padding.
    decode_slot [N]: slot of each token of a one-token row (BGMV), -1 for every other token.
    seg_starts [S+1], seg_slot [S]: segments over the multi-token prefix (SGMV); the tail from
      seg_starts[S] on is no segment's. Both None when built with S = 0 (the engine does so for
      steps without multi-token rows: decode only), which makes it its own compiled variant.
    decode_rows [D] or None: the rows of the one-token adapter tokens (those with decode_slot >= 0)
      ascending, padded with N (no row): a mixed step's BGMV runs over these D rows only and each
      row's delta is added back by a row gather, instead of over all N (`jaxlora.lora.ops.
      _on_bgmv_rows`); None: over all N rows, in place.

    A plan built with `tail_segments` (a mixed step over paged pools, `LoraBackend.tail_segments`)
    has no BGMV rows: its segments are the runs of equal slot over every token up to the last
    adapter token (the one-token rows as well, sorted by slot in `serving_order`), and
    decode_slot and decode_rows are None, so its kernels are the SGMV pair alone.
    """

    token_slot: np.ndarray
    decode_slot: np.ndarray
    seg_starts: np.ndarray | None
    seg_slot: np.ndarray | None
    decode_rows: np.ndarray | None = None


def serving_order(row_slot, row_tokens) -> np.ndarray:
    """The order of a step's rows that `build_serving_plan` expects: [R] row indices.

    row_slot [R]: adapter slot of each row (-1: base model); row_tokens [R]: its token count.
    Multi-token adapter rows come first, by slot ascending; then one-token adapter rows, by slot
    ascending (one segment per slot under `build_serving_plan`'s `tail_segments`); base-model rows
    last. Rows of equal key keep their given order.
    """
    row_slot, row_tokens = np.asarray(row_slot, np.int64), np.asarray(row_tokens)
    segmented = (row_slot >= 0) & (row_tokens > 1)
    tail = row_slot.max(initial=0) + 1  # one-token adapter rows after every prefill chunk
    key = np.where(segmented, row_slot, np.where(row_slot >= 0, tail + row_slot, np.iinfo(np.int64).max))
    return np.argsort(key, kind="stable")


def build_serving_plan(token_slot, one_token, num_segments: int, bgmv_rows: int | None = None,
                       tail_segments: bool = False) -> ServingPlan:
    """Plan for tokens in `serving_order` (ValueError otherwise).

    Args:
      token_slot: [N] int, the adapter slot of every token, -1 for the base model and padding.
      one_token: [N] bool, the token is its row's only token (served by BGMV).
      num_segments: S, the padded number of segments; 0 for a step without multi-token rows.
      bgmv_rows: D, the most one-token adapter tokens the step may have (a static bound, e.g. the
        engine's rows per step): a plan with segments lists them in `decode_rows` [D] (ValueError
        if there are more); None, or a plan without segments: BGMV over all N rows.
      tail_segments: a plan with segments covers the one-token rows too, one segment per run of
        equal slot (ServingPlan's doc; ValueError if the runs exceed `num_segments`).
    """
    token_slot = np.asarray(token_slot, np.int32).reshape(-1)
    one_token = np.asarray(one_token, bool).reshape(-1)
    decode_slot = np.where(one_token, token_slot, -1).astype(np.int32)
    segmented = (token_slot >= 0) & ~one_token
    prefix = int(segmented.sum())
    if not segmented[:prefix].all() or np.any(np.diff(token_slot[:prefix]) < 0):
        raise ValueError("multi-token adapter rows must come first, grouped by slot (see serving_order)")
    if num_segments == 0 and prefix == 0:
        return ServingPlan(token_slot, decode_slot, None, None)
    if tail_segments:
        seg_starts, seg_slot = _runs(token_slot, num_segments)
        return ServingPlan(token_slot, None, seg_starts, seg_slot, None)
    slots, counts = np.unique(token_slot[:prefix], return_counts=True)
    seg_starts, seg_slot = _segments(slots, counts, num_segments)
    return ServingPlan(token_slot, decode_slot, seg_starts, seg_slot, _decode_rows(decode_slot, bgmv_rows))


def _runs(token_slot: np.ndarray, num_segments: int):
    """(seg_starts [S+1], seg_slot [S]): one segment per run of equal slot over the tokens up to
    the last one with slot >= 0 (runs of -1 between them are inactive segments)."""
    adapter = np.flatnonzero(token_slot >= 0)
    span = token_slot[: adapter[-1] + 1 if len(adapter) else 0]
    starts = np.flatnonzero(np.diff(span, prepend=-2) != 0)  # the first token of each run
    if len(starts) > num_segments:
        raise ValueError(f"{len(starts)} runs of one adapter's tokens do not fit in {num_segments} segments "
                         "(rows not in serving_order?)")
    return _segments(span[starts], np.diff(np.append(starts, len(span))), num_segments)


def _decode_rows(decode_slot: np.ndarray, bgmv_rows: int | None) -> np.ndarray | None:
    """[D] the rows with decode_slot >= 0, ascending, padded with N; None without a bound."""
    if bgmv_rows is None:
        return None
    rows = np.flatnonzero(decode_slot >= 0).astype(np.int32)
    if len(rows) > bgmv_rows:
        raise ValueError(f"{len(rows)} one-token adapter rows exceed the step's bound of {bgmv_rows}")
    decode_rows = np.full(bgmv_rows, decode_slot.size, np.int32)
    decode_rows[: len(rows)] = rows
    return decode_rows


class WindowPlan(NamedTuple):
    """A serving step whose adapters all sit in the adapter window (see
    `jaxlora.models.packed.add_adapter_window`): each LoRA projection's shrink comes out of the
    base GEMM (the window's A columns), and each row keeps its own slot's columns.

    token_window [N] int32: window slot of each token's adapter, -1 = base model or padding.
    column_window [W * r] int32: window slot of each shrink column of one projection (c // r).
    token_extra [N] int32: a second window slot whose LoRA the token adds too, -1 = none (mixed
      inference mode: the merged adapter with negated scale, `serve.modes`).
    """

    token_window: np.ndarray
    column_window: np.ndarray
    token_extra: np.ndarray


def build_window_plan(token_window, window: int, rank: int, token_extra=None) -> WindowPlan:
    """The plan of tokens whose adapters sit in window slots `token_window` [N] (-1: none), for a
    window of `window` slots of rank `rank`; token_extra [N]: a second slot per token (None: none)."""
    token_window = np.asarray(token_window, np.int32).reshape(-1)
    token_extra = np.full_like(token_window, -1) if token_extra is None else np.asarray(token_extra, np.int32)
    for slots in (token_window, token_extra):
        if slots.size and (slots.max() >= window or slots.min() < -1):
            raise ValueError(f"window slots must be in -1..{window - 1}")
    if token_extra.shape != token_window.shape:
        raise ValueError(f"token_extra {token_extra.shape} must match token_window {token_window.shape}")
    return WindowPlan(token_window, (np.arange(window * rank) // rank).astype(np.int32), token_extra)
