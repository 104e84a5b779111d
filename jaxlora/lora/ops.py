"""The LoRA computations that the backends of `jaxlora.lora.backends` are made of: per row,
delta = scale[slot] * (x @ A[slot]) @ B[slot] (slot -1: the base model, no delta).

Delta functions (rows [N, k], a layer's pool, plan) -> [N, n] float32, one per way of computing it:
`loop_delta` (one masked dense product per slot, the plainest reference), `gather_delta` (each
row's A/B gathered, batched einsums), `ragged_dot_delta` (rows grouped by slot, `ragged_dot`),
`onehot_delta` (x against every slot, a one-hot selection) and `pallas_delta` (the SGMV kernels of
`pallas_kernels`; with a `LoraPlan` the rows are gathered into adapter order and back around the
differentiable kernels, with the engine's `ServingPlan` they are already in order). With a
`ServingPlan` the kernels also accumulate in place into a projection's float32 output
(`pallas_accumulate`, `pallas_accumulate_group`: SGMV on the prefill segments, BGMV on the
one-token rows; forward only). `fused_linear` is the fused training projection x @ W + LoRA.

A module's pool is a layer's dict {"a" [slots, k, r], "b" [slots, r, n], "scale", "rank" [slots]}
or a `StackedModulePool` (every layer's arrays and the layer to use: the serving engine's layer
scan passes the stack so the kernels index it in place and no per-layer slice is copied). A paged
pool (`jaxlora.lora.paged_ops`: adapters as rows through a row table, unified paging) comes as a
`PagedModulePool` to the serving kernels (which then read the rows: `paged_ops.sgmv`, `paged_ops.bgmv`)
and as one layer's paged dict to the XLA deltas (`layer_pool` makes it padded slots).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

import pallas_kernels
from jaxlora.lora import paged_ops
from jaxlora.lora.paged_ops import PagedModulePool
from jaxlora.lora.plan import LoraPlan, ServingPlan
from jaxlora.nn.layers import dense
from pallas_kernels.fused_lora import fused_lora_linear
from pallas_kernels.reference import paged_rows

_F32 = jnp.float32


class StackedModulePool(NamedTuple):
    """One projection's pool arrays for every layer and the layer a call uses: a [L, slots, k, r],
    b [L, slots, r, n], scale [L, slots] float32, rank [L, slots] int32; layer: int32 scalar."""

    a: jax.Array
    b: jax.Array
    scale: jax.Array
    rank: jax.Array
    layer: jax.Array

    def layer_pool(self) -> dict:
        """The layer's own {"a", "b", "scale", "rank"} (a slice of each stack)."""
        return {key: getattr(self, key)[self.layer] for key in ("a", "b", "scale", "rank")}

    def entries(self):
        """(a [L*slots, k, r], b [L*slots, r, n], rank [L*slots], scale [L*slots], offset of the
        layer's first entry): the stacks flattened (no copy) for the stacked-pool kernels."""
        layers, slots = self.rank.shape
        flat = lambda array: array.reshape(layers * slots, *array.shape[2:])
        return flat(self.a), flat(self.b), flat(self.rank), flat(self.scale), self.layer * slots


def stacked_pool(pool: dict, layer: jax.Array) -> dict:
    """{module: StackedModulePool} of a whole pool ({module: {"a", "b", "scale", "rank"}}, each
    with a leading layer axis) at `layer` (a `PagedModulePool` for a paged module)."""
    return {module: paged_ops.stacked(arrays, layer) if paged_ops.is_paged(arrays)
            else StackedModulePool(layer=layer, **arrays) for module, arrays in pool.items()}


def layer_pool(module_pool) -> dict:
    """A module pool as the layer's own dict of padded slots (a stacked pool sliced to its layer;
    a paged one gathered, `paged_ops.padded_view`)."""
    if isinstance(module_pool, (StackedModulePool, PagedModulePool)):
        return module_pool.layer_pool()
    return paged_ops.padded_view(module_pool) if paged_ops.is_paged(module_pool) else module_pool


