"""Paged attention for one serving step: every token reads its row's KV pages in place.

A serving step is a flat list of T tokens from R rows (requests): row r's tokens are
q[row_starts[r]:row_starts[r+1]] (a decode row has one token, a prefill chunk many; empty rows
are allowed; tokens at index >= row_starts[R] are padding and get zeros). The keys and values of
all earlier positions, and of the step's own tokens, are already in a pool of fixed-size pages:
row r's positions 0, page_size, 2*page_size, ... live on pages block_tables[r, 0], [r, 1], ...
Token t attends causally to its row's cache positions 0..positions[t] (chunked prefill: a chunk
at positions c..c+n-1 sees its own earlier pages plus itself).

Shapes: q [T, H, Dh]; k_pages, v_pages [num_pages, page_size, Hkv, Dh] (one layer) or the whole
stacked cache [L, num_pages, page_size, Hkv, Dh] with `layer` (int32 scalar, may be traced: the
kernels offset into the stack, no layer slice is copied); block_tables [R, P] int32 (entries past
a row's pages are never read); row_starts [R+1] int32 nondecreasing with row_starts[0] == 0;
positions [T] int32. H = Hkv * G (grouped-query attention: query head h reads KV head h // G;
K/V are never repeated per query head). Softmax in float32, output [T, H, Dh] in q's dtype.

Options (defaults: plain causal attention): `sm_scale` (None: Dh ** -0.5); `softcap` (static
float: scores -> softcap * tanh(scores / softcap), Gemma 2); `window` (None, or an int / traced
int32 scalar: token t sees only positions > positions[t] - window, a sliding window).

Kernels (`kernel`): "reference" (pure jnp: gathers each token's pages, dense masked softmax),
"gpu" (`paged_attention_gpu`, Pallas -> Triton), "tpu" (`paged_attention_tpu`, Pallas ->
Mosaic, the design of JAX's ragged paged attention with this cache layout), "auto" (the local
backend's kernel; the reference on CPU). A kernel of another backend runs in interpret mode,
which is how the CPU tests check both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import resolve_impl
from pallas_kernels.paged_attention_common import cap_scores, check_shapes, token_rows

KERNELS = ("auto", "reference", "gpu", "tpu")


def paged_attention(q, k_pages, v_pages, block_tables, row_starts, positions, *, layer=None,
                    sm_scale=None, kernel="auto", interpret=None, softcap=None, window=None):
    """Causal attention of a step's tokens over their rows' KV pages (module docstring: shapes).

    kernel: "auto" | "reference" | "gpu" | "tpu"; interpret: None (True when the kernel's backend
    is not the local one), or an explicit value passed to `pallas_call`.
    Returns [T, H, Dh] in q.dtype.
    """
    style, interpret = _resolve(kernel, interpret)
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    args = (q, k_pages, v_pages, block_tables.astype(jnp.int32), row_starts.astype(jnp.int32),
            positions.astype(jnp.int32))
    options = dict(layer=layer, sm_scale=sm_scale, softcap=softcap, window=window)
    if style == "reference":
        return paged_attention_reference(*args, **options)
    if style == "gpu":
        from pallas_kernels.paged_attention_gpu import paged_attention_gpu
        return paged_attention_gpu(*args, **options, interpret=interpret)
    from pallas_kernels.paged_attention_tpu import paged_attention_tpu
    return paged_attention_tpu(*args, **options, interpret=interpret)


def _resolve(kernel: str, interpret):
    """(style, interpret) for a kernel name (`pallas_kernels.dispatch.resolve_impl`): "auto" is the
    backend's kernel (reference on CPU); a kernel of another backend interprets (the TPU one with
    the TPU interpreter); an explicit `interpret` is kept."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    style, default_interpret = resolve_impl(None if kernel == "auto" else kernel)
    return style, default_interpret if interpret is None else interpret


def paged_attention_reference(q, k_pages, v_pages, block_tables, row_starts, positions, *, layer=None,
                              sm_scale=None, softcap=None, window=None):
    """Pure jnp: gathers every token's row pages [T, P*page_size, Hkv, Dh] and runs a dense
    masked softmax in float32. Same contract as `paged_attention`."""
    group, kv_heads = check_shapes(q, k_pages, v_pages, block_tables, row_starts, positions)
    tokens, heads, head_dim = q.shape
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    if k_pages.ndim == 5:
        k_pages, v_pages = k_pages[layer], v_pages[layer]
    num_rows, pages_per_row = block_tables.shape
    page_size = k_pages.shape[1]
    row = token_rows(row_starts, tokens)
    valid = row < num_rows
    tables = block_tables[jnp.minimum(row, num_rows - 1)]  # [T, P]
    span = pages_per_row * page_size
    visible = (jnp.arange(span)[None, :] <= positions[:, None]) & valid[:, None]  # [T, span]
    if window is not None:
        visible = visible & (positions[:, None] - jnp.arange(span)[None, :] < window)
    # Pages past a row's last visible position may hold any id: point them at page 0 (masked).
    needed = jnp.arange(pages_per_row)[None, :] <= positions[:, None] // page_size
    tables = jnp.where(needed & valid[:, None], tables, 0)
    keys = k_pages[tables].reshape(tokens, span, kv_heads, head_dim).astype(jnp.float32)
    values = v_pages[tables].reshape(tokens, span, kv_heads, head_dim).astype(jnp.float32)
    values = jnp.where(visible[:, :, None, None], values, 0.0)  # unwritten slots may hold NaN
    qg = q.astype(jnp.float32).reshape(tokens, kv_heads, group, head_dim)
    scores = cap_scores(jnp.einsum("tkgd,tskd->tkgs", qg, keys, precision=jax.lax.Precision.HIGHEST) * sm_scale,
                        softcap)
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    scores = jnp.where(valid[:, None, None, None], scores, 0.0)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("tkgs,tskd->tkgd", probs, values, precision=jax.lax.Precision.HIGHEST)
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(tokens, heads, head_dim).astype(q.dtype)
