"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2/3, Gemma 2/3, Phi-3) in Flax NNX.

The families differ only by `LlamaConfig` fields: q/k norms (Qwen3, Gemma 3), sliding-window
layers (Mistral, Qwen2/3 with use_sliding_window, Phi-3, Gemma 2/3's alternating layers), Gemma's
norms after attention and MLP with (1 + weight), embedding scale, query scale, soft-capping, GeGLU
and Gemma 3's local RoPE base. Phi-3's fused qkv/gate_up checkpoint tensors are split on load.

The decoder layers' weights are stacked along a leading layer axis and run with `jax.lax.scan`,
so a 30- or 32-layer model compiles once per shape, and per-layer state (KV cache, the LoRA
adapter pool) scans alongside the weights. Any call can take `lora=LoraInputs(...)`: each token
then adds the delta of its own adapter slot (see `jaxlora.lora.project`).

Two ways to call it:
  * packed training/scoring: `model(tokens, positions, segment_ids=...)`, where several samples
    share one row and `segment_ids` keeps attention inside each sample;
  * incremental decoding: `model(tokens, positions, cache=cache)` writes the new keys/values at
    `positions` and attends to every cached position <= the query's own.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlora.lora import backends
from jaxlora.lora.backends import LoraBackend
from jaxlora.lora.project import LayerLora, LoraInputs, layer_lora, project as _project, project_group
from jaxlora.nn.model_config import LlamaConfig, has_bias, projection_shapes
from jaxlora.nn.layers import (ACTIVATION_FUNCTIONS, AttentionSpec, PackedSegments, apply_rope, attend, dense,
                                   layer_window, packed_attention, rms_norm, rope_frequencies, softcap,
                                   window_mask)

# Stacked per-layer weights are `layers.<name>`; kernels are [num_layers, in, out].
__all__ = ["DenseCacheAttention", "KVCache", "Llama", "PackedAttention", "LoraInputs", "decoder_layer", "weight_shapes"]
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
# Gemma 2/3 (`LlamaConfig.sandwich_norms`): post_attention_layernorm normalises the attention output,
# these the MLP's input and output.
FEEDFORWARD_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
QK_NORMS = ("q_norm", "k_norm")  # per-head RMSNorm of queries and keys (`LlamaConfig.qk_norm`: Qwen3)


class KVCache(NamedTuple):
    """Keys and values of every layer: k, v [num_layers, batch, max_len, num_kv_heads, head_dim]."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, config: LlamaConfig, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
        shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def weight_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every weight of the model, keyed by its flat name (see `Llama`)."""
    num_layers, d = config.num_layers, config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens": (config.vocab_size, d), "norm": (d,)}
    for name in LAYER_NORMS + (FEEDFORWARD_NORMS if config.sandwich_norms else ()):
        shapes[f"layers.{name}"] = (num_layers, d)
    if config.qk_norm:
        for name in QK_NORMS:
            shapes[f"layers.{name}"] = (num_layers, config.head_dim)
    for name, (fan_in, fan_out) in projection_shapes(config).items():
        shapes[f"layers.{name}.kernel"] = (num_layers, fan_in, fan_out)
        if has_bias(config, name):
            shapes[f"layers.{name}.bias"] = (num_layers, fan_out)
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (d, config.vocab_size)
    return shapes


def _random_weight(key: jax.Array, name: str, shape: tuple[int, ...], dtype, norm_offset: float = 0.0) -> jax.Array:
    if name.endswith("norm"):  # a unit scale: weight 1, or 0 where the norm adds 1 (Gemma)
        return jnp.full(shape, 1.0 - norm_offset, dtype)
    if name.endswith(".bias"):
        return jnp.zeros(shape, dtype)
    fan_in = shape[-2] if len(shape) >= 2 and name != "embed_tokens" else shape[-1]
    return (jax.random.normal(key, shape, jnp.float32) * fan_in**-0.5).astype(dtype)


# remat name -> None (no rematerialisation) or a function returning the `jax.checkpoint` policy.
REMAT_POLICIES = {
    "none": None,
    "layer": lambda: jax.checkpoint_policies.nothing_saveable,
    "save_dots": lambda: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Llama(nnx.Module):
    """Llama-family causal LM. Weights live in `self.weights[name]` (an `nnx.Param` each)."""

    def __init__(
        self,
        config: LlamaConfig,
        *,
        weights: dict[str, jax.Array] | None = None,
        rngs: nnx.Rngs | None = None,
        dtype=jnp.float32,
    ):
        self.config = config
        self.dtype = dtype
        shapes = weight_shapes(config)
        if weights is None:
            rngs = rngs or nnx.Rngs(0)
            weights = {name: _random_weight(rngs.params(), name, s, dtype, config.norm_offset)
                       for name, s in shapes.items()}
        missing = sorted(set(shapes) - set(weights))
        if missing:
            raise ValueError(f"weights missing: {missing}")
        self.weights = nnx.Dict({name: nnx.Param(jnp.asarray(weights[name], dtype)) for name in shapes})

    def _w(self, name: str) -> jax.Array:
        return self.weights[name][...]

    def layer_weights(self) -> dict[str, jax.Array]:
        """The stacked per-layer weights (leading axis = layer), for `jax.lax.scan`."""
        return {name[len("layers."):]: self._w(name) for name in self.weights if name.startswith("layers.")}

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] int -> hidden [B, T, d] (`embed_tokens`)."""
        return embed_tokens(self.config, self._w("embed_tokens"), tokens)

    def final_hidden(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., d] -> the final norm's output [..., d] (what the LM head and task heads read)."""
        return final_hidden(self.config, self._w("norm"), hidden)

    def unembed(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., d] -> logits [..., vocab] float32 (`final_logits`)."""
        head = self._w("embed_tokens").T if self.config.tie_word_embeddings else self._w("lm_head")
        return final_logits(self.config, self._w("norm"), head, hidden)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        cache: KVCache | None = None,
        logit_indices: jax.Array | None = None,
        lora: LoraInputs | None = None,
        lora_backend: LoraBackend | str = backends.DEFAULT,
        attention: str = "auto",
        unroll_layers: bool | int = 1,
        remat: str = "none",
        features: bool = False,
        embeds: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Runs the decoder.

        Args:
          tokens: [B, T] token ids.
          positions: [B, T] position of each token in its own sample (RoPE and cache slot).
          segment_ids: [B, T] sample id of each token in a packed row (packed mode only);
            tokens attend only within their segment, causally by index. None: one sample a row.
          cache: a `KVCache` for incremental decoding; None for packed mode.
          logit_indices: [B] index along T whose logits to return; None: all positions.
          lora: adapters and the plan over the B*T tokens (each token its own slot, or -1).
          lora_backend: how the LoRA op is computed: a `LoraBackend` of `jaxlora.lora.backends`, or its
            name (resolved here, once per call).
          attention: packed mode's attention, "auto" | "masked" | "flash"
            (see `jaxlora.nn.layers.packed_attention`); the cache path always masks.
          unroll_layers: layers per iteration of the layer scan (True: all). Unrolled, XLA slices
            each layer's weights statically instead of copying them out of the stack every
            iteration (faster GPU training steps: bench/NOTES_train.md); compiles slower.
          remat: what the backward keeps of each layer (`REMAT_POLICIES`): "none" everything,
            "layer" only its input (the rest recomputed), "save_dots" its input and the
            matmul outputs (attention and elementwise ops recomputed).
          features: return the final norm's output [B, T, d] (or [B, d]) instead of the logits
            (what a task head reads, `jaxlora.lora.head`).
          embeds: [B, T, d] input embeddings used instead of `embed(tokens)` (a vision-language
            model's, with image features at the image tokens: `jaxlora.vision.llava`).

        Returns:
          (logits [B, T, vocab] or [B, vocab] float32 (features: [B, T, d] or [B, d] in the
          weights' dtype), the updated cache or None).
        """
        config = self.config
        backend = backends.get(lora_backend)
        hidden = self.embed(tokens) if embeds is None else embeds.astype(self.dtype)
        if cache is None:
            packed = PackedAttention(_packed_mask(tokens.shape, segment_ids, config, attention))
        else:
            mask = jnp.arange(cache.k.shape[2])[None, None, :] <= positions[:, :, None]

        def layer(hidden, per_layer):
            weights, layer_cache, layer_pool, layer_index = per_layer
            kv = packed if cache is None else DenseCacheAttention(*layer_cache, positions, mask)
            lora_context = layer_lora(lora, layer_pool, backend, layer_index)
            hidden, kv = decoder_layer(config, weights, hidden, positions, layer_index, kv, lora_context)
            return hidden, (None if cache is None else (kv.k, kv.v))

        if REMAT_POLICIES[remat] is not None:
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat](), prevent_cse=False)
        per_layer_cache = None if cache is None else (cache.k, cache.v)
        per_layer_pool = None if lora is None else lora.pool
        hidden, new_cache = jax.lax.scan(
            layer, hidden, (self.layer_weights(), per_layer_cache, per_layer_pool, jnp.arange(config.num_layers)),
            unroll=unroll_layers,
        )
        if logit_indices is not None:
            hidden = jnp.take_along_axis(hidden, logit_indices[:, None, None], axis=1)[:, 0]
        out = self.final_hidden(hidden) if features else self.unembed(hidden)
        return out, (None if cache is None else KVCache(*new_cache))


