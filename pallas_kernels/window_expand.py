"""The adapter window's expand: each row's LoRA delta from the shrink columns that the base GEMM
wrote beside its output, added to that output (`jaxlora.models.packed.add_adapter_window` holds
the window; `jaxlora.lora.project` calls this on a step whose adapters all sit in it).

Layout: y [T, n + P*W*r] is x @ [W | A_window]: n base columns (the projections side by side),
then P*W*r shrink columns, column (p*W + w)*r + i being rank component i of
window slot w's projection p. window_b is B times the scale, block-diagonal [P*W*r, n] (rows of
projection p only in p's columns) or batched [P, W*r, n_p] (every projection of width n_p). A row
t keeps the shrink columns of its slot token_window[t] and of token_extra[t] (-1: none), the
others are zero, and its delta is that shrink @ B. column_window [W*r] int32 gives the window slot
of each of a projection's W*r columns (c // r).

The reference (any platform) is the plain jnp form: a select, then one GEMM. XLA runs that as two
kernels per call on a GPU (the select, reading the shrink columns sliced out of y, and the
expand GEMM), 128 of each in an 8B decode step. The GPU kernel does the select, the expand and
the add in one launch, in place on y (aliased; no column of y copied out): one program per block
of rows and of up to `BLOCK_N` base columns. A program reads its projection's W*r rows of a
batched B, and of a block-diagonal one when the caller gives the projections' widths and every
projection has window columns; else all P*W*r rows (the zero blocks too: the layout alone does not
say which projections have window columns when only some do). Measured on an H200 at the 8B shape:
the window's decode32 step 6.29 -> 6.17 ms (bench/NOTES_serve.md, fifteenth session).

Stacked weights (the engine's layer scan): with `layer` given, window_b is every layer's B
[L, ...] and the call uses layer `layer`; the kernel reads the stack in place (a Pallas operand
that is a slice of a stack is a copy: 4 a layer, +11 us a layer of the 8B shape on an H200).

`impl`: as `pallas_kernels.dispatch` (None: "gpu" on a GPU, the reference elsewhere).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.dispatch import resolve_impl
from pallas_kernels.tiles import next_pow2

BLOCK_N = 128  # base columns per program (at most)
MAX_BLOCK_T = 64  # rows per program
NUM_WARPS = 4
_F32, _I32 = jnp.float32, jnp.int32


def window_expand(y: jax.Array, window_b: jax.Array, token_window: jax.Array, token_extra: jax.Array,
                  column_window: jax.Array, bias: jax.Array | None = None, *, layer: jax.Array | None = None,
                  widths: tuple[int, ...] | None = None, impl: str | None = None) -> jax.Array:
    """y [..., T, n + P*W*r] -> [..., T, n]: the base columns (+ `bias` [n]) plus each row's window
    LoRA delta, in y's dtype. token_window, token_extra [T] int32 (y's rows, flattened);
    column_window [W*r] int32; layer: None (window_b is one layer's) or an int32 scalar
    (window_b [L, ...] is the stack); widths: the projections' base columns in y (summing to n),
    when every one has window columns (then a block-diagonal B's kernel reads only a projection's
    own W*r rows); None: unknown."""
    shape = window_b.shape if layer is None else window_b.shape[1:]
    n, k, wr = base_width(shape), _shrink_width(shape), column_window.shape[0]
    if y.shape[-1] != n + k or k % wr:
        raise ValueError(f"y's {y.shape[-1]} columns must be B's {n} base columns plus its {k} rows "
                         f"(a multiple of the window's {wr} columns); B {shape}")
    spans = _spans(shape, k // wr, widths)
    style, interpret = resolve_impl(impl)
    block_n = _block_n(*(spans or (shape[-1],)))
    if style == "gpu" and wr >= 16 and block_n:
        rows = y.reshape(-1, y.shape[-1])
        out = window_expand_gpu(rows, window_b, token_window, token_extra, column_window, layer, spans=spans,
                                block_n=block_n, interpret=interpret)
        out = out[:, :n].reshape(*y.shape[:-1], n)
        return out if bias is None else out + bias.astype(out.dtype)
    window_b = window_b if layer is None else window_b[layer]
    return window_expand_reference(y, window_b, token_window, token_extra, column_window, bias)


def window_expand_reference(y, window_b, token_window, token_extra, column_window, bias=None):
    """`window_expand` in plain jnp (one layer's window_b): the base columns (+ bias) plus (the
    row's own shrink columns, the others zeroed) @ window_b, the GEMM written in y's dtype (the
    form the engine ran on every platform before the GPU kernel)."""
    width = base_width(window_b.shape)
    base, shrink = y[..., :width], y[..., width:]
    if bias is not None:
        base = base + bias.astype(y.dtype)
    columns = jnp.tile(column_window, shrink.shape[-1] // column_window.shape[0])
    own = (columns[None, :] == token_window[:, None]) | (columns[None, :] == token_extra[:, None])
    shrink = jnp.where(own, shrink, 0).astype(window_b.dtype)
    if window_b.ndim == 2:
        return base + jnp.dot(shrink, window_b, preferred_element_type=y.dtype)
    per_projection = jnp.moveaxis(shrink.reshape(*shrink.shape[:-1], *window_b.shape[:2]), -2, 0)
    delta = jnp.matmul(per_projection, window_b[(slice(None),) + (None,) * (y.ndim - 2)],
                       preferred_element_type=y.dtype)
    return base + jnp.concatenate(list(delta), axis=-1)


def base_width(shape) -> int:
    """n of one layer's B: [P*W*r, n] or [P, W*r, n_p] (n = P * n_p)."""
    return shape[-1] * (shape[0] if len(shape) == 3 else 1)


def _block(v: int) -> int:
    """A Triton block covering v: the next power of two, at least 16 (a dot's operand)."""
    return max(16, next_pow2(v))


def _shrink_width(shape) -> int:
    """P*W*r of one layer's B (its rows)."""
    return shape[0] * (shape[1] if len(shape) == 3 else 1)


def _spans(shape, projections: int, widths) -> tuple[int, ...] | None:
    """Each projection's base columns where the kernel reads one projection's W*r rows of B per
    program: a batched B's (all n_p), or `widths` of a block-diagonal B with one block each; None:
    a block-diagonal B read whole."""
    if len(shape) == 3:
        return (shape[-1],) * shape[0]
    if widths is not None and len(widths) == projections and sum(widths) == shape[-1]:
        return tuple(int(w) for w in widths)
    return None


def _block_n(*widths: int) -> int:
    """The kernel's column block: the largest power of two <= BLOCK_N dividing every width, at
    least 16; 0 where none does (the reference runs)."""
    block = BLOCK_N
    while block >= 16 and any(width % block for width in widths):
        block //= 2
    return block if block >= 16 else 0


def _kernel(tw_ref, te_ref, cw_ref, offset_ref, y_ref, b_ref, out_ref, *, rows: int, block_t: int, block_n: int,
            n: int, k: int, block_k: int, wr: int, block_starts: tuple | None, batched: bool):
    """Rows [i*block_t, +block_t) x base columns [j*block_n, +block_n): y's base block plus the
    masked shrink [block_t, block_k] @ B's rows [block_k, block_n]. With `block_starts` (each
    projection's first column block), projection p's W*r rows and shrink columns (a batched B's
    columns counted from p's first); without, all P*W*r rows, padded to block_k with zeros. B's
    rows of this layer start at offset_ref[0] of the flattened stack."""
    i, j = pl.program_id(0), pl.program_id(1)
    row0, col0 = i * block_t, j * block_n
    live = row0 + lax.broadcasted_iota(_I32, (block_t,), 0) < rows
    tw = plt.load(tw_ref.at[pl.ds(row0, block_t)], mask=live, other=-1)
    te = plt.load(te_ref.at[pl.ds(row0, block_t)], mask=live, other=-1)
    k0, b_col0, k_live = 0, col0, k
    if block_starts is not None:  # projection p: the last whose first block is <= j (static bounds)
        p, first = jnp.int32(0), jnp.int32(0)
        for index, start in enumerate(block_starts[1:], 1):
            p, first = jnp.where(j >= start, index, p), jnp.where(j >= start, start, first)
        k0, k_live = p * wr, wr
        b_col0 = col0 - first * block_n if batched else col0
    ks = lax.broadcasted_iota(_I32, (block_k,), 0)
    in_k = ks < k_live
    slot = plt.load(cw_ref.at[ks % wr], mask=in_k, other=-1)
    rows_at = jnp.minimum(row0 + lax.broadcasted_iota(_I32, (block_t,), 0), rows - 1)
    cols_at = jnp.minimum(n + k0 + ks, n + k - 1)  # block_k may run past y's last column: masked
    shrink = plt.load(y_ref.at[rows_at[:, None], cols_at[None, :]], mask=live[:, None] & in_k[None, :], other=0)
    own = (slot[None, :] == tw[:, None]) | (slot[None, :] == te[:, None])
    shrink = jnp.where(own & in_k[None, :], shrink, jnp.zeros((), shrink.dtype)).astype(b_ref.dtype)
    b_rows = jnp.minimum(offset_ref[0] + k0 + ks, b_ref.shape[0] - 1)
    b = plt.load(b_ref.at[b_rows[:, None], b_col0 + lax.broadcasted_iota(_I32, (1, block_n), 1)],
                 mask=in_k[:, None], other=0)
    delta = jnp.dot(shrink, b, preferred_element_type=_F32)
    at = (pl.ds(row0, block_t), pl.ds(col0, block_n))
    base = plt.load(y_ref.at[at], mask=live[:, None], other=0).astype(_F32)
    plt.store(out_ref.at[at], (base + delta).astype(out_ref.dtype), mask=live[:, None])


def window_expand_gpu(y, window_b, token_window, token_extra, column_window, layer=None, *, spans=None,
                      block_n: int = BLOCK_N, num_warps: int | None = None, interpret: bool = False):
    """The GPU kernel of `window_expand` on y [T, n + P*W*r] (2-D), in place (y aliased to the
    output, whose shrink columns it leaves as they were): grid (row blocks, base column blocks of
    `block_n`). window_b: one layer's, or the stack [L, ...] with `layer`; spans: each projection's
    base columns (`_spans`; required for a batched B), None: a block-diagonal B read whole. Every
    span (or B's last axis) a multiple of block_n; W*r >= 16."""
    shape = window_b.shape if layer is None else window_b.shape[1:]
    rows, wr, n, k = y.shape[0], column_window.shape[0], base_width(shape), _shrink_width(shape)
    batched = len(shape) == 3
    spans = (shape[-1],) * shape[0] if batched else spans
    block_t = min(MAX_BLOCK_T, _block(rows))
    starts = None if spans is None else tuple(sum(spans[:p]) // block_n for p in range(len(spans)))
    kernel = functools.partial(_kernel, rows=rows, block_t=block_t, block_n=block_n, n=n, k=k,
                               block_k=_block(k if spans is None else wr), wr=wr, block_starts=starts,
                               batched=batched)
    offset = jnp.zeros((1,), _I32) if layer is None else (jnp.asarray(layer, _I32) * k).reshape(1)
    return pl.pallas_call(
        kernel,
        name="window_expand",
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=(pl.cdiv(rows, block_t), n // block_n),
        input_output_aliases={4: 0},
        compiler_params=plt.CompilerParams(num_warps=num_warps or NUM_WARPS, num_stages=2),
        interpret=interpret,
    )(token_window.reshape(-1).astype(_I32), token_extra.reshape(-1).astype(_I32), column_window.astype(_I32),
      offset, y, window_b.reshape(-1, window_b.shape[-1]))
