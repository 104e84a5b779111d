"""The paged KV cache of the serving engine (S-LoRA/vLLM style) and the forward over it.

The cache is a pool of fixed-size pages shared by all requests: k, v [L, num_pages, page_size,
Hkv, Dh]. Each request owns a block table (the page ids of its positions 0, page_size, 2*page_size,
...). One serving step is a flat list of T tokens from any mix of requests (prefill chunks and
decode tokens); token t belongs to row `token_row[t]` and sits at `positions[t]` in its request.
Each layer writes the step's keys/values into the rows' pages in place (the cache array is the
scan's carry, and the caller donates it: no copy of the pool), then every token attends to the
pages of its own row at cache positions <= its own, read in place through the block table by
`pallas_kernels.paged_attention` (so a prefill chunk is causal, and a decode token sees the whole
history).

Only the cache is paged here: the layer itself is `jaxlora.models.llama.decoder_layer`, with
`PagedCacheAttention` as its cache. On a GPU/TPU the layers are unrolled, so each layer's weights
are static slices of the stacked arrays that feed the GEMMs directly (a scan copies every layer's
weights out of the stack, which makes a decode step's GEMMs several times slower:
bench/NOTES_serve.md).
Shapes are static per (T, rows, pages per row), so a caller that buckets those three compiles a
handful of steps.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxlora.lora.plan import ServingPlan
from jaxlora.lora import backends
from jaxlora.lora.backends import LoraBackend
from jaxlora.lora.project import LoraInputs, StackedWeight, layer_lora
from jaxlora.nn.model_config import LlamaConfig
from jaxlora.nn.layers import AttentionSpec
from jaxlora.models.llama import Llama, decoder_layer
from pallas_kernels.paged_attention import paged_attention


class PagedKVCache(NamedTuple):
    """Pages of keys and values: k, v [num_layers, num_pages, page_size, num_kv_heads, head_dim]."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, config: LlamaConfig, num_pages: int, page_size: int, dtype=jnp.float32) -> "PagedKVCache":
        shape = (config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]


class PagedBatch(NamedTuple):
    """One step's tokens and where their keys/values live (a pytree of int32 arrays).

    tokens [T]: token ids (padding: any id). positions [T]: position in the token's request.
    token_row [T]: the token's row in `block_tables`, -1 for padding (writes nothing, sees nothing);
      a row's tokens are contiguous and rows come in order (token_row nondecreasing, padding last).
    block_tables [R, P]: page ids of each row's positions (entries past the row's pages: any id).
    logit_indices [R]: index into the T tokens whose logits each row returns.
    """

    tokens: jax.Array
    positions: jax.Array
    token_row: jax.Array
    block_tables: jax.Array
    logit_indices: jax.Array


