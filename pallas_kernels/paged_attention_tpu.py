"""TPU (Pallas -> Mosaic) paged attention, the design of JAX's ragged paged attention
(`jax.experimental.pallas.ops.tpu.ragged_paged_attention`) on this repo's cache layout.

JAX's kernel wants K and V interleaved in one array [pages, page_size, 2*Hkv, Dh]; ours keeps k
and v pages apart ([pages, page_size, Hkv, Dh], or the layer stack), so wrapping it would copy
the cache every step. This kernel keeps its structure:
- grid (KV-head blocks, query blocks of `block_q` tokens); the step's metadata (row starts, the
  flattened block tables, positions, each query block's first row, the layer's page offset) is
  scalar-prefetched into SMEM;
- a program walks the rows that overlap its query block; for each row it walks the pages up to
  the last position its tokens need, `pages_per_block` pages at a time, copying them from HBM
  (the stack, at the layer's offset: read in place) into a double-buffered VMEM scratch by DMA,
  the next block's copies started before the current block is computed;
- the DMAs land K/V head-major ([heads, pages, page_size, Dh]), so one KV head's keys are one
  [pages * page_size, Dh] tile, and all G query heads of that KV head ([block_q * G, Dh]) use it;
- online softmax state (m, l, acc) per query row in VMEM; the rows of other requests in the
  query block are masked out of each update.
Simplification against JAX's kernel: no prefetch across rows or grid steps (a row's first
block is not overlapped). A row's positions must be consecutive (positions[row_start] + i, as
prefill chunks and decode tokens are). Only checked in interpret mode here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention_common import cap_scores, check_shapes, flat_layer_pages, window_array

_F32 = jnp.float32
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_LANES = 128


def heads_per_block(kv_heads: int, group: int, dtype) -> int:
    """KV heads per program: the fewest whose G query heads fill whole sublane tiles (8 rows,
    16 for 16-bit q), else all of them (a full dimension is always a legal block)."""
    sublanes = 8 * (4 // jnp.dtype(dtype).itemsize)
    for count in range(1, kv_heads + 1):
        if kv_heads % count == 0 and (count * group) % sublanes == 0:
            return count
    return kv_heads


def _row_span(r, q0, block_q, bounds, positions, max_keys):
    """(start, end, first position, keys) of row r's tokens inside query block q0..q0+block_q:
    keys = how many cache positions those tokens see (0 if none of them is in the block)."""
    row_start, row_end = bounds[r], bounds[r + 1]
    start, end = jnp.maximum(row_start, q0), jnp.minimum(row_end, q0 + block_q)
    first = positions[jnp.minimum(row_start, positions.shape[0] - 1)]
    keys = jnp.where(end > start, jnp.minimum(first + end - row_start, max_keys), 0)
    return start, end, first - row_start, keys


def _copies(r, kb, slot, keys, tables, offset, k_hbm, v_hbm, k_buf, v_buf, sems, *, pages_per_row,
            head0, heads):
    """DMA descriptors of KV block kb of row r into buffer `slot`: per page and KV head one
    [page_size, Dh] copy. Pages past the row's need copy the row's first page (masked later)."""
    page_size, pages_per_block = k_hbm.shape[1], k_buf.shape[2]
    needed = (keys + page_size - 1) // page_size
    copies = []
    for i in range(pages_per_block):
        index = kb * pages_per_block + i
        page = tables[r * pages_per_row + jnp.where(index < needed, index, 0)] + offset
        for j in range(heads):
            copies.append(pltpu.make_async_copy(k_hbm.at[page, :, head0 + j, :], k_buf.at[slot, j, i],
                                                sems.at[slot, 0]))
            copies.append(pltpu.make_async_copy(v_hbm.at[page, :, head0 + j, :], v_buf.at[slot, j, i],
                                                sems.at[slot, 1]))
    return copies


def _update(j, q_ref, k, v, m_ref, l_ref, acc_ref, *, keys0, keys, q0, start, end, shift, group,
            sm_scale, precision, softcap, window):
    """Online-softmax update of KV head j's query rows with keys keys0.. (k, v [bk, Dh]); only
    the rows of tokens start..end-1 (one request) change."""
    block_q = q_ref.shape[0]
    q = q_ref[:, j * group:(j + 1) * group, :].reshape(block_q * group, q_ref.shape[-1])
    key_pos = keys0 + lax.broadcasted_iota(jnp.int32, (k.shape[0], 1), 0)
    k = jnp.where(key_pos < keys, k, 0).astype(q.dtype)  # slots past the row may hold anything
    v = jnp.where(key_pos < keys, v, 0).astype(q.dtype)
    token = q0 + lax.broadcasted_iota(jnp.int32, (q.shape[0], 1), 0) // group
    in_row = (token >= start) & (token < end)
    key_row = keys0 + lax.broadcasted_iota(jnp.int32, (1, k.shape[0]), 1)
    visible = in_row & (key_row <= token + shift) & (key_row < keys) & (token + shift - key_row < window)
    s = cap_scores(jnp.einsum("md,kd->mk", q, k, preferred_element_type=_F32, precision=precision) * sm_scale,
                   softcap)
    s = jnp.where(visible, s, MASK_VALUE)
    m_prev, l_prev = m_ref[j][:, :1], l_ref[j][:, :1]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(visible, jnp.exp(s - m_next), 0.0)
    l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    acc = alpha * acc_ref[j] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=_F32, precision=precision)
    m_ref[j] = jnp.where(in_row, jnp.broadcast_to(m_next, m_ref.shape[1:]), m_ref[j])
    l_ref[j] = jnp.where(in_row, jnp.broadcast_to(l_next, l_ref.shape[1:]), l_ref[j])
    acc_ref[j] = jnp.where(in_row, acc, acc_ref[j])


def _kernel(bounds, first_row, tables, positions, layer, q_ref, k_hbm, v_hbm, o_ref,
            k_buf, v_buf, sems, m_ref, l_ref, acc_ref, *, group, pages_per_row, layer_pages, sm_scale, precision,
            softcap):
    head_block, q_block = pl.program_id(0), pl.program_id(1)
    block_q, heads = q_ref.shape[0], k_buf.shape[1]
    num_rows = bounds.shape[0] - 1
    q0 = q_block * block_q
    page_size, pages_per_block = k_hbm.shape[1], k_buf.shape[2]
    block_keys = page_size * pages_per_block
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, _F32)
    l_ref[...] = jnp.zeros(l_ref.shape, _F32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)
    copy = functools.partial(_copies, tables=tables, offset=layer[0] * layer_pages, k_hbm=k_hbm, v_hbm=v_hbm,
                             k_buf=k_buf, v_buf=v_buf, sems=sems, pages_per_row=pages_per_row,
                             head0=head_block * heads, heads=heads)

    def row_body(r):
        start, end, shift, keys = _row_span(r, q0, block_q, bounds, positions, pages_per_row * page_size)
        num_blocks = (keys + block_keys - 1) // block_keys

        @pl.when(num_blocks > 0)
        def _():
            for c in copy(r, 0, 0, keys):
                c.start()

        def kv_body(kb, carry):
            slot = kb % 2

            @pl.when(kb + 1 < num_blocks)
            def _():
                for c in copy(r, kb + 1, 1 - slot, keys):
                    c.start()

            for c in copy(r, kb, slot, keys):
                c.wait()
            for j in range(heads):
                k = k_buf[slot, j].reshape(block_keys, k_buf.shape[-1])
                v = v_buf[slot, j].reshape(block_keys, v_buf.shape[-1])
                _update(j, q_ref, k, v, m_ref, l_ref, acc_ref, keys0=kb * block_keys, keys=keys, q0=q0,
                        start=start, end=end, shift=shift, group=group, sm_scale=sm_scale, precision=precision,
                        softcap=softcap, window=layer[1])
            return carry

        lax.fori_loop(0, num_blocks, kv_body, 0)
        return r + 1

    lax.while_loop(lambda r: (r < num_rows) & (bounds[jnp.minimum(r, num_rows)] < q0 + block_q), row_body,
                   first_row[q_block])
    for j in range(heads):
        l = l_ref[j][:, :1]
        out = acc_ref[j] / jnp.where(l > 0, l, 1.0)
        o_ref[:, j * group:(j + 1) * group, :] = out.reshape(block_q, group, -1).astype(o_ref.dtype)


def paged_attention_tpu(q, k_pages, v_pages, block_tables, row_starts, positions, *, layer=None,
                        sm_scale=None, interpret=False, block_q: int = 32, pages_per_block: int | None = None,
                        softcap=None, window=None):
    """Paged attention (contract of `pallas_kernels.paged_attention.paged_attention`) in one
    Mosaic launch. block_q: tokens per query block (T is padded to a multiple);
    pages_per_block: pages per KV block (None: 128 keys' worth, at most the table's width)."""
    group, kv_heads = check_shapes(q, k_pages, v_pages, block_tables, row_starts, positions)
    tokens, heads, head_dim = q.shape
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    k_flat, v_flat, layer, layer_pages = flat_layer_pages(k_pages, v_pages, layer)
    layer = jnp.concatenate([layer, window_array(window)])  # scalar prefetch [layer, window]
    num_rows, pages_per_row = block_tables.shape
    page_size = k_flat.shape[1]
    pages_per_block = min(pages_per_block or max(1, 128 // page_size), pages_per_row)
    padded = -(-tokens // block_q) * block_q
    q_pad = jnp.pad(q, ((0, padded - tokens), (0, 0), (0, 0)))
    positions = jnp.pad(positions, (0, padded - tokens))
    starts = jnp.arange(0, padded, block_q, dtype=jnp.int32)
    first_row = jnp.minimum(jnp.searchsorted(row_starts, starts, side="right") - 1, num_rows).astype(jnp.int32)
    first_row = jnp.maximum(first_row, 0)
    kv_block = heads_per_block(kv_heads, group, q.dtype)
    q_spec = pl.BlockSpec((block_q, kv_block * group, head_dim), lambda hb, qb, *_: (qb, hb, 0))
    buf = pltpu.VMEM((2, kv_block, pages_per_block, page_size, head_dim), k_flat.dtype)
    state = pltpu.VMEM((kv_block, block_q * group, _LANES), _F32)
    kernel = functools.partial(_kernel, group=group, pages_per_row=pages_per_row, layer_pages=layer_pages,
                               sm_scale=sm_scale, softcap=softcap,
                               precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)
    out = pl.pallas_call(
        kernel,
        name="paged_attention_tpu",
        out_shape=jax.ShapeDtypeStruct(q_pad.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(kv_heads // kv_block, padded // block_q),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_spec,
            scratch_shapes=[buf, buf, pltpu.SemaphoreType.DMA((2, 2)), state, state,
                            pltpu.VMEM((kv_block, block_q * group, head_dim), _F32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(row_starts, first_row, block_tables.reshape(-1), positions, layer, q_pad, k_flat, v_flat)
    return out[:tokens]