class SplitLayersLlama(Llama):
    """A `Llama` whose decoder layers' weights are one array a layer (`layer_<i>.<name>`), not stacked
    (`split_layers`): `layer_weights` is a list of per-layer dicts and the paged forward loops over
    them in Python. Every layer's GEMMs then read a whole argument, not a slice of a stack, so XLA's
    autotuner sees 32 equal fusions, not 32 different ones (issue 35; a probe, `bench/compile_time.py
    --split-layers`)."""

    def __call__(self, *args, **kwargs):
        raise NotImplementedError("a split-layers model runs through the paged forward only "
                                  "(jaxlora.models.paged); training and the contiguous cache scan the stacked layers")

    def layer_weights(self) -> list[dict[str, jax.Array]]:
        """[{name: weight of layer i}] for i in range(num_layers)."""
        layers = [{} for _ in range(self.config.num_layers)]
        for name in self.weights:
            if name.startswith("layer_"):
                index, _, rest = name[len("layer_"):].partition(".")
                layers[int(index)][rest] = self._w(name)
        return layers


def layer_key(index: int, name: str) -> str:
    """The weight name of layer `index`'s `name` in a `SplitLayersLlama` (`layers.<name>` stacked)."""
    return f"layer_{index}.{name}"


def split_layers(model: Llama) -> SplitLayersLlama:
    """`model`, changed in place into a `SplitLayersLlama`: each stacked `layers.<name>` [L, ...] becomes
    L arrays `layer_<i>.<name>` (copies; the stack is dropped)."""
    for name in [n for n in model.weights if n.startswith("layers.")]:
        stacked = model.weights[name][...]
        del model.weights[name]
        for index in range(stacked.shape[0]):
            model.weights[layer_key(index, name[len("layers."):])] = nnx.Param(stacked[index])
        del stacked
    model.__class__ = SplitLayersLlama
    return model


