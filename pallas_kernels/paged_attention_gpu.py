"""GPU (Pallas -> Triton) paged attention: decode rows and prefill chunks in one launch.

Work split (as vLLM's Triton unified attention and FlashInfer do, with two tile heights):
- one program per (work item, KV head, KV split); a work item is a tile of one row's tokens and
  the program handles all G query heads of its KV head, so each K/V page is read once per
  (tile, KV head) and never repeated per query head;
- short rows (<= `block_q_small` tokens: decode rows) get one small tile of
  M = block_q_small * G query rows (>= 16, Triton's smallest dot: a decode row fills G of them,
  the rest are masked); longer rows (prefill chunks) get tiles of `block_q` tokens (M = 64 by
  default), so a chunk's pages are re-read once per 64 query rows, not once per 16. Steps of at
  most 4 tokens per row use the small tile for both (the large tile's registers and shared
  memory would cut the decode programs' occupancy, bench/NOTES_paged_attention.md);
- each program walks the keys 0..(its last token's position) of its split in blocks of
  `block_kv` keys with online softmax (base 2); a key's page comes from the block table
  (`page = block_tables[row, key // page_size]`, the next block's ids loaded one iteration
  ahead) and K/V rows are loaded straight from the pages (a pointer gather inside the kernel:
  no contiguous copy of the row's pages); the trip count is dynamic, so no work is done past a
  row's length;
- KV splits (flash-decoding) cut every row's keys into fixed spans of `split_kv` keys, so a
  decode step of few rows still fills the GPU and the longest row does not set the time; the
  partial outputs (float32, with their log-sum-exp) are merged by a small XLA reduction (or, with
  merge="kernel", by the tile's last split). One split writes the output directly.

The small-tile items are rows 0..R (R: a pseudo-row covering the padding tokens, which get
zeros); the large-tile items come from a work list built per call (`tile_work_list`, a few tiny
XLA ops on [R+2] ints, the same for every layer of a step). The stacked cache is reshaped to
[L*num_pages, ...] (a bitcast) and the kernel adds layer * num_pages to each page id; Pallas
switches address arithmetic to 64 bits when an array exceeds 4 GiB. Measurements:
bench/NOTES_paged_attention.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.paged_attention_common import cap_scores, check_shapes, flat_layer_pages, window_array

_F32 = jnp.float32
_LOG2E = math.log2(math.e)
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class PagedBlocks:
    """Tiles of the GPU kernel (defaults: the fastest in bench/NOTES_paged_attention.md).

    block_q_small: tokens of a short-row tile (None: 16 // G, at least 1; M = block_q_small * G
    >= 16). block_q: tokens of a long-row tile (None: block_q_small when the step has at most 4
    tokens per row, i.e. mostly decode rows, so the kernel's registers and shared memory stay
    those of the small tile; else 64 // G). block_kv: keys per inner iteration. num_splits: KV
    splits (None: `default_splits`); split_kv: keys per split (None: the table's span / splits).
    prefetch_pages: load the next block's page ids one iteration ahead. merge: "xla" (a small XLA
    reduction merges the splits) or "kernel" (the last split of a tile merges them, counted with
    an atomic; saves the XLA launches, costs a zeroed count array).
    """

    block_q: int | None = None
    block_q_small: int | None = None
    block_kv: int = 64
    num_splits: int | None = None
    split_kv: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    prefetch_pages: bool = True
    merge: str = "xla"


def default_splits(tokens: int, rows: int, kv_heads: int, span: int, block_kv: int) -> int:
    """KV splits for a step shape: about 512 programs when the step is mostly decode rows (the
    fastest split counts on the 8B shape, bench/NOTES_paged_attention.md), none when it carries
    many tokens (the float32 partials would cost more than they save)."""
    if tokens > 4 * max(rows, 1) or tokens > 1024:
        return 1
    splits = max(1, 512 // max(rows * kv_heads, 1))
    splits = min(splits, max(1, span // (4 * block_kv)))  # splits of >= 4 blocks
    return 1 << (splits.bit_length() - 1)


def _tile_sizes(blocks: PagedBlocks, group: int, tokens: int, rows: int) -> tuple[int, int]:
    """(small, large) tile heights in tokens (see `PagedBlocks`)."""
    small = blocks.block_q_small or max(1, 16 // group)
    mostly_decode = tokens <= 4 * (rows + 1)
    large = max(small, blocks.block_q or (small if mostly_decode else max(1, 64 // group)))
    for size in (small, large):
        if size & (size - 1) or size * group < 16:
            raise ValueError(f"tiles need power-of-two tokens with tokens * G >= 16; got {size} * {group}")
    return small, large


def tile_work_list(row_starts, tokens: int, small: int, large: int):
    """Large-tile work items: (item_row, item_tile) int32 [NB] each (item_row -1: no work).

    Rows 0..R-1 are the step's rows and row R the padding tokens [row_starts[R], T); rows longer
    than `small` tokens get ceil(len / large) items. NB = T // large + min(R+1, T // (small+1))
    bounds the count for any row layout.
    """
    bounds = jnp.concatenate([row_starts, jnp.full((1,), tokens, jnp.int32)])
    lengths = bounds[1:] - bounds[:-1]
    tiles = jnp.where(lengths > small, (lengths + large - 1) // large, 0)
    ends = jnp.cumsum(tiles)
    count = max(1, tokens // large + min(row_starts.shape[0], tokens // (small + 1)))
    item = jnp.arange(count, dtype=jnp.int32)
    row = jnp.minimum(jnp.searchsorted(ends, item, side="right"), lengths.shape[0] - 1).astype(jnp.int32)
    tile = item - (ends[row] - tiles[row])
    return jnp.where(item < ends[-1], row, -1), tile, bounds


def _tile_queries(q_ref, pos_ref, start, end, kv_head, tile: int, group: int):
    """Query rows of a tile: (tokens [M], heads [M], valid [M], q [M, Dh], positions [M]) with
    M = tile * group; row m is token start + m // group, query head kv_head * group + m % group.
    Positions are -1 past the row's end (those rows see no key and are not stored)."""
    m = jnp.arange(tile * group, dtype=jnp.int32)
    token = start + m // group
    head = kv_head * group + m % group
    valid = token < end
    dims = jnp.arange(q_ref.shape[-1], dtype=jnp.int32)
    q = plt.load(q_ref.at[token[:, None], head[:, None], dims[None, :]], mask=valid[:, None], other=0)
    pos = plt.load(pos_ref.at[token], mask=valid, other=-1)
    return token, head, valid, q, pos


def _load_kv(ref, pages, slots, kv_head, live):
    """K or V rows [bk, Dh] of keys at (pages, slots) of one KV head; zeros where not live."""
    dims = jnp.arange(ref.shape[-1], dtype=jnp.int32)
    return plt.load(ref.at[pages[:, None], slots[:, None], kv_head, dims[None, :]],
                    mask=live[:, None], other=0)


def _attend(q, pos, row, lo, hi, kv_head, bt_ref, layer_ref, k_ref, v_ref, *, layer_pages, sm_scale, blocks,
            precision, softcap):
    """Online softmax of q [M, Dh] over keys lo..hi-1 of `row` (key j visible to query row m iff
    j <= pos[m] and pos[m] - j < window, the window being layer_ref[1]). Returns (acc [M, Dh] f32 unnormalized, m [M] base-2 max, l [M] sum).
    With blocks.prefetch_pages the next block's page ids are loaded one iteration ahead (the
    K/V addresses of an iteration then depend on no load of that iteration)."""
    page_size, pages_per_row = k_ref.shape[1], bt_ref.shape[1]
    block_kv, scale = blocks.block_kv, sm_scale * _LOG2E
    offset = layer_ref[0] * layer_pages  # the layer's first page in the flat stack
    window = layer_ref[1]

    def block_keys(i):
        keys = lo + i * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
        return keys, keys < hi

    def page_ids(i):
        keys, live = block_keys(i)
        page_index = jnp.minimum(keys // page_size, pages_per_row - 1)
        return plt.load(bt_ref.at[row, page_index], mask=live, other=0) + offset

    def body(i, carry):
        acc, m_prev, l_prev, pages = carry
        keys, live = block_keys(i)
        if blocks.prefetch_pages:
            next_pages = page_ids(i + 1)
        else:
            pages, next_pages = page_ids(i), pages
        slots = keys % page_size
        k = _load_kv(k_ref, pages, slots, kv_head, live).astype(q.dtype)
        v = _load_kv(v_ref, pages, slots, kv_head, live).astype(q.dtype)
        s = jnp.dot(q, k.T, preferred_element_type=_F32, precision=precision)
        s = s * scale if softcap is None else cap_scores(s * sm_scale, softcap) * _LOG2E
        visible = (keys[None, :] <= pos[:, None]) & live[None, :] & (pos[:, None] - keys[None, :] < window)
        s = jnp.where(visible, s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_prev - m_next)
        p = jnp.where(visible, jnp.exp2(s - m_next[:, None]), 0.0)
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=_F32,
                                             precision=precision)
        return acc, m_next, l_next, next_pages

    rows, head_dim = q.shape
    first_pages = page_ids(0) if blocks.prefetch_pages else jnp.zeros((block_kv,), jnp.int32)
    init = (jnp.zeros((rows, head_dim), _F32), jnp.full((rows,), MASK_VALUE, _F32), jnp.zeros((rows,), _F32),
            first_pages)
    trips = jnp.maximum(hi - lo + block_kv - 1, 0) // block_kv
    return lax.fori_loop(0, trips, body, init)[:3]


def _tile(row, start, end, item, kv_head, split, refs, out_refs, *, tile, group, split_kv, splits, layer_pages,
          sm_scale, blocks, precision, interpret, softcap):
    """One program's tile: tokens start..min(start + tile, end) - 1 of `row`, one KV head, one
    KV split; writes the output (one split), or the split's partial output and log-sum-exp (and,
    with the in-kernel merge, the last split of the tile to finish merges them)."""
    bounds_ref, pos_ref, bt_ref, layer_ref, q_ref, k_ref, v_ref = refs
    num_rows = bt_ref.shape[0]
    token, head, valid, q, pos = _tile_queries(q_ref, pos_ref, start, end, kv_head, tile, group)
    span = jnp.minimum(jnp.max(pos) + 1, bt_ref.shape[1] * k_ref.shape[1])
    span = jnp.where(row < num_rows, span, 0)  # the padding pseudo-row reads no page
    # keys before the tile's earliest window start are never visible: skip them (window: layer_ref[1])
    first_visible = jnp.min(jnp.where(valid, pos, jnp.iinfo(jnp.int32).max)) - layer_ref[1] + 1
    lo = jnp.maximum(split * split_kv, first_visible)
    hi = jnp.minimum(split * split_kv + split_kv, span)
    acc, m, l = _attend(q, pos, row, lo, hi, kv_head, bt_ref, layer_ref, k_ref, v_ref, layer_pages=layer_pages,
                        sm_scale=sm_scale, blocks=blocks, precision=precision, softcap=softcap)
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    at = lambda ref, *lead: ref.at[(*lead, token[:, None], head[:, None], _dims(q)[None, :])]
    if splits == 1:
        (o_ref,) = out_refs
        plt.store(at(o_ref), out.astype(o_ref.dtype), mask=valid[:, None])
        return
    o_ref, part_ref, lse_ref, *count_ref = out_refs
    plt.store(at(part_ref, split), out, mask=valid[:, None])
    lse = jnp.where(l > 0, m + jnp.log2(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    plt.store(lse_ref.at[split, token, head], lse, mask=valid)
    if not count_ref:
        return
    if not interpret:
        plt.debug_barrier()  # every thread's partial stores before the (releasing) count
    done = plt.atomic_add(count_ref[0], (item, kv_head), jnp.ones((), jnp.int32))

    @pl.when(done == splits - 1)
    def _merge():
        lses = [plt.load(lse_ref.at[s, token, head], mask=valid, other=-jnp.inf) for s in range(splits)]
        top = functools.reduce(jnp.maximum, lses)
        top = jnp.where(top == -jnp.inf, 0.0, top)
        total, merged = jnp.zeros_like(top), jnp.zeros_like(out)
        for s in range(splits):
            weight = jnp.where(lses[s] == -jnp.inf, 0.0, jnp.exp2(lses[s] - top))
            part = plt.load(at(part_ref, s), mask=valid[:, None], other=0.0)
            total, merged = total + weight, merged + weight[:, None] * part
        merged = merged / jnp.where(total > 0, total, 1.0)[:, None]
        plt.store(at(o_ref), merged.astype(o_ref.dtype), mask=valid[:, None])


def _dims(q):
    return jnp.arange(q.shape[-1], dtype=jnp.int32)


def _kernel(item_row_ref, item_tile_ref, *refs, small, large, num_outputs, **kw):
    """Grid (large items + R + 1 small items, Hkv, splits): large-tile items first (the longest
    programs start first), then one small tile per row (rows longer than `small` skip it)."""
    refs, out_refs = refs[:-num_outputs], refs[-num_outputs:]
    refs = refs[:-1] if len(refs) == 8 else refs  # the aliased zero counts arrive as an input too
    bounds_ref = refs[0]
    item, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_large = item_row_ref.shape[0]

    @pl.when(item < num_large)
    def _large():
        row = item_row_ref[jnp.minimum(item, num_large - 1)]
        tile = item_tile_ref[jnp.minimum(item, num_large - 1)]
        safe = jnp.maximum(row, 0)
        start, end = bounds_ref[safe] + tile * large, bounds_ref[safe + 1]

        @pl.when(row >= 0)
        def _():
            _tile(safe, start, end, item, kv_head, split, refs, out_refs, tile=large, **kw)

    @pl.when(item >= num_large)
    def _small():
        row = item - num_large
        start, end = bounds_ref[row], bounds_ref[row + 1]

        @pl.when((end > start) & (end - start <= small))
        def _():
            _tile(row, start, end, item, kv_head, split, refs, out_refs, tile=small, **kw)


def merge_splits(partial, lse, dtype):
    """Merges split outputs: partial [S, T, H, Dh] f32 (each normalized by its own sum), lse
    [S, T, H] base 2 (-inf: the split saw no key) -> [T, H, Dh] in dtype (zeros where none did)."""
    top = jnp.max(lse, axis=0)
    weight = jnp.where(lse == -jnp.inf, 0.0, jnp.exp2(lse - jnp.where(top == -jnp.inf, 0.0, top)))
    total = jnp.sum(weight, axis=0)
    out = jnp.einsum("sth,sthd->thd", weight, partial) / jnp.where(total > 0, total, 1.0)[..., None]
    return out.astype(dtype)


def paged_attention_gpu(q, k_pages, v_pages, block_tables, row_starts, positions, *, layer=None,
                        sm_scale=None, interpret=False, blocks: PagedBlocks | None = None, softcap=None, window=None):
    """Paged attention (contract of `pallas_kernels.paged_attention.paged_attention`) as one
    Triton launch (+ a small XLA merge when KV splits are used, unless blocks.merge == "kernel").
    Dh must be a power of two >= 16 and G a power of two."""
    blocks = blocks or PagedBlocks()
    group, kv_heads = check_shapes(q, k_pages, v_pages, block_tables, row_starts, positions)
    tokens, heads, head_dim = q.shape
    if head_dim & (head_dim - 1) or head_dim < 16 or group & (group - 1):
        raise ValueError(f"the GPU kernel needs a power-of-two head_dim >= 16 and G; got {head_dim}, {group}")
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    k_flat, v_flat, layer, layer_pages = flat_layer_pages(k_pages, v_pages, layer)
    layer = jnp.concatenate([layer, window_array(window)])  # [layer, window]
    num_rows, pages_per_row = block_tables.shape
    span = pages_per_row * k_flat.shape[1]
    small, large = _tile_sizes(blocks, group, tokens, num_rows)
    splits = blocks.num_splits or default_splits(tokens, num_rows, kv_heads, span, blocks.block_kv)
    split_kv = blocks.split_kv or -(-span // splits // blocks.block_kv) * blocks.block_kv
    splits = -(-span // split_kv)
    item_row, item_tile, bounds = tile_work_list(row_starts, tokens, small, large)
    num_items = item_row.shape[0] + num_rows + 1
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    extra, aliases = [], {}
    if splits > 1:
        out_shape += [jax.ShapeDtypeStruct((splits, *q.shape), _F32),
                      jax.ShapeDtypeStruct((splits, tokens, heads), _F32)]
    in_kernel = splits > 1 and blocks.merge == "kernel"
    if in_kernel:  # per (item, KV head): how many splits have finished
        extra, aliases = [jnp.zeros((num_items, kv_heads), jnp.int32)], {9: 3}
        out_shape.append(jax.ShapeDtypeStruct((num_items, kv_heads), jnp.int32))
    kernel = functools.partial(_kernel, small=small, large=large, num_outputs=len(out_shape), group=group,
                               split_kv=split_kv, splits=splits, layer_pages=layer_pages, sm_scale=sm_scale,
                               blocks=blocks, softcap=softcap,
                               precision=precision, interpret=bool(interpret))
    outs = pl.pallas_call(
        kernel,
        name="paged_attention",
        out_shape=out_shape,
        grid=(num_items, kv_heads, splits),
        input_output_aliases=aliases,
        compiler_params=plt.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
    )(item_row, item_tile, bounds, positions, block_tables, layer, q, k_flat, v_flat, *extra)
    if splits == 1 or in_kernel:
        return outs[0]
    return merge_splits(outs[1], outs[2], q.dtype)
