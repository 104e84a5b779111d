"""A paged-KV-cache forward of the Llama decoder, for serving (S-LoRA/vLLM style).

The cache is a pool of fixed-size pages shared by all requests: k, v [L, num_pages, page_size,
Hkv, Dh]. Each request owns a block table (the page ids of its positions 0, page_size, 2*page_size,
...). One serving step is a flat list of T tokens from any mix of requests (prefill chunks and
decode tokens); token t belongs to row `token_row[t]` and sits at `positions[t]` in its request.
Each layer first writes the step's keys/values into the rows' pages, then every token attends to
the pages of its own row at cache positions <= its own (so a prefill chunk is causal, and a
decode token sees the whole history).

The layer math (projections with LoRA, RoPE, GQA attention, SwiGLU) is `jaxlora.models.llama`'s;
only where keys/values live differs, and the projections of one input (q/k/v, gate/up) go through
`project_group` (one grouped LoRA kernel pair for the serving backends). Shapes are static per
(T, rows, pages per row), so a caller that buckets those three compiles a handful of steps.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxlora.lora.plan import ServingPlan
from jaxlora.lora.project import layer_lora as make_layer_lora, project_group
from jaxlora.models.config import LlamaConfig
from jaxlora.models.layers import apply_rope, attention, rms_norm, rope_inverse_frequencies
from jaxlora.models.llama import Llama, LoraInputs, _project


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
    token_row [T]: the token's row in `block_tables`, -1 for padding (writes nothing, sees nothing).
    block_tables [R, P]: page ids of each row's positions (entries past the row's pages: any id).
    logit_indices [R]: index into the T tokens whose logits each row returns.
    """

    tokens: jax.Array
    positions: jax.Array
    token_row: jax.Array
    block_tables: jax.Array
    logit_indices: jax.Array


def _token_pages(batch: PagedBatch, page_size: int, num_pages: int):
    """Per token: its row's block table [T, P], and the (page, offset) where its k/v go ([T] each;
    page = num_pages, out of range, for padding so the write is dropped)."""
    tables = batch.block_tables[jnp.maximum(batch.token_row, 0)]
    page_index = jnp.minimum(batch.positions // page_size, tables.shape[1] - 1)
    page = jnp.take_along_axis(tables, page_index[:, None], axis=1)[:, 0]
    page = jnp.where(batch.token_row >= 0, page, num_pages)
    return tables, page, batch.positions % page_size


def paged_attention_mask(batch: PagedBatch, page_size: int) -> jax.Array:
    """[T, 1, P * page_size] bool: token t sees its row's cache positions <= positions[t]."""
    span = batch.block_tables.shape[1] * page_size
    visible = jnp.arange(span)[None, :] <= batch.positions[:, None]
    return (visible & (batch.token_row >= 0)[:, None])[:, None, :]


def paged_decoder_layer(config, weights, hidden, positions, inv_freq, mask, pages, layer_pages, layer_lora=None):
    """One pre-norm decoder layer over a paged cache.

    Args:
      hidden: [T, 1, d] (each token its own batch row of length 1, so RoPE/attention apply per token).
      positions: [T, 1]. mask: [T, 1, P * page_size] from `paged_attention_mask`.
      pages: (tables [T, P], write_page [T], write_offset [T]) from `_token_pages`.
      layer_pages: this layer's (k, v) pages, each [num_pages, page_size, Hkv, Dh].
      layer_lora: as in `jaxlora.models.llama.decoder_layer`.

    Returns:
      (hidden [T, 1, d], the updated (k, v) pages).
    """
    tokens = hidden.shape[0]
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    tables, write_page, write_offset = pages
    x = rms_norm(hidden, weights["input_layernorm"], config.rms_norm_eps)
    q, k, v = project_group(x, weights, ("q_proj", "k_proj", "v_proj"), layer_lora)
    q = q.reshape(tokens, 1, heads, head_dim)
    k, v = k.reshape(tokens, 1, kv_heads, head_dim), v.reshape(tokens, 1, kv_heads, head_dim)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    k_pages, v_pages = layer_pages
    k_pages = k_pages.at[write_page, write_offset].set(k[:, 0].astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[write_page, write_offset].set(v[:, 0].astype(v_pages.dtype), mode="drop")
    span = tables.shape[1] * k_pages.shape[1]
    keys = k_pages[tables].reshape(tokens, span, kv_heads, head_dim).astype(q.dtype)
    values = v_pages[tables].reshape(tokens, span, kv_heads, head_dim).astype(q.dtype)
    attn = attention(q, keys, values, mask).reshape(tokens, 1, heads * head_dim)
    hidden = hidden + _project(attn, weights, "o_proj", layer_lora)
    x = rms_norm(hidden, weights["post_attention_layernorm"], config.rms_norm_eps)
    gate, up = project_group(x, weights, ("gate_proj", "up_proj"), layer_lora)
    gated = jax.nn.silu(gate) * up
    hidden = hidden + _project(gated, weights, "down_proj", layer_lora)
    return hidden, (k_pages, v_pages)


def paged_forward(
    model: Llama,
    batch: PagedBatch,
    cache: PagedKVCache,
    lora: LoraInputs | None = None,
    lora_backend: str = "gather",
) -> tuple[jax.Array, PagedKVCache]:
    """Runs one serving step over a paged cache.

    Args:
      model: the base model.
      batch: the step's T tokens and R rows (see `PagedBatch`).
      cache: the page pool; the step's keys/values are written into it.
      lora: adapters and a plan over the T tokens (in token order), or None.

    Returns:
      (logits [R, vocab] float32 at `batch.logit_indices`, the updated cache).
    """
    config = model.config
    inv_freq = rope_inverse_frequencies(config)
    hidden = model.embed(batch.tokens[:, None])
    positions = batch.positions[:, None]
    mask = paged_attention_mask(batch, cache.page_size)
    pages = _token_pages(batch, cache.page_size, cache.num_pages)

    # With a ServingPlan the pool is not scanned: each layer gets the whole stack and its index
    # (`StackedModulePool`), which the serving kernels index in place instead of XLA copying
    # every layer's slice of the pool out of the stack for them (3.8 ms of a 64-row 8B step).
    stacked = lora is not None and isinstance(lora.plan, ServingPlan)

    def layer(hidden, per_layer):
        weights, layer_pages, layer_pool, layer_index = per_layer
        layer_lora = make_layer_lora(lora, layer_pool, lora_backend, layer_index)
        return paged_decoder_layer(config, weights, hidden, positions, inv_freq, mask, pages, layer_pages, layer_lora)

    per_layer_pool = None if lora is None or stacked else lora.pool
    hidden, (k, v) = jax.lax.scan(
        layer, hidden, (model.layer_weights(), (cache.k, cache.v), per_layer_pool, jnp.arange(config.num_layers))
    )
    logits = model.unembed(hidden[batch.logit_indices, 0])
    return logits, PagedKVCache(k, v)