def embed_tokens(config: LlamaConfig, table: jax.Array, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] int -> hidden [B, T, d]: rows of table [vocab, d], times `embed_scale` in the
    table's dtype (Gemma; as HF rounds it)."""
    hidden = jnp.take(table, tokens, axis=0)
    return hidden if config.embed_scale is None else hidden * jnp.asarray(config.embed_scale, table.dtype)


def final_hidden(config: LlamaConfig, norm: jax.Array, hidden: jax.Array) -> jax.Array:
    """hidden [..., d] -> the final norm [d]'s output [..., d] (the LM head's and task heads' input)."""
    return rms_norm(hidden, norm, config.rms_norm_eps, config.norm_offset)


def final_logits(config: LlamaConfig, norm: jax.Array, head: jax.Array, hidden: jax.Array) -> jax.Array:
    """hidden [..., d] -> logits [..., vocab] float32: the final norm [d] (`final_hidden`), head
    [d, vocab], then soft-capped if configured (Gemma 2)."""
    return softcap(dense(final_hidden(config, norm, hidden), head), config.final_logit_softcap)


def _packed_mask(shape: tuple[int, int], segment_ids: jax.Array | None, config: LlamaConfig,
                 impl: str = "auto"):
    """Causal by index, only within the same segment (one segment a row when segment_ids is None):
    a [B, T, T] bool mask or the flash kernel's `PackedSegments` (`packed_attention`). Sliding
    windows are applied per layer by `PackedAttention.attend`."""
    if segment_ids is None:
        segment_ids = jnp.zeros(shape, jnp.int32)
    return packed_attention(segment_ids, config.head_dim, impl, windowed=any(config.layer_windows()),
                            softcapped=config.attn_logit_softcap is not None)


class PackedAttention(NamedTuple):
    """Keys/values of the step only (no cache): packed training/scoring rows. mask: [B, T, T] bool
    or the flash kernel's `PackedSegments` (`jaxlora.nn.layers.packed_attention`)."""

    mask: jax.Array | PackedSegments

    def attend(self, q, k, v, spec: AttentionSpec | None = None):
        """q [B, T, H, Dh], k/v [B, T, Hkv, Dh] -> ([B, T, H, Dh], self). A window counts by index
        (a packed sample's tokens are contiguous)."""
        mask = self.mask
        if spec is not None and spec.window is not None and not isinstance(mask, PackedSegments):
            index = jnp.arange(q.shape[1])[None]
            mask = mask & window_mask(index, index, spec.window)
        return attend(q, k, v, mask, spec), self