def _entries(module_pool):
    """(a [P, k, r], b [P, r, n], rank [P], scale [P], int32 offset of the layer's first entry) of
    a `StackedModulePool` (flattened, no copy) or of a layer's dict (offset 0)."""
    if isinstance(module_pool, StackedModulePool):
        a, b, rank, scale, offset = module_pool.entries()
    else:
        a, b, rank, scale, offset = module_pool["a"], module_pool["b"], module_pool["rank"], module_pool["scale"], 0
    return a, b, rank, scale, jnp.asarray(offset, jnp.int32)


def _row_scale(module_pool: dict, token_slot: jax.Array) -> jax.Array:
    """[N] scale of each row's adapter, 0 for base rows."""
    return jnp.where(token_slot >= 0, module_pool["scale"][jnp.maximum(token_slot, 0)], 0.0)


def loop_delta(rows, module_pool, plan):
    """One masked dense product per pool slot."""
    a, b, scale = module_pool["a"], module_pool["b"], module_pool["scale"]
    delta = jnp.zeros((rows.shape[0], b.shape[-1]), _F32)
    for slot in range(a.shape[0]):
        shrunk = jnp.dot(rows, a[slot], preferred_element_type=_F32)
        expanded = jnp.dot(shrunk, b[slot].astype(_F32), preferred_element_type=_F32)
        delta = delta + jnp.where((plan.token_slot == slot)[:, None], scale[slot] * expanded, 0.0)
    return delta


def gather_delta(rows, module_pool, plan):
    """Each row's A and B gathered, then batched einsums."""
    slot = jnp.maximum(plan.token_slot, 0)
    shrunk = jnp.einsum("nk,nkr->nr", rows, module_pool["a"][slot], preferred_element_type=_F32)
    shrunk = shrunk * _row_scale(module_pool, plan.token_slot)[:, None]
    return jnp.einsum("nr,nrm->nm", shrunk, module_pool["b"][slot].astype(_F32), preferred_element_type=_F32)


def ragged_dot_delta(rows, module_pool, plan):
    """Rows grouped by slot through `jax.lax.ragged_dot` (base rows use an extra zero adapter);
    needs a `LoraPlan` (its permutation)."""
    if not isinstance(plan, LoraPlan):
        raise ValueError("the ragged_dot backend needs a LoraPlan (build_plan), not a ServingPlan")
    a, b = module_pool["a"], module_pool["b"]
    num_slots = a.shape[0]
    group = jnp.where(plan.token_slot < 0, num_slots, plan.token_slot)
    group_sizes = jnp.bincount(group, length=num_slots + 1).astype(jnp.int32)
    a_ext = jnp.concatenate([a, jnp.zeros_like(a[:1])])
    b_ext = jnp.concatenate([b, jnp.zeros_like(b[:1])]).astype(_F32)
    grouped = rows[plan.perm]
    shrunk = jax.lax.ragged_dot(grouped, a_ext, group_sizes, preferred_element_type=_F32)
    shrunk = shrunk * _row_scale(module_pool, plan.token_slot[plan.perm])[:, None]
    expanded = jax.lax.ragged_dot(shrunk, b_ext, group_sizes, preferred_element_type=_F32)
    return expanded[plan.inv_perm]


def onehot_delta(rows, module_pool, plan):
    """Two GEMMs over every slot at once: [N, k] @ [k, S*r] -> keep each row's own slot (scaled),
    -> [N, S*r] @ [S*r, n]. Both through `dense` (inputs in the pool's dtype, float32 accumulation,
    bf16 backward GEMMs): float32 operands here made XLA run them as float32 GEMMs without tensor
    cores (bench/NOTES_train.md)."""
    a, b = module_pool["a"], module_pool["b"]
    slots, k, r = a.shape
    selector = (plan.token_slot[:, None] == jnp.arange(slots)).astype(_F32)
    selector = selector * module_pool["scale"][None, :]
    shrunk_all = dense(rows, jnp.swapaxes(a, 0, 1).reshape(k, slots * r)).reshape(-1, slots, r)
    picked = (shrunk_all * selector[:, :, None]).reshape(-1, slots * r).astype(b.dtype)
    return dense(picked, b.reshape(slots * r, b.shape[-1]))


def _slot_rank_scale(module_pool: dict, slot: jax.Array):
    """(rank int32, scale float32) of each entry of `slot` (segments or rows); 0 where slot < 0."""
    valid, clamped = slot >= 0, jnp.maximum(slot, 0)
    rank = jnp.where(valid, module_pool["rank"][clamped], 0).astype(jnp.int32)
    return rank, jnp.where(valid, module_pool["scale"][clamped], 0.0).astype(_F32)