def write_slots(batch: PagedBatch, page_size: int, num_pages: int) -> tuple[jax.Array, jax.Array]:
    """(page [T], offset [T]) where each token's key/value goes; page = num_pages (out of range:
    the write is dropped) for padding."""
    tables = batch.block_tables[jnp.maximum(batch.token_row, 0)]
    page_index = jnp.minimum(batch.positions // page_size, tables.shape[1] - 1)
    page = jnp.take_along_axis(tables, page_index[:, None], axis=1)[:, 0]
    return jnp.where(batch.token_row >= 0, page, num_pages), batch.positions % page_size


def row_starts(batch: PagedBatch) -> jax.Array:
    """[R + 1] int32: row r's tokens are [row_starts[r], row_starts[r + 1]) (empty rows allowed)."""
    rows = batch.block_tables.shape[0]
    token_row = jnp.where(batch.token_row >= 0, batch.token_row, rows)
    return jnp.searchsorted(token_row, jnp.arange(rows + 1), side="left").astype(jnp.int32)


class PagedCacheAttention(NamedTuple):
    """`decoder_layer`'s cache for a serving step: the whole page pool k/v_pages [L, num_pages,
    page_size, Hkv, Dh], the layer (int32 scalar), where the step's tokens write (page, offset [T]),
    and what the attention kernel reads (block_tables [R, P], row_starts [R + 1], positions [T])."""

    k_pages: jax.Array
    v_pages: jax.Array
    layer: jax.Array
    write_page: jax.Array
    write_offset: jax.Array
    block_tables: jax.Array
    row_starts: jax.Array
    positions: jax.Array
    kernel: str = "auto"

    def attend(self, q, k, v, spec: AttentionSpec | None = None):
        """Writes k/v [1, T, Hkv, Dh] into their pages of this layer, then q [1, T, H, Dh] attends
        to its row's pages in place (spec: scale, soft-cap, sliding window). Returns ([1, T, H, Dh],
        the cache with the writes)."""
        spec = spec or AttentionSpec(q.shape[-1] ** -0.5)
        at = (self.layer, self.write_page, self.write_offset)
        k_pages = self.k_pages.at[at].set(k[0].astype(self.k_pages.dtype), mode="drop")
        v_pages = self.v_pages.at[at].set(v[0].astype(self.v_pages.dtype), mode="drop")
        out = paged_attention(q[0], k_pages, v_pages, self.block_tables, self.row_starts, self.positions,
                              layer=self.layer, kernel=self.kernel, sm_scale=spec.scale, softcap=spec.softcap,
                              window=spec.window)
        return out[None], self._replace(k_pages=k_pages, v_pages=v_pages)


def paged_forward(
    model: Llama,
    batch: PagedBatch,
    cache: PagedKVCache,
    lora: LoraInputs | None = None,
    lora_backend: LoraBackend | str = backends.DEFAULT,
    attention: str = "auto",
    unroll_layers: bool | None = None,
    image_rows: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, PagedKVCache]:
    """`paged_hidden`, then the logits [R, vocab] float32 of its rows (`Llama.unembed`)."""
    hidden, cache = paged_hidden(model, batch, cache, lora, lora_backend, attention, unroll_layers,
                                 image_rows=image_rows)
    return model.unembed(hidden), cache


def paged_hidden(
    model: Llama,
    batch: PagedBatch,
    cache: PagedKVCache,
    lora: LoraInputs | None = None,
    lora_backend: LoraBackend | str = backends.DEFAULT,
    attention: str = "auto",
    unroll_layers: bool | None = None,
    every_token: bool = False,
    image_rows: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, PagedKVCache]:
    """Runs one serving step over a paged cache (donate `cache` to the jitted caller: it is
    updated in place).

    Args:
      model: the base model.
      batch: the step's T tokens and R rows (see `PagedBatch`).
      cache: the page pool; the step's keys/values are written into it.
      lora: adapters and a plan over the T tokens (in token order), or None. With a `ServingPlan`
        the layers get the whole pool stack and their index (`StackedModulePool`): the serving
        kernels index it in place, no per-layer slice of the pool is copied.
      lora_backend: the `LoraBackend` (`jaxlora.lora.backends`), or its name (resolved here, once).
      attention: the paged attention implementation (`pallas_kernels.paged_attention`'s `kernel`):
        "auto" runs the kernel on a GPU/TPU and the jnp reference on a CPU.
      unroll_layers: None: unrolled on a GPU/TPU, a scan on a CPU (compiles faster).
      every_token: return every token's hidden state [T, d] instead of the rows' (scoring).
      image_rows: (rows [M, d], index [T] int32): token t's input embedding is rows[index[t]]
        instead of its token's where index[t] >= 0 (a vision-language model's image embeddings at
        its image tokens: `jaxlora.vision.llava.image_row_index`); None: text only.

    Returns:
      (the last layer's hidden states [R, d] at `batch.logit_indices`, before the final norm;
      the updated cache).
    """
    config = model.config
    backend = backends.get(lora_backend)
    batch = jax.tree.map(jnp.asarray, batch)
    unroll = jax.default_backend() in ("gpu", "tpu") if unroll_layers is None else unroll_layers
    positions = batch.positions[None]
    write_page, write_offset = write_slots(batch, cache.page_size, cache.num_pages)
    starts = row_starts(batch)

    def layer(carry, per_layer, step):
        hidden, k_pages, v_pages = carry
        weights, layer_pool, layer_index = per_layer
        lora_inputs, write_page, write_offset, block_tables, starts, token_positions, rope_positions = step
        kv = PagedCacheAttention(k_pages, v_pages, layer_index, write_page, write_offset, block_tables,
                                 starts, token_positions, attention)
        lora_context = layer_lora(lora_inputs, layer_pool, backend, layer_index)
        hidden, kv = decoder_layer(config, weights, hidden, rope_positions, layer_index, kv, lora_context)
        return (hidden, kv.k_pages, kv.v_pages), None

    # A ServingPlan's kernels take the pool stack whole (layer_pool None); the XLA backends get
    # each layer's slice of it.
    per_layer_pool = None if lora is None or isinstance(lora.plan, ServingPlan) else lora.pool
    embeds = model.embed(batch.tokens[None])
    if image_rows is not None:
        rows, index = image_rows
        picked = jnp.take(rows, jnp.clip(index, 0, rows.shape[0] - 1), axis=0).astype(embeds.dtype)
        embeds = jnp.where((index >= 0)[None, :, None], picked[None], embeds)
    carry = (embeds, cache.k, cache.v)
    weights = model.layer_weights()
    step = (lora, write_page, write_offset, batch.block_tables, starts, batch.positions, positions)
    if isinstance(weights, (list, tuple)):  # one dict of arrays a layer (not stacked): a Python loop over them,
        # each layer one call of the same jitted function: traced and lowered once, not once a layer
        # (the layers' arrays have equal shapes); XLA inlines the calls
        one_layer = jax.jit(layer)
        for index, layer_weights in enumerate(weights):
            pool = None if per_layer_pool is None else jax.tree.map(lambda a, i=index: a[i], per_layer_pool)
            carry, _ = one_layer(carry, (layer_weights, pool, jnp.asarray(index, jnp.int32)), step)
        hidden, k, v = carry
    else:  # the adapter window's B goes to every layer whole, with the layer's index (`StackedWeight`)
        whole = {key: stack for key, stack in weights.items() if key.endswith(".window_b")}
        scanned = {key: stack for key, stack in weights.items() if key not in whole}

        def stacked_layer(c, p):
            layer_weights, pool, index = p
            layer_weights = {**layer_weights, **{key: StackedWeight(stack, index) for key, stack in whole.items()}}
            return layer(c, (layer_weights, pool, index), step)

        per_layer = (scanned, per_layer_pool, jnp.arange(config.num_layers))
        (hidden, k, v), _ = jax.lax.scan(stacked_layer, carry, per_layer, unroll=config.num_layers if unroll else 1)
    return (hidden[0] if every_token else hidden[0, batch.logit_indices]), PagedKVCache(k, v)
