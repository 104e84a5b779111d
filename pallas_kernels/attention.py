"""Causal attention inside packed segments without a [T, T] score matrix in memory (flash).

The training path packs several samples into one row; each query attends causally to keys of its
own sample only. The masked XLA attention (`jaxlora.nn.layers.attention`) writes float32
scores [heads, T, T] (2 GB per layer at T=4096 and 32 heads) and reads them back in the softmax
and the backward; a flash kernel keeps one tile of scores in registers.

Shapes: q [B, T, H, D]; k, v [B, T, Hkv, D] with H a multiple of Hkv (grouped-query attention:
query head h reads key/value head h // (H // Hkv)); segment_ids int32 [B, T]. Query t attends to
key s iff s <= t and segment_ids[t] == segment_ids[s] (and, with a `window`, t - s < window: a
sliding window, by index: a sample's tokens are contiguous). Returns [B, T, H, D] in q's dtype.

Kernels: GPU: `pallas_kernels.attention_gpu` (Triton lowering; walks only the blocks each tile's
segments can reach, GQA read in place), or JAX's own Pallas kernel
(`jax.experimental.pallas.ops.gpu.attention.mha`, which skips only the blocks above the diagonal)
with `FlashBlocks(kernel="jax")`; TPU: Mosaic, `jax.experimental.pallas.ops.tpu.flash_attention`. `impl` is dispatched as in
`pallas_kernels.dispatch`: None (the local backend's kernel), "reference", "gpu", "tpu"; a kernel of
another backend runs in interpret mode, which is how CPU tests check both.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import flash_attention as tpu_attention

with warnings.catch_warnings():  # jax >= 0.12 points to tokamax; this module is what jax 0.11 ships
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

from pallas_kernels.attention_gpu import segment_flash_gpu
from pallas_kernels.dispatch import resolve_impl


@dataclasses.dataclass(frozen=True)
class FlashBlocks:
    """GPU kernel and tiles: forward (block_q x block_k) and backward (one size for dK/dV and dQ).
    kernel: "spans" (`attention_gpu`, skips blocks across samples) or "jax" (JAX's Pallas kernel)."""

    block_q: int = 128  # the fastest of bench/train.py --breakdown's tiles (bench/NOTES_train.md)
    block_k: int = 64
    block_backward: int = 64
    num_warps: int | None = None
    num_stages: int = 2
    kernel: str = "spans"

    def gpu_block_sizes(self) -> gpu_attention.BlockSizes:
        b = self.block_backward
        return gpu_attention.BlockSizes(block_q=self.block_q, block_k=self.block_k, block_q_dkv=b,
                                        block_kv_dkv=b, block_q_dq=b, block_kv_dq=b)


DEFAULT_BLOCKS = FlashBlocks()  # the tiles a call without `blocks` uses (bench/train.py --breakdown compares)
TPU_BLOCK = 128  # the Mosaic kernel's default tile along T


def flash_supported(length: int, head_dim: int, blocks: FlashBlocks | None = None) -> bool:
    """Whether the kernels take this shape: T a multiple of every tile, head_dim a power of two."""
    blocks = blocks or DEFAULT_BLOCKS
    tiles = (blocks.block_q, blocks.block_k, blocks.block_backward, TPU_BLOCK)
    return head_dim & (head_dim - 1) == 0 and all(length % t == 0 for t in tiles)


def flash_takes_window() -> bool:
    """Whether the default GPU kernel applies a sliding window (only the "spans" kernel does)."""
    return DEFAULT_BLOCKS.kernel == "spans"


def segment_attention_reference(q, k, v, segment_ids, sm_scale=None, window=None):
    """Pure-jnp masked softmax (float32 scores); same contract as `segment_attention`."""
    batch, length, heads, head_dim = q.shape
    group = heads // k.shape[2]
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * sm_scale
    causal = jnp.tril(jnp.ones((length, length), bool))
    if window is not None:
        index = jnp.arange(length)
        causal = causal & (index[:, None] - index[None, :] < window)
    mask = causal[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
    scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhts,bshd->bthd", probs, v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def segment_attention(q, k, v, segment_ids, *, impl: str | None = None, blocks: FlashBlocks | None = None,
                      sm_scale: float | None = None, window=None):
    """Flash attention, causal within each packed segment. Shapes in the module docstring.
    blocks: the GPU kernel's tiles (None: `DEFAULT_BLOCKS`, read at trace time).
    sm_scale: the scores' scale (None: D ** -0.5); window: None, or an int / traced int32 scalar
    (only the reference and the GPU "spans" kernel take one)."""
    blocks = blocks or DEFAULT_BLOCKS
    batch, length, heads, head_dim = q.shape
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    if heads % k.shape[2]:
        raise ValueError(f"query heads {heads} must be a multiple of key/value heads {k.shape[2]}")
    style, interpret = resolve_impl(impl)
    if style == "reference":
        return segment_attention_reference(q, k, v, segment_ids, sm_scale, window)
    if window is not None and not (style == "gpu" and blocks.kernel == "spans"):
        raise ValueError(f"a sliding window is applied by the GPU 'spans' flash kernel only, not {style!r} "
                         f"(kernel {blocks.kernel!r}): use the masked attention")
    if not flash_supported(length, head_dim, blocks):
        raise ValueError(f"flash attention needs T a multiple of the tiles and a power-of-two head_dim; "
                         f"got T={length}, head_dim={head_dim}")
    group = heads // k.shape[2]
    segment_ids = segment_ids.astype(jnp.int32)
    if style == "gpu" and blocks.kernel == "spans":
        window = None if window is None else jnp.reshape(jnp.asarray(window, jnp.int32), (1,))
        return segment_flash_gpu(q, k, v, segment_ids, window, sm_scale, blocks.block_q, blocks.block_k,
                                 blocks.block_backward, blocks.num_warps, blocks.num_stages, interpret or False)
    if style == "gpu":
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        return gpu_attention.mha(q, k, v, segment_ids, sm_scale=sm_scale, causal=True,
                                 block_sizes=blocks.gpu_block_sizes(), num_warps=blocks.num_warps,
                                 num_stages=blocks.num_stages, interpret=bool(interpret))
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    return _tpu_attention(q, k, v, segment_ids, sm_scale, interpret)


def _tpu_attention(q, k, v, segment_ids, sm_scale, interpret):
    """The Mosaic kernel takes [B, H, T, D]."""
    heads_first = lambda t: jnp.swapaxes(t, 1, 2)
    ids = tpu_attention.SegmentIds(q=segment_ids, kv=segment_ids)

    def call(q, k, v):
        out = tpu_attention.flash_attention(heads_first(q), heads_first(k), heads_first(v), segment_ids=ids,
                                            causal=True, sm_scale=sm_scale)
        return heads_first(out)

    return _in_tpu_interpret_mode(call, interpret)(q, k, v) if interpret else call(q, k, v)


def _in_tpu_interpret_mode(fn, params):
    """fn with its forward and its backward both traced under TPU interpret mode (CPU tests): the
    kernel's own VJP traces its backward kernels only when the gradient is taken."""

    @jax.custom_vjp
    def wrapped(*args):
        with pltpu.force_tpu_interpret_mode(params):
            return fn(*args)

    def forward(*args):
        with pltpu.force_tpu_interpret_mode(params):
            return jax.vjp(fn, *args)

    def backward(vjp_fn, grad):
        with pltpu.force_tpu_interpret_mode(params):
            return vjp_fn(grad)

    wrapped.defvjp(forward, backward)
    return wrapped