def pallas_delta(rows, module_pool, plan, style: str | None = None):
    """The SGMV kernels in kernel style `style` (None: the device's, see
    `pallas_kernels.kernel_style`): with a `ServingPlan` on the rows as they are (SGMV + BGMV into
    a zeroed delta), with a `LoraPlan` on the rows gathered into adapter order and back."""
    style = pallas_kernels.kernel_style(style)
    if isinstance(plan, ServingPlan):
        delta = jnp.zeros((rows.shape[0], module_pool["b"].shape[-1]), _F32)
        return _serving_kernels(delta, rows, module_pool, plan, style)
    seg_rank, seg_scale = _slot_rank_scale(module_pool, plan.seg_slot)
    grouped = rows[plan.perm]
    delta = pallas_kernels.sgmv_lora_delta(
        grouped, module_pool["a"], module_pool["b"], plan.seg_starts, plan.seg_slot, seg_rank, seg_scale,
        impl=style,
    )
    return delta.astype(_F32)[plan.inv_perm]


def pallas_accumulate(y: jax.Array, x: jax.Array, module_pool, plan: ServingPlan, style: str | None = None):
    """y [..., n] (float32, or x's dtype) plus the LoRA of x [..., k] (rows in the `ServingPlan`'s
    order), the kernels accumulating in place on y in its dtype (no zeroed delta buffer, no add)."""
    rows, out = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    return _serving_kernels(out, rows, module_pool, plan, pallas_kernels.kernel_style(style)).reshape(y.shape)


def pallas_accumulate_group(ys, x: jax.Array, module_pools, plan: ServingPlan, style: str | None = None) -> tuple:
    """`pallas_accumulate` for several projections of one input x [..., k] (q/k/v, gate/up): ys are
    their outputs [..., n_g] (float32, or x's dtype: kept), module_pools their pools. The one-token
    rows of all of them go through one grouped BGMV shrink and one expand (x read once, 2 launches
    instead of 2 per projection); prefill segments through SGMV per projection. Paged pools: `pallas_accumulate`
    per projection (no grouped paged kernel)."""
    if any(isinstance(pool, PagedModulePool) for pool in module_pools):
        return tuple(pallas_accumulate(y, x, pool, plan, style) for y, pool in zip(ys, module_pools))
    style = pallas_kernels.kernel_style(style)
    rows = x.reshape(-1, x.shape[-1])
    outs, entries = [], [_entries(pool) for pool in module_pools]
    for y, (a, b, rank, scale, offset) in zip(ys, entries):
        out = y.reshape(-1, y.shape[-1])
        if plan.seg_starts is not None:
            out = pallas_kernels.sgmv_lora_stacked(out, rows, a, b, plan.seg_starts, plan.seg_slot, rank, scale,
                                                   offset, impl=style)
        outs.append(out)
    outs = _on_bgmv_rows(outs, rows, plan.decode_slot, plan.decode_rows, _grouped_bgmv(entries, style))
    return tuple(out.reshape(y.shape) for out, y in zip(outs, ys))


def pallas_accumulate_packed(y, widths, x: jax.Array, module_pools, plan: ServingPlan, style: str | None = None):
    """`pallas_accumulate_group` for projections whose outputs lie side by side in y [..., sum(widths)]
    (a packed kernel's output: q/k/v, gate/up), in place on y with one grouped shrink and one expand
    (`pallas_kernels.bgmv_lora_packed`: no projection's columns copied out of y for the kernel);
    x [..., k]. Decode-only plans over stacked pools only: None otherwise (the caller takes
    `pallas_accumulate_group` on y cut apart)."""
    if plan.seg_starts is not None or plan.decode_rows is not None or any(
            isinstance(pool, PagedModulePool) for pool in module_pools):
        return None
    entries = [_entries(pool) for pool in module_pools]
    lora_as, lora_bs, ranks, scales = ([e[i] for e in entries] for i in range(4))
    out = pallas_kernels.bgmv_lora_packed(y.reshape(-1, y.shape[-1]), widths, x.reshape(-1, x.shape[-1]), lora_as,
                                          lora_bs, plan.decode_slot, ranks, scales, entries[0][4],
                                          impl=pallas_kernels.kernel_style(style))
    return out.reshape(y.shape)