class DenseCacheAttention(NamedTuple):
    """One layer's dense cache for incremental decoding: k, v [B, S, Hkv, Dh]; the step's keys and
    values go to `positions` [B, T]; mask [B, T, S]: query t sees cache slots <= its position."""

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    mask: jax.Array

    def attend(self, q, k, v, spec: AttentionSpec | None = None):
        """Writes k/v [B, T, Hkv, Dh] at their positions, then attends over the whole cache (cache
        slot = position; a window masks slots <= position - window)."""
        rows = jnp.arange(q.shape[0])[:, None]
        k_all = self.k.at[rows, self.positions].set(k.astype(self.k.dtype), mode="drop")
        v_all = self.v.at[rows, self.positions].set(v.astype(self.v.dtype), mode="drop")
        mask = self.mask
        if spec is not None and spec.window is not None:
            mask = mask & window_mask(self.positions, jnp.arange(self.k.shape[1])[None], spec.window)
        out = attend(q, k_all.astype(q.dtype), v_all.astype(q.dtype), mask, spec)
        return out, self._replace(k=k_all, v=v_all)


def decoder_layer(config, weights, hidden, positions, layer_index, kv, layer_lora: LayerLora | None = None,
                  reduce_partial=None):
    """One decoder layer (pre-norm; with Gemma's norms after attention and MLP too), for every
    cache kind.

    Args:
      hidden: [B, T, d]; positions: [B, T] (RoPE).
      layer_index: the layer's index (int or traced int32): picks its window and RoPE base where
        layers differ (Gemma 2/3, Qwen's max_window_layers).
      kv: where attention's keys and values live, an object with `attend(q [B, T, H, Dh],
        k [B, T, Hkv, Dh], v, spec: AttentionSpec) -> (out [B, T, H, Dh], kv')`: `PackedAttention`
        (no cache), `DenseCacheAttention`, or the serving engine's paged cache
        (`jaxlora.models.paged.PagedCacheAttention`).
      layer_lora: this layer's `LayerLora` or None.
      reduce_partial: tensor parallel inside shard_map: sums the row-parallel o_proj/down_proj
        partial outputs over the shards.

    Returns:
      (hidden [B, T, d], kv' with the step's keys/values written).
    """
    reduce_partial = reduce_partial or (lambda y: y)
    norm = lambda x, name: rms_norm(x, weights[name], config.rms_norm_eps, config.norm_offset)
    batch, length, _ = hidden.shape
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    x = norm(hidden, "input_layernorm")
    q, k, v = project_group(x, weights, ("q_proj", "k_proj", "v_proj"), layer_lora,
                            (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim))
    q = q.reshape(batch, length, heads, head_dim)
    k, v = k.reshape(batch, length, kv_heads, head_dim), v.reshape(batch, length, kv_heads, head_dim)
    if config.qk_norm:  # Qwen3, Gemma 3: each head's query and key normalised before RoPE
        q, k = norm(q, "q_norm"), norm(k, "k_norm")
    inv_freq, rope_scale = rope_frequencies(config, positions, layer_index)
    q, k = apply_rope(q, positions, inv_freq, rope_scale), apply_rope(k, positions, inv_freq, rope_scale)
    spec = AttentionSpec(config.scores_scale, config.attn_logit_softcap, layer_window(config, layer_index))
    attn, kv = kv.attend(q, k, v, spec)
    out = reduce_partial(_project(attn.reshape(batch, length, heads * head_dim), weights, "o_proj", layer_lora))
    hidden = hidden + (norm(out, "post_attention_layernorm") if config.sandwich_norms else out)
    x = norm(hidden, "pre_feedforward_layernorm" if config.sandwich_norms else "post_attention_layernorm")
    gate, up = project_group(x, weights, ("gate_proj", "up_proj"), layer_lora,
                             (config.intermediate_size, config.intermediate_size))
    act = ACTIVATION_FUNCTIONS[config.hidden_act]
    out = reduce_partial(_project(act(gate) * up, weights, "down_proj", layer_lora))
    hidden = hidden + (norm(out, "post_feedforward_layernorm") if config.sandwich_norms else out)
    return hidden, kv
