"""Paged attention over a serving step's flat tokens: the pure-jnp reference (the GPU/TPU Pallas
kernels, which read pages in place through the block table, replace the dispatch below).

q [T, H, Dh]; k/v_pages [num_pages, page_size, Hkv, Dh] or stacked [L, ...] with `layer`;
block_tables [R, P]; row_starts [R + 1]; positions [T]: token t of row r attends to its row's
cache positions <= positions[t]. Padding tokens (index >= row_starts[R]) give zeros."""
import jax, jax.numpy as jnp

def paged_attention_reference(q, k_pages, v_pages, block_tables, row_starts, positions, *, layer=None, sm_scale=None):
    if layer is not None:
        k_pages, v_pages = k_pages[layer], v_pages[layer]
    T, H, Dh = q.shape
    R, P = block_tables.shape
    page_size, Hkv = k_pages.shape[1], k_pages.shape[2]
    token = jnp.arange(T)
    row = jnp.searchsorted(row_starts, token, side="right") - 1
    valid = (token < row_starts[-1]) & (row >= 0)
    row = jnp.clip(row, 0, R - 1)
    tables = block_tables[row]
    keys = k_pages[tables].reshape(T, P * page_size, Hkv, Dh).astype(jnp.float32)
    values = v_pages[tables].reshape(T, P * page_size, Hkv, Dh).astype(jnp.float32)
    G = H // Hkv
    qg = q.reshape(T, Hkv, G, Dh).astype(jnp.float32) * (sm_scale or Dh ** -0.5)
    s = jnp.einsum("thgd,tshd->thgs", qg, keys)
    mask = (jnp.arange(P * page_size)[None, :] <= positions[:, None]) & valid[:, None]
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(jnp.where(valid[:, None, None, None], s, 0.0), axis=-1)
    out = jnp.einsum("thgs,tshd->thgd", p, values).reshape(T, H, Dh)
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)

def paged_attention(q, k_pages, v_pages, block_tables, row_starts, positions, *, layer=None, sm_scale=None, kernel="auto", interpret=None):
    return paged_attention_reference(q, k_pages, v_pages, block_tables, row_starts, positions, layer=layer, sm_scale=sm_scale)