# ---- the LoRA in elementwise form, for XLA to fuse (issue 34 item 3) --------------------------------

def _gathered(module_pool, token_slot: jax.Array):
    """(a [N, k, r], b [N, r, n] of each row's slot, scale [N]: 0 for rows with slot -1), gathered
    from a stacked pool's flattened entries at its layer's offset (no slice of the stack) or from a
    layer's dict; a `PagedModulePool`'s rows through its row table (zeros past each rank), a paged
    layer dict through its padded view."""
    if isinstance(module_pool, PagedModulePool):
        a_rows, b_rows, table, rank, scale, row_offset, entry_offset = module_pool.flat()
        rows, live = paged_rows(token_slot, table, rank, row_offset, entry_offset)  # [N, w]
        a = jnp.where(live[:, :, None], a_rows[rows], 0)  # [N, w, k]
        b = jnp.where(live[:, :, None], b_rows[rows], 0)  # [N, w, n]
        row_scale = jnp.where(token_slot >= 0, scale[jnp.maximum(token_slot, 0) + entry_offset], 0.0)
        return jnp.swapaxes(a, 1, 2), b, row_scale
    if paged_ops.is_paged(module_pool):
        module_pool = layer_pool(module_pool)
    a, b, _, scale, offset = _entries(module_pool)
    index = jnp.maximum(token_slot, 0) + offset
    return a[index], b[index], jnp.where(token_slot >= 0, scale[index], 0.0)


def elementwise_deltas(rows: jax.Array, module_pools, token_slot: jax.Array) -> list:
    """The LoRA of rows [N, k] for each of `module_pools` (projections of one input), float32 [N, n_g],
    with no dot: the shrink one multiply-and-reduce over the rows' gathered A (the group's ranks side
    by side), each expand R multiply-adds of the rows' gathered B rows. XLA may fuse the expand into
    whatever consumes the projection's output and the shrink into one reduction, where a kernel pair
    is two launches a group (`bench/lora_stream_probe.py --variants xla`)."""
    gathered = [_gathered(pool, token_slot) for pool in module_pools]
    a = jnp.concatenate([g[0] for g in gathered], axis=-1).astype(_F32)
    v = jnp.sum(rows.astype(_F32)[:, :, None] * a, axis=1)  # [N, sum of ranks]
    deltas, start = [], 0
    for a_g, b_g, scale in gathered:
        rank = a_g.shape[-1]
        part = v[:, start:start + rank] * scale[:, None]
        delta = part[:, 0, None] * b_g[:, 0].astype(_F32)
        for j in range(1, rank):
            delta = delta + part[:, j, None] * b_g[:, j].astype(_F32)
        deltas.append(delta)
        start += rank
    return deltas


def elementwise_delta(rows: jax.Array, module_pool, plan) -> jax.Array:
    """`elementwise_deltas` of one projection over rows [N, k] in the plan's order: [N, n] float32."""
    return elementwise_deltas(rows, [module_pool], plan.token_slot)[0]


def elementwise_accumulate_group(ys, x: jax.Array, module_pools, plan) -> tuple:
    """ys [..., n_g] (float32, or x's dtype: kept) plus the LoRA of x [..., k] (`elementwise_deltas`),
    added in float32 and rounded once."""
    deltas = elementwise_deltas(x.reshape(-1, x.shape[-1]), module_pools, plan.token_slot)
    return tuple((y.astype(_F32) + d.reshape(y.shape)).astype(y.dtype) for y, d in zip(ys, deltas))


def elementwise_accumulate(y: jax.Array, x: jax.Array, module_pool, plan) -> jax.Array:
    """`elementwise_accumulate_group` for one projection."""
    return elementwise_accumulate_group((y,), x, (module_pool,), plan)[0]


def elementwise_accumulate_packed(y: jax.Array, widths, x: jax.Array, module_pools, plan) -> jax.Array:
    """`elementwise_accumulate_group` for projections side by side in y [..., sum(widths)]."""
    deltas = elementwise_deltas(x.reshape(-1, x.shape[-1]), module_pools, plan.token_slot)
    return (y.astype(_F32) + jnp.concatenate(deltas, axis=-1).reshape(y.shape)).astype(y.dtype)


