"""Dispatch of the LoRA ops over paged adapter rows (S-LoRA unified paging): the pure-jnp
reference or the GPU-style kernels of `paged_lora_gpu` (interpret mode off a GPU).

Layout (see `paged_lora_gpu`): a_rows [R, k], b_rows [R, n] hold one rank row of an adapter per
row; row_table [E, w] int32 gives entry e's rows (row_offset + row_table[e, j], live for j <
slot_rank[e]), slot_scale [E] its scale; an adapter slot s is entry s + entry_offset. A stacked
pool of L layers is a_rows [L * P, k] with row_offset = layer * P and tables [L * slots, .] with
entry_offset = layer * slots.

`impl`: as `pallas_kernels.dispatch` (None: the device's style, "reference", "gpu"; "tpu" runs the
reference: no Mosaic kernel reads paged rows yet).
"""

import jax.numpy as jnp

from pallas_kernels import paged_lora_gpu, reference
from pallas_kernels.tile_fit import pad_axis, pad_to, round_up
from pallas_kernels.dispatch import resolve_impl
from pallas_kernels.routing import make_routing

BLOCK_ROWS = 16  # prefill rows per program
MAX_BLOCK = 128  # widest k / n block
BGMV_K_SPLITS = 4
SGMV_K_SPLITS = 8  # a 256-token step at k = 4096: 16 row tiles x 8 = 128 programs of 4 k blocks each


def _block(dim: int) -> int:
    """The k or n block: the largest power of two <= MAX_BLOCK dividing `dim`, at least 16
    (`dim` is then padded to a multiple of it)."""
    block = MAX_BLOCK
    while block > 16 and dim % block:
        block //= 2
    return block


def _width(width: int) -> int:
    """The table width the kernels take: a power of two (Triton block shapes), at least one rank
    chunk (`paged_lora_gpu.RANK_CHUNK`)."""
    return max(paged_lora_gpu.RANK_CHUNK, 1 << max(width - 1, 0).bit_length())


def _offsets(row_offset, entry_offset):
    return jnp.stack([jnp.asarray(row_offset, jnp.int32).reshape(()),
                      jnp.asarray(entry_offset, jnp.int32).reshape(())])


def _padded(x, a_rows, y, b_rows, row_table):
    """(x, a_rows padded along k; y, b_rows along n; the table to a power-of-two width;
    block_k, block_n). No copy where the sizes already fit (the engine's models)."""
    block_k, block_n = _block(x.shape[1]), _block(y.shape[1])
    table = pad_axis(row_table.astype(jnp.int32), 1, _width(row_table.shape[1]))
    return (pad_axis(x, 1, block_k), pad_axis(a_rows, 1, block_k), pad_axis(y, 1, block_n),
            pad_axis(b_rows, 1, block_n), table, block_k, block_n)


def bgmv_lora_paged(y, x, a_rows, b_rows, row_slot, row_table, slot_rank, slot_scale, row_offset=0,
                    entry_offset=0, *, impl=None):
    """Decode: y[b] += scale * (x[b] @ A_b) @ B_b, adapter b's A/B read as rows through the row
    table (module doc); rows with slot -1 untouched.

    y [B, n], x [B, k], a_rows [R, k], b_rows [R, n], row_slot int32 [B], row_table int32 [E, w],
    slot_rank int32 [E], slot_scale float32 [E] -> [B, n] (y.dtype)."""
    style, interpret = resolve_impl(impl)
    if style != "gpu":
        return reference.bgmv_paged_ref(y, x, a_rows, b_rows, row_slot, row_table, slot_rank, slot_scale,
                                        row_offset, entry_offset)
    n = y.shape[1]
    x_p, a_p, y_p, b_p, table, block_k, block_n = _padded(x, a_rows, y, b_rows, row_table)
    row_slot = row_slot.astype(jnp.int32)
    offsets = _offsets(row_offset, entry_offset)
    k_splits = min(BGMV_K_SPLITS, x_p.shape[1] // block_k)
    v = paged_lora_gpu.bgmv_paged_shrink_gpu(x_p, a_p, row_slot, table, slot_rank.astype(jnp.int32), offsets,
                                             block_k=block_k, k_splits=k_splits, interpret=interpret)
    out = paged_lora_gpu.bgmv_paged_expand_gpu(y_p, v, b_p, row_slot, table, slot_rank.astype(jnp.int32),
                                               slot_scale.astype(jnp.float32), offsets, block_n=block_n,
                                               interpret=interpret)
    return out[:, :n]


def sgmv_lora_paged(y, x, a_rows, b_rows, seg_starts, seg_slot, row_table, slot_rank, slot_scale,
                    row_offset=0, entry_offset=0, *, impl=None):
    """Prefill: y[seg] += scale * (x[seg] @ A_s) @ B_s for each segment s (seg_starts int32 [S+1],
    seg_slot int32 [S], -1: none), the adapters' A/B read as rows through the row table (module
    doc); rows of no active segment untouched. y [T, n], x [T, k] -> [T, n] (y.dtype)."""
    style, interpret = resolve_impl(impl)
    if style != "gpu":
        return reference.sgmv_paged_ref(y, x, a_rows, b_rows, seg_starts, seg_slot, row_table, slot_rank,
                                        slot_scale, row_offset, entry_offset)
    num_rows, n = y.shape
    x_p, a_p, y_p, b_p, table, block_k, block_n = _padded(x, a_rows, y, b_rows, row_table)
    x_p, y_p = pad_to(x_p, (BLOCK_ROWS, None)), pad_to(y_p, (BLOCK_ROWS, None))
    starts = jnp.clip(seg_starts.astype(jnp.int32), 0, num_rows)
    routing = make_routing(starts, round_up(num_rows, BLOCK_ROWS), BLOCK_ROWS)
    seg_slot, slot_rank = seg_slot.astype(jnp.int32), slot_rank.astype(jnp.int32)
    offsets = _offsets(row_offset, entry_offset)
    k_splits = min(SGMV_K_SPLITS, x_p.shape[1] // block_k)
    v = paged_lora_gpu.sgmv_paged_shrink_gpu(x_p, a_p, starts, seg_slot, table, slot_rank, offsets, routing,
                                             block_rows=BLOCK_ROWS, block_k=block_k, k_splits=k_splits,
                                             interpret=interpret)
    out = paged_lora_gpu.sgmv_paged_expand_gpu(y_p, v, b_p, starts, seg_slot, table, slot_rank,
                                               slot_scale.astype(jnp.float32), offsets, routing,
                                               block_rows=BLOCK_ROWS, block_n=block_n, interpret=interpret)
    return out[:num_rows, :n]
