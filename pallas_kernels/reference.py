"""Pure-jnp reference implementations of the SGMV / BGMV ops (the test oracle).

Plain per-row gather + einsum in float32 (HIGHEST precision): clear rather than fast; it
materialises one [k, r_max] adapter slice per row. Semantics shared by every implementation:

- slot -1 means "base model only": those rows get a zero shrink result and `y` untouched;
- columns >= rank of A (rows >= rank of B) are treated as zero;
- rows outside [seg_starts[0], seg_starts[S]) are padding: zero delta, `y` untouched.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.routing import row_segments

_HIGHEST = jax.lax.Precision.HIGHEST


def _rank_mask(row_slot: jax.Array, row_rank: jax.Array, r_max: int) -> jax.Array:
    """[B, r_max] bool: column c is live for row b (slot >= 0 and c < rank)."""
    cols = jnp.arange(r_max, dtype=jnp.int32)
    return (row_slot[:, None] >= 0) & (cols[None, :] < row_rank[:, None])


def bgmv_shrink_ref(x, lora_a, row_slot, row_rank):
    """v[b] = x[b] @ A[slot[b]][:, :rank[b]] (zero-padded to r_max).

    x [B, k], lora_a [slots, k, r_max], row_slot/row_rank int32 [B] -> v [B, r_max] (x.dtype).
    """
    a_rows = lora_a[jnp.maximum(row_slot, 0)].astype(jnp.float32)
    v = jnp.einsum("bk,bkr->br", x.astype(jnp.float32), a_rows, precision=_HIGHEST)
    live = _rank_mask(row_slot, row_rank, lora_a.shape[-1])
    return jnp.where(live, v, 0.0).astype(x.dtype)


def bgmv_expand_ref(y, v, lora_b, row_slot, row_rank, row_scale):
    """y[b] += scale[b] * v[b, :rank] @ B[slot[b]][:rank]; rows with slot -1 untouched.

    y [B, n], v [B, r_max], lora_b [slots, r_max, n], row_slot/row_rank int32 [B],
    row_scale float32 [B] -> [B, n] (y.dtype).
    """
    live = _rank_mask(row_slot, row_rank, lora_b.shape[1])
    v32 = jnp.where(live, v.astype(jnp.float32), 0.0)
    b_rows = jnp.where(live[:, :, None], lora_b[jnp.maximum(row_slot, 0)].astype(jnp.float32), 0.0)
    delta = jnp.einsum("br,brn->bn", v32, b_rows, precision=_HIGHEST)
    out = y.astype(jnp.float32) + row_scale[:, None].astype(jnp.float32) * delta
    return jnp.where(row_slot[:, None] >= 0, out.astype(y.dtype), y)


def row_adapters(seg_starts, seg_slot, seg_rank, seg_scale, num_rows: int):
    """Per-row (slot, rank, scale) from segment metadata; padding rows get slot -1, scale 0."""
    seg, valid = row_segments(seg_starts, num_rows)
    row_slot = jnp.where(valid, seg_slot[seg], -1).astype(jnp.int32)
    row_rank = jnp.where(valid, seg_rank[seg], 0).astype(jnp.int32)
    row_scale = jnp.where(valid & (row_slot >= 0), seg_scale[seg], 0.0).astype(jnp.float32)
    return row_slot, row_rank, row_scale


def sgmv_shrink_ref(x, lora_a, seg_starts, seg_slot, seg_rank):
    """v[seg] = x[seg] @ A[slot] (rank-masked). x [T, k] -> v [T, r_max] (x.dtype)."""
    scale = jnp.zeros(seg_slot.shape, jnp.float32)
    row_slot, row_rank, _ = row_adapters(seg_starts, seg_slot, seg_rank, scale, x.shape[0])
    return bgmv_shrink_ref(x, lora_a, row_slot, row_rank)


def sgmv_expand_ref(y, v, lora_b, seg_starts, seg_slot, seg_rank, seg_scale):
    """y[seg] += scale * v[seg] @ B[slot] (rank-masked). y [T, n], v [T, r_max] -> [T, n]."""
    row_slot, row_rank, row_scale = row_adapters(
        seg_starts, seg_slot, seg_rank, seg_scale, y.shape[0]
    )
    return bgmv_expand_ref(y, v, lora_b, row_slot, row_rank, row_scale)


def sgmv_lora_delta_ref(x, lora_a, lora_b, seg_starts, seg_slot, seg_rank, seg_scale):
    """delta[seg] = scale * (x[seg] @ A[slot]) @ B[slot]; x [T, k] -> [T, n] (x.dtype).

    Differentiable with plain jax autodiff (the oracle for the kernels' custom_vjp).
    """
    v = sgmv_shrink_ref(x, lora_a, seg_starts, seg_slot, seg_rank)
    y = jnp.zeros((x.shape[0], lora_b.shape[-1]), x.dtype)
    return sgmv_expand_ref(y, v, lora_b, seg_starts, seg_slot, seg_rank, seg_scale)


def segment_outer_ref(lhs, rhs, seg_starts, seg_slot, seg_rank, rank_axis: int):
    """out[s] = lhs[seg s]^T @ rhs[seg s] in float32, zero for slot -1 segments and at
    indices >= the segment's rank along `rank_axis` (0: p, 1: q).

    lhs [T, p], rhs [T, q] -> [S, p, q] (the per-segment A/B gradients).
    """
    num_rows, num_segments = lhs.shape[0], seg_slot.shape[0]
    seg, valid = row_segments(seg_starts, num_rows)
    scale = jnp.zeros(seg_slot.shape, jnp.float32)
    row_slot, row_rank, _ = row_adapters(seg_starts, seg_slot, seg_rank, scale, num_rows)
    lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
    if rank_axis == 0:
        lhs = jnp.where(_rank_mask(row_slot, row_rank, lhs.shape[1]), lhs, 0.0)
    else:
        rhs = jnp.where(_rank_mask(row_slot, row_rank, rhs.shape[1]), rhs, 0.0)
    onehot = (seg[:, None] == jnp.arange(num_segments)) & (valid & (row_slot >= 0))[:, None]
    return jnp.einsum("ts,tp,tq->spq", onehot.astype(jnp.float32), lhs, rhs, precision=_HIGHEST)


# ---- paged adapter rows (S-LoRA unified paging): adapter weights as rows found by a row table ----

def paged_rows(row_slot, row_table, slot_rank, row_offset, entry_offset):
    """(row ids [B, w], live [B, w]) of rows with adapter slots `row_slot` [B] (-1: none): entry
    e = slot + entry_offset, its rows row_offset + row_table[e, :rank[e]] (live), the rest masked."""
    valid = row_slot >= 0
    entry = jnp.maximum(row_slot, 0) + entry_offset
    width = row_table.shape[1]
    rank = jnp.where(valid, jnp.clip(slot_rank[entry], 0, width), 0)
    live = jnp.arange(width, dtype=jnp.int32)[None, :] < rank[:, None]
    return row_offset + row_table[entry], live


def bgmv_paged_ref(y, x, a_rows, b_rows, row_slot, row_table, slot_rank, slot_scale,
                   row_offset=0, entry_offset=0):
    """y[b] += scale[e] * sum_{j < rank[e]} (x[b] . A_rows[r_j]) B_rows[r_j], with e = slot[b] +
    entry_offset and r_j = row_offset + row_table[e, j]; rows with slot -1 untouched.

    y [B, n], x [B, k], a_rows [R, k], b_rows [R, n], row_slot int32 [B], row_table int32
    [E, w], slot_rank int32 [E], slot_scale float32 [E] -> [B, n] (y.dtype)."""
    rows, live = paged_rows(row_slot, row_table, slot_rank, row_offset, entry_offset)
    a = a_rows[rows].astype(jnp.float32)  # [B, w, k]
    v = jnp.einsum("bk,bwk->bw", x.astype(jnp.float32), a, precision=_HIGHEST)
    v = jnp.where(live, v, 0.0)
    delta = jnp.einsum("bw,bwn->bn", v, b_rows[rows].astype(jnp.float32), precision=_HIGHEST)
    scale = slot_scale[jnp.maximum(row_slot, 0) + entry_offset].astype(jnp.float32)
    out = (y.astype(jnp.float32) + scale[:, None] * delta).astype(y.dtype)
    return jnp.where(row_slot[:, None] >= 0, out, y)


def sgmv_paged_ref(y, x, a_rows, b_rows, seg_starts, seg_slot, row_table, slot_rank, slot_scale,
                   row_offset=0, entry_offset=0):
    """`bgmv_paged_ref` with each row's slot from its segment (seg_starts [S+1], seg_slot [S]);
    rows of no segment (padding) untouched. y [T, n], x [T, k] -> [T, n] (y.dtype)."""
    seg, valid = row_segments(seg_starts, x.shape[0])
    row_slot = jnp.where(valid, seg_slot[seg], -1).astype(jnp.int32)
    return bgmv_paged_ref(y, x, a_rows, b_rows, row_slot, row_table, slot_rank, slot_scale,
                          row_offset, entry_offset)
