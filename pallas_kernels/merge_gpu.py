"""Merging one adapter into base kernel columns in one pass (V-LoRA's swift mode switch).

`merge_columns(kernel, base, a, b, scale, merged, offset)` sets, for every layer l, the columns
offset : offset + n of kernel [L, k, n_kernel] to

    merged:  round(base[l] + scale[l] * a[l] @ b[l])   (the product and the add in float32)
    else:    base[l]                                    (bit for bit: unmerge)

with base [L, k, n], a [L, k, r], b [L, r, n], scale [L] float32, merged a bool scalar. The
kernel array is written in place (aliased to the output); its other columns are not touched.

Bytes: each weight of the targeted columns is read once from `base` and written once, A and B
(a few MB) are re-read per tile from L2. The floor on an H200 for the 8B shape's seven
projections (2 x 14 GB) is ~7 ms at 4.0 TB/s. XLA's formulation of the same update
(`reference`: ΔW as a float32 GEMM output per layer, then the add) also writes and reads a
float32 ΔW of every targeted weight: ~2x the bytes (measured 25.9 ms a switch on an H200).

GPU (Pallas -> Triton): one program per (layer, k-block, n-block); the rank-r product on the
tensor cores (r padded to 16, Triton's smallest dot, with zero columns), float32 accumulation
(`HIGHEST` precision for float32 weights). Other backends: the jnp reference (interpret mode of
the GPU kernel for tests: `impl="gpu"` off a GPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

_F32 = jnp.float32
MIN_DOT = 16  # Triton's smallest dot dimension
BLOCKS = (32, 128, 4)  # (block_k, block_n, num_warps): the fastest of bench/merge_switch.py --blocks on an H200


def merge_columns(kernel, base, a, b, scale, merged, offset: int, *, impl: str | None = None,
                  blocks: tuple[int, int, int] | None = None):
    """`kernel` with columns offset:offset+n of every layer set to base + scale * a @ b (merged)
    or to base (module doc). impl: None (the device's: the GPU kernel on a GPU, else the
    reference), "gpu" (interpret mode off a GPU) or "reference"; blocks: the GPU kernel's
    (block_k, block_n, num_warps) (None: `BLOCKS`, fitted to the shapes). Returns [L, k, n_kernel]."""
    if impl not in (None, "gpu", "reference"):
        raise ValueError(f"impl must be None, 'gpu' or 'reference', got {impl!r}")
    layers, k, n = base.shape
    if kernel.shape[:2] != (layers, k) or offset < 0 or offset + n > kernel.shape[2]:
        raise ValueError(f"columns {offset}:{offset + n} of {base.shape} do not fit kernel {kernel.shape}")
    on_gpu = jax.default_backend() == "gpu"
    tiles = _tiles(k, n, offset, kernel.shape[2], blocks or BLOCKS)
    if impl == "reference" or (impl is None and not on_gpu) or tiles is None:
        return merge_columns_reference(kernel, base, a, b, scale, merged, offset)
    return _merge_gpu(kernel, base, a, b, scale, merged, offset, tiles=tiles, interpret=not on_gpu)


def merge_columns_reference(kernel, base, a, b, scale, merged, offset: int):
    """The jnp form: per layer (unrolled: static slices) ΔW = scale * a @ b in float32 at HIGHEST
    precision, added to base in float32 and rounded once; base itself when not merged."""
    for layer in range(base.shape[0]):
        delta = jnp.dot(a[layer].astype(_F32), b[layer].astype(_F32), precision=jax.lax.Precision.HIGHEST)
        own = base[layer]
        value = jnp.where(merged, (own.astype(_F32) + delta * scale[layer]).astype(kernel.dtype), own)
        kernel = kernel.at[layer, :, offset: offset + base.shape[2]].set(value)
    return kernel


def _tiles(k: int, n: int, offset: int, width: int, blocks: tuple[int, int, int]) -> tuple[int, int, int] | None:
    """(block_k, block_n, num_warps): the largest blocks up to `blocks`' that tile [k, n] at
    column `offset` of a kernel `width` wide exactly, or None (the reference)."""
    most_k, most_n, warps = blocks
    block_n = next((bn for bn in (512, 256, 128, 64, 32, 16) if bn <= most_n and not (n % bn or offset % bn or width % bn)),
                   None)
    block_k = next((bk for bk in (256, 128, 64, 32, 16) if bk <= most_k and k % bk == 0), None)
    return None if block_n is None or block_k is None else (block_k, block_n, warps)


def _merge_kernel(flag_ref, scale_ref, base_ref, a_ref, b_ref, _kernel_ref, out_ref, *, precision):
    base = base_ref[...]  # [block_k, block_n]
    delta = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=_F32, precision=precision)
    merged = (base.astype(_F32) + delta * scale_ref[0]).astype(out_ref.dtype)
    out_ref[...] = jnp.where(flag_ref[0] != 0, merged, base.astype(out_ref.dtype))


@functools.partial(jax.jit, static_argnames=("offset", "tiles", "interpret"), donate_argnums=(0,))
def _merge_gpu(kernel, base, a, b, scale, merged, offset: int, tiles: tuple[int, int, int], interpret: bool):
    layers, k, n = base.shape
    block_k, block_n, num_warps = tiles
    rank = max(MIN_DOT, -(-a.shape[-1] // MIN_DOT) * MIN_DOT)
    a = jnp.pad(a, ((0, 0), (0, 0), (0, rank - a.shape[-1])))  # zero rank columns add nothing
    b = jnp.pad(b, ((0, 0), (0, rank - b.shape[1]), (0, 0)))
    flag = jnp.reshape(merged, (1,)).astype(jnp.int32)
    precision = jax.lax.Precision.HIGHEST if jnp.dtype(a.dtype) == jnp.float32 else None
    column0 = offset // block_n
    return pl.pallas_call(
        functools.partial(_merge_kernel, precision=precision),
        name="merge_columns",
        out_shape=jax.ShapeDtypeStruct(kernel.shape, kernel.dtype),
        grid=(layers, k // block_k, n // block_n),
        in_specs=[
            pl.BlockSpec((1,), lambda l, i, j: (0,)),
            pl.BlockSpec((1,), lambda l, i, j: (l,)),
            pl.BlockSpec((None, block_k, block_n), lambda l, i, j: (l, i, j)),
            pl.BlockSpec((None, block_k, rank), lambda l, i, j: (l, i, 0)),
            pl.BlockSpec((None, rank, block_n), lambda l, i, j: (l, 0, j)),
            pl.no_block_spec,  # the kernel itself: aliased to the output, never read
        ],
        out_specs=pl.BlockSpec((None, block_k, block_n), lambda l, i, j: (l, i, column0 + j)),
        input_output_aliases={5: 0},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
    )(flag, scale.astype(_F32), base, a, b, kernel)