def _grouped_bgmv(entries, style: str):
    """(outs, rows, row_slot) -> outs plus the LoRA of the rows with slot >= 0: the grouped BGMV
    kernels of the projections whose stacked pools' `_entries` are `entries` (one: the plain pair)."""
    lora_as, lora_bs, ranks, scales = ([e[i] for e in entries] for i in range(4))
    offset = entries[0][4]
    if len(entries) == 1:
        return lambda outs, rows, slot: [pallas_kernels.bgmv_lora_stacked(
            outs[0], rows, lora_as[0], lora_bs[0], slot, ranks[0], scales[0], offset, impl=style)]
    return lambda outs, rows, slot: list(pallas_kernels.bgmv_lora_grouped(
        outs, rows, lora_as, lora_bs, slot, ranks, scales, offset, impl=style))


def _paged_bgmv(module_pools, style: str):
    """`_grouped_bgmv` for paged pools: the paged BGMV per projection."""
    return lambda outs, rows, slot: [paged_ops.bgmv(out, rows, pool, slot, style)
                                     for out, pool in zip(outs, module_pools)]


def _on_bgmv_rows(outs: list, rows: jax.Array, row_slot: jax.Array, decode_rows, kernel) -> list:
    """outs [N, n_g] plus the BGMV LoRA of the rows whose slot `row_slot` [N] is >= 0, by
    `kernel(outs, rows, row_slot)` (in place on its outs). Without `decode_rows`: over all N rows,
    in place on outs. With `decode_rows` [D] (a `ServingPlan`'s: every row with slot >= 0 is among
    them; padding N): the kernel runs on those D rows only, into float32 zeros, and each output
    row adds its own (gathered by row: zero for rows not listed) in one elementwise pass with the
    result rounded once; no scatter, so a slice of a packed projection output is never copied.
    row_slot None (a `ServingPlan` whose segments cover every row, `tail_segments`): outs as they are."""
    if row_slot is None:
        return outs
    if decode_rows is None:
        return kernel(outs, rows, row_slot)
    decode_rows = jnp.asarray(decode_rows)
    listed = decode_rows.shape[0]
    take = lambda array, fill: jnp.asarray(array).at[decode_rows].get(mode="fill", fill_value=fill)
    parts = kernel([jnp.zeros((listed, out.shape[-1]), _F32) for out in outs], take(rows, 0), take(row_slot, -1))
    position = jnp.full(rows.shape[0], listed, jnp.int32).at[decode_rows].set(
        jnp.arange(listed, dtype=jnp.int32), mode="drop")  # [N]: its index in decode_rows, D if none
    return [(out.astype(_F32) + jnp.concatenate([part, jnp.zeros((1, part.shape[-1]), _F32)])[position])
            .astype(out.dtype) for out, part in zip(outs, parts)]


def _serving_kernels(y, rows, module_pool, plan: ServingPlan, style: str):
    """y [N, n] (float32, or x's dtype) plus the LoRA of rows [N, k] already in the plan's order:
    SGMV over the prefill segments (none in a decode-only step), then BGMV over the one-token rows
    (`_on_bgmv_rows`; none where the segments cover them, `ServingPlan`'s `tail_segments`), both in
    place on y (2 or 4 kernel launches, no per-call rank/scale lookups:
    the kernels read them by slot; forward only: no VJP). module_pool: a layer's dict or a StackedModulePool
    (a PagedModulePool: the paged kernels, reading the adapters' rows through the row table)."""
    if isinstance(module_pool, PagedModulePool):
        if plan.seg_starts is not None:
            y = paged_ops.sgmv(y, rows, module_pool, plan, style)
        kernel = _paged_bgmv([module_pool], style)
    else:
        entries = _entries(module_pool)
        if plan.seg_starts is not None:
            a, b, rank, scale, offset = entries
            y = pallas_kernels.sgmv_lora_stacked(y, rows, a, b, plan.seg_starts, plan.seg_slot, rank, scale, offset,
                                                 impl=style)
        kernel = _grouped_bgmv([entries], style)
    return _on_bgmv_rows([y], rows, plan.decode_slot, plan.decode_rows, kernel)[0]


# ---- the segment GEMM (hybrid on a mixed ServingPlan) -------------------------------------------

