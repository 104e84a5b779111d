"""What the paged-attention kernels share (`pallas_kernels.paged_attention` and its GPU and TPU
kernels `paged_attention_gpu`, `paged_attention_tpu`): shape checks, the flat view of a stacked
cache, each token's row, and the window and soft-cap inputs. Kept apart so that the kernels and the
entry point import it rather than each other (no import cycle)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def flat_layer_pages(k_pages, v_pages, layer):
    """(k, v [L*num_pages, page_size, Hkv, Dh], layer int32 [1], num_pages): the stack's reshape
    (a bitcast, not a copy), the layer index (0 for one layer's pages) and the pages per layer;
    the kernels read page `layer * num_pages + id` of the flat stack."""
    if k_pages.ndim == 4:
        if layer is not None:
            raise ValueError("layer is given, but the pages are one layer's [num_pages, page_size, Hkv, Dh]")
        return k_pages, v_pages, jnp.zeros((1,), jnp.int32), k_pages.shape[0]
    if layer is None:
        raise ValueError("a stacked cache [L, num_pages, page_size, Hkv, Dh] needs `layer`")
    num_layers, num_pages = k_pages.shape[:2]
    flat = lambda pages: pages.reshape(num_layers * num_pages, *pages.shape[2:])
    return flat(k_pages), flat(v_pages), jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), num_pages


def check_shapes(q, k_pages, v_pages, block_tables, row_starts, positions):
    """Raises ValueError on inconsistent shapes; returns (G, Hkv)."""
    tokens, heads, head_dim = q.shape
    kv_heads = k_pages.shape[-2]
    if k_pages.shape != v_pages.shape or k_pages.shape[-1] != head_dim:
        raise ValueError(f"k/v pages {k_pages.shape}/{v_pages.shape} do not match q {q.shape}")
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} must be a multiple of KV heads {kv_heads}")
    if row_starts.shape != (block_tables.shape[0] + 1,) or positions.shape != (tokens,):
        raise ValueError(f"row_starts {row_starts.shape} / positions {positions.shape} do not match "
                         f"block_tables {block_tables.shape} / q {q.shape}")
    return heads // kv_heads, kv_heads


def token_rows(row_starts, tokens: int):
    """[T] int32: each token's row, R for padding tokens (index >= row_starts[R])."""
    index = jnp.arange(tokens, dtype=jnp.int32)
    row = jnp.searchsorted(row_starts, index, side="right").astype(jnp.int32) - 1
    return jnp.where((index < row_starts[-1]) & (row >= 0), row, row_starts.shape[0] - 1)


def window_array(window) -> jax.Array:
    """The kernels' window input: int32 [1], int32 max (masks nothing) for None."""
    return jnp.reshape(jnp.asarray(jnp.iinfo(jnp.int32).max if window is None else window, jnp.int32), (1,))


def cap_scores(scores, softcap):
    """softcap * tanh(scores / softcap), or scores for None."""
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)