# Prefill segments a mixed step's segment GEMM covers; rows of any further segments go through
# BGMV over all the step's rows. The serving engine plans at most this many (its scheduler admits
# at most this many adapters' prompt chunks to a step), so its BGMV runs over the one-token rows
# only (`ServingPlan.decode_rows`). Each row keeps its own segment's shrink columns by a mask
# computed inside the fusion after the shrink GEMM (no per-row coefficient array).
SEGMENT_WINDOW = 16


def _stack(module_pool):
    """(a [L, slots, k, r], b [L, slots, r, n], rank [L, slots], scale [L, slots], layer) of a
    `StackedModulePool`, or of a layer's dict as a one-layer stack (layer 0)."""
    if isinstance(module_pool, StackedModulePool):
        return module_pool.a, module_pool.b, module_pool.rank, module_pool.scale, module_pool.layer
    return (module_pool["a"][None], module_pool["b"][None], module_pool["rank"][None], module_pool["scale"][None],
            jnp.int32(0))


def _window(plan: ServingPlan) -> int:
    return min(SEGMENT_WINDOW, plan.seg_slot.shape[0])


def _segment_window_arrays(module_pool, plan: ServingPlan):
    """The first `_window` segments' adapters of one projection, for every layer of the stack:
    (a [L, k, w*r] (segment s in columns s*r:(s+1)*r), b [L, w*r, n], column scale [L, w*r]
    float32: segment s's scale on its columns j < its rank, 0 elsewhere and for empty segments).

    Nothing here depends on the layer: every layer of an unrolled stack (or every iteration of a
    scan) builds the same arrays from the same operands, which XLA computes once per step (CSE,
    loop-invariant code motion); each layer then takes its static slice. Only w entries of the
    pool are read, never the whole pool."""
    w = _window(plan)
    slot = plan.seg_slot[:w]
    valid, entry = slot >= 0, jnp.maximum(slot, 0)
    a, b, rank, scale = _window_entries(module_pool, entry)  # [L, w, k, r], [L, w, r, n], [L, w] x2
    layers, _, k, r = a.shape
    a_win = jnp.swapaxes(a, 1, 2).reshape(layers, k, w * r)  # [L, w, k, r] -> [L, k, w*r]
    b_win = b.reshape(layers, w * r, b.shape[-1])
    in_rank = jnp.arange(r)[None, None, :] < rank[:, :, None]  # [L, w, r]
    column_scale = jnp.where(valid[None, :, None] & in_rank, scale[:, :, None], 0.0).astype(_F32)
    return a_win, b_win, column_scale.reshape(layers, w * r)


def _row_segments(plan: ServingPlan, num_rows: int, w: int) -> jax.Array:
    """[N] int32: the window segment (0..w-1) of each row, w for rows after the window's segments."""
    rows = jnp.arange(num_rows, dtype=jnp.int32)[:, None]
    return jnp.sum(rows >= jnp.asarray(plan.seg_starts)[None, 1: w + 1], axis=1, dtype=jnp.int32)


def _window_entries(module_pool, entry):
    """(a [L, w, k, r], b [L, w, r, n], rank [L, w], scale [L, w]) of pool entries `entry` [w]
    (a paged pool's gathered from its rows)."""
    if isinstance(module_pool, PagedModulePool):
        return paged_ops.window_entries(module_pool, entry)
    a, b, rank, scale, _ = _stack(module_pool)
    return a[:, entry], b[:, entry], rank[:, entry], scale[:, entry]


def _layer(array, layer):
    return jax.lax.dynamic_index_in_dim(array, layer, 0, keepdims=False)


def segment_accumulate_group(ys, x: jax.Array, module_pools, plan: ServingPlan, style: str | None = None) -> tuple:
    """ys [..., n_g] (the outputs of projections of one input x [..., k], in float32 or in x's
    dtype) plus their LoRA, for a mixed `ServingPlan` (prefill segments first, one-token rows
    after), each output in its own dtype:

    - the first `SEGMENT_WINDOW` prefill segments through a segment GEMM: x @ A_win [k, G*w*r]
      (the segments' own A of all G projections side by side: one GEMM), each row keeping its
      own segment's columns (scaled, rank-masked), then @ B_win [w*r, n_g] per projection;
    - every other LoRA row through the BGMV kernels: when the window holds every segment (the
      serving engine plans no more), the one-token rows only (with `decode_rows`: the kernels
      on those rows, their deltas added back by a row gather, `_on_bgmv_rows`); else in place
      over all rows, prefill rows of segments beyond the window included.

    No relayout of the pool: only the window's entries are gathered (once per step, see
    `_segment_window_arrays`). Forward only."""
    style = pallas_kernels.kernel_style(style)
    rows = x.reshape(-1, x.shape[-1])
    num_rows, w = rows.shape[0], _window(plan)
    windows = [_segment_window_arrays(pool, plan) for pool in module_pools]
    layer = module_pools[0].layer if isinstance(module_pools[0], PagedModulePool) else _stack(module_pools[0])[-1]
    a_cat = jnp.concatenate([a_win for a_win, _, _ in windows], axis=-1)  # [L, k, G*w*r]
    column_scale = jnp.concatenate([c for _, _, c in windows], axis=-1)  # [L, G*w*r]
    width = windows[0][0].shape[-1]
    column_segment = jnp.tile(jnp.arange(width, dtype=jnp.int32) // (width // w), len(windows))
    own = _row_segments(plan, num_rows, w)[:, None] == column_segment[None, :]  # [N, G*w*r], fused
    shrunk = jnp.where(own, dense(rows, _layer(a_cat, layer)) * _layer(column_scale, layer)[None], 0.0)
    deltas = []
    for g, ((_, b_win, _), y) in enumerate(zip(windows, ys)):
        b_layer = _layer(b_win, layer)
        deltas.append(jnp.dot(shrunk[:, g * width:(g + 1) * width].astype(b_layer.dtype), b_layer,
                              preferred_element_type=y.dtype))
    outs = [y.reshape(num_rows, -1) for y in ys]
    if isinstance(module_pools[0], PagedModulePool):
        kernel = _paged_bgmv(module_pools, style)
    else:
        kernel = _grouped_bgmv([_entries(pool) for pool in module_pools], style)
    if w == plan.seg_slot.shape[0]:  # the window holds every segment: BGMV on the one-token rows,
        # whose segment delta is zero (each row is rounded once), added by row after the segment deltas
        outs = _on_bgmv_rows([out + delta for out, delta in zip(outs, deltas)], rows, plan.decode_slot,
                             plan.decode_rows, kernel)
        return tuple(out.reshape(y.shape) for out, y in zip(outs, ys))
    # BGMV rows in place on y; the segment deltas are added after it, where XLA fuses the add into
    # the projection's consumers (added before it, each add was its own kernel over y: H200
    # profile, bench/NOTES_serve.md)
    outs = kernel(outs, rows, jnp.where(jnp.arange(num_rows) >= plan.seg_starts[w], plan.token_slot, -1))
    return tuple((out + delta).reshape(y.shape) for out, delta, y in zip(outs, deltas, ys))


def segment_accumulate(y: jax.Array, x: jax.Array, module_pool, plan: ServingPlan, style: str | None = None):
    """`segment_accumulate_group` for one projection."""
    return segment_accumulate_group((y,), x, (module_pool,), plan, style)[0]


def segment_delta(rows, module_pool, plan: ServingPlan, style: str | None = None):
    """The delta of `segment_accumulate` (into zeros) for rows [N, k] in the plan's order."""
    width = (module_pool.b_rows if isinstance(module_pool, PagedModulePool) else _stack(module_pool)[1]).shape[-1]
    zeros = jnp.zeros((rows.shape[0], width), _F32)
    return segment_accumulate(zeros, rows, module_pool, plan, style)


def fused_linear(rows, kernel, module_pool: dict, plan: LoraPlan, rates, seed, style: str | None = None):
    """rows @ kernel + each row's LoRA (dropout at `rates` [slots] from the hash of `seed`) in one
    fused kernel (`pallas_kernels.fused_lora_linear`): rows [N, k] grouped in the plan's adapter
    order, kernel [k, n]. Returns [N, n]."""
    return fused_lora_linear(rows, kernel, module_pool["a"], module_pool["b"], plan.seg_starts, plan.seg_slot,
                             module_pool["rank"], module_pool["scale"], rates, seed,
                             impl=pallas_kernels.kernel_style(style))
