"""The CLIP ViT vision tower and LLaVA's multimodal projector in Flax NNX.

pixels [N, C, H, W] -> patches (a conv with kernel = stride = patch: one matmul over each patch's
C*p*p pixels) -> [CLS, patches] + learned positions -> pre LayerNorm -> encoder layers (pre-norm:
LayerNorm -> MHA with biases, no mask -> residual; LayerNorm -> fc1 -> act -> fc2 -> residual),
run with `jax.lax.scan` over weights stacked on a leading layer axis, only up to the deepest
feature layer -> the feature layers' hidden states (CLS dropped for "default") -> projector
(linear_1 -> act -> linear_2) -> [N, tokens_per_image, text hidden].

Weights (`VisionTower.weights`, flat names; kernels [in, out]):
  patch_embedding [C*p*p, D], class_embedding [D], position_embedding [P+1, D],
  pre_layrnorm.weight/.bias [D], layers.{layer_norm1,layer_norm2}.{weight,bias} [L, D],
  layers.{q_proj,k_proj,v_proj,out_proj}.kernel [L, D, D] / .bias [L, D],
  layers.fc1.kernel [L, D, F], layers.fc1.bias [L, F], layers.fc2.kernel [L, F, D], .bias [L, D],
  projector.linear_1.kernel [D * features, d], projector.linear_2.kernel [d, d] (+ .bias [d]).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlora.nn.layers import AttentionSpec, attention, dense
from jaxlora.vision.config import ClipVisionConfig, LlavaConfig

ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
}
LAYER_LINEARS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
LAYER_NORMS = ("layer_norm1", "layer_norm2")


def linear_shapes(vision: ClipVisionConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear layer of one encoder layer."""
    d, f = vision.hidden_size, vision.intermediate_size
    return {"q_proj": (d, d), "k_proj": (d, d), "v_proj": (d, d), "out_proj": (d, d), "fc1": (d, f), "fc2": (f, d)}


def weight_shapes(config: LlavaConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every weight of the tower and projector, keyed by its flat name (module doc)."""
    vision, layers, d = config.vision, config.vision.num_layers, config.vision.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embedding": (vision.patch_features, d),
        "class_embedding": (d,),
        "position_embedding": (vision.num_patches + 1, d),
        "pre_layrnorm.weight": (d,),
        "pre_layrnorm.bias": (d,),
    }
    for norm in LAYER_NORMS:
        shapes[f"layers.{norm}.weight"] = shapes[f"layers.{norm}.bias"] = (layers, d)
    for name, (fan_in, fan_out) in linear_shapes(vision).items():
        shapes[f"layers.{name}.kernel"] = (layers, fan_in, fan_out)
        shapes[f"layers.{name}.bias"] = (layers, fan_out)
    text = config.text.hidden_size
    for name, fan_in in (("linear_1", config.projector_in), ("linear_2", text)):
        shapes[f"projector.{name}.kernel"] = (fan_in, text)
        if config.projector_bias:
            shapes[f"projector.{name}.bias"] = (text,)
    return shapes


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis, in float32 (as torch computes it), returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (normed * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _linear(x: jax.Array, kernel: jax.Array, bias: jax.Array | None) -> jax.Array:
    """x [..., in] @ kernel [in, out] (+ bias [out]), accumulated in float32, in x's dtype."""
    y = dense(x, kernel)
    return (y if bias is None else y + bias.astype(jnp.float32)).astype(x.dtype)


def patchify(pixels: jax.Array, patch: int) -> jax.Array:
    """pixels [N, C, H, W] -> [N, (H/p)*(W/p), C*p*p]: row-major patches, each (C, p, p) flattened
    (the conv weight [D, C, p, p]'s layout)."""
    n, c, h, w = pixels.shape
    grid = pixels.reshape(n, c, h // patch, patch, w // patch, patch)
    return grid.transpose(0, 2, 4, 1, 3, 5).reshape(n, (h // patch) * (w // patch), c * patch * patch)


def tower_lora_delta(x: jax.Array, layer_weights: tuple, slots: jax.Array) -> jax.Array:
    """x [N, T, in] -> each image's LoRA delta [N, T, out] float32 (zero for slot -1).
    layer_weights: one layer's (a [S, in, r], b [S, r, out], scale [S]); slots [N] in [-1, S)."""
    a, b, scale = layer_weights
    safe = jnp.clip(slots, 0, a.shape[0] - 1)
    down = jnp.einsum("ntd,ndr->ntr", x, a[safe].astype(x.dtype), preferred_element_type=jnp.float32)
    up = jnp.einsum("ntr,nro->nto", down.astype(x.dtype), b[safe].astype(x.dtype), preferred_element_type=jnp.float32)
    return up * jnp.where(slots >= 0, scale[safe], 0.0)[:, None, None]


def encoder_layer(vision: ClipVisionConfig, weights: dict[str, jax.Array], hidden: jax.Array,
                  lora: dict | None = None, slots: jax.Array | None = None) -> jax.Array:
    """One CLIP encoder layer: hidden [N, T, D] -> [N, T, D] (weights: one layer's slice). lora:
    module -> this layer's (a [S, in, r], b [S, r, out], scale [S]) with slots [N] each image's
    adapter (`jaxlora.vision.tower_lora`); None: no LoRA."""
    n, t, d = hidden.shape
    norm = lambda x, name: layer_norm(x, weights[f"{name}.weight"], weights[f"{name}.bias"], vision.layer_norm_eps)

    def lin(x, name):
        y = dense(x, weights[f"{name}.kernel"]) + weights[f"{name}.bias"].astype(jnp.float32)
        if lora is not None and name in lora:
            y = y + tower_lora_delta(x, lora[name], slots)
        return y.astype(x.dtype)

    x = norm(hidden, "layer_norm1")
    heads = lambda y: y.reshape(n, t, vision.num_heads, vision.head_dim)
    q, k, v = heads(lin(x, "q_proj")), heads(lin(x, "k_proj")), heads(lin(x, "v_proj"))
    everything = jnp.ones((n, t, t), bool)  # no mask: every patch sees every patch
    attn = attention(q, k, v, everything, AttentionSpec(vision.head_dim**-0.5))
    hidden = hidden + lin(attn.reshape(n, t, d), "out_proj")
    x = norm(hidden, "layer_norm2")
    return hidden + lin(ACTIVATIONS[vision.hidden_act](lin(x, "fc1")), "fc2")


class VisionTower(nnx.Module):
    """CLIP ViT + projector: `encode(pixels [N, C, H, W]) -> [N, tokens_per_image, text hidden]`.
    Weights in `self.weights[name]` (an `nnx.Param` each; names in the module doc)."""

    def __init__(self, config: LlavaConfig, *, weights: dict[str, jax.Array] | None = None,
                 rngs: nnx.Rngs | None = None, dtype=jnp.float32):
        self.config = config
        self.dtype = dtype
        self.weights = tower_params(weight_shapes(config), weights, rngs, dtype)

    def _w(self, name: str) -> jax.Array:
        return self.weights[name][...]

    def hidden_states(self, pixels: jax.Array, lora=None) -> jax.Array:
        """pixels [N, C, H, W] -> the feature layers' hidden states [N, P + 1, D * features]
        (concatenated along features in `feature_layers` order; position 0 is CLS). lora: a
        `jaxlora.vision.tower_lora.TowerLoraInputs` (each image its adapter) or None."""
        config, vision = self.config, self.config.vision
        if pixels.shape[1:] != (vision.num_channels, vision.image_size, vision.image_size):
            raise ValueError(f"pixel values must be [N, {vision.num_channels}, {vision.image_size}, "
                             f"{vision.image_size}], got {tuple(pixels.shape)}")
        patches = dense(patchify(pixels.astype(self.dtype), vision.patch_size), self._w("patch_embedding"))
        n = pixels.shape[0]
        cls = jnp.broadcast_to(self._w("class_embedding").astype(jnp.float32), (n, 1, vision.hidden_size))
        hidden = jnp.concatenate([cls, patches], axis=1) + self._w("position_embedding").astype(jnp.float32)
        hidden = layer_norm(hidden.astype(self.dtype), self._w("pre_layrnorm.weight"), self._w("pre_layrnorm.bias"),
                            vision.layer_norm_eps)
        layers = {name[len("layers."):]: self._w(name) for name in self.weights if name.startswith("layers.")}
        keep_all = config.feature_layers != (vision.num_layers,)

        slots = None if lora is None else lora.slots

        def step(hidden, per_layer):
            layer_weights, layer_lora = per_layer
            hidden = encoder_layer(vision, layer_weights, hidden, layer_lora, slots)
            return hidden, (hidden if keep_all else None)

        last, stacked = jax.lax.scan(step, hidden, (layers, None if lora is None else lora.weights))
        if not keep_all:
            return last
        states = jnp.concatenate([hidden[None], stacked], axis=0)  # [L + 1, N, T, D]
        return jnp.concatenate([states[layer] for layer in config.feature_layers], axis=-1)

    def project(self, features: jax.Array) -> jax.Array:
        """features [..., D * features] -> [..., text hidden] (linear_1 -> act -> linear_2)."""
        bias = (lambda name: self._w(name)) if self.config.projector_bias else (lambda name: None)
        x = _linear(features, self._w("projector.linear_1.kernel"), bias("projector.linear_1.bias"))
        x = ACTIVATIONS[self.config.projector_act](x)
        return _linear(x, self._w("projector.linear_2.kernel"), bias("projector.linear_2.bias"))

    def encode(self, pixels: jax.Array, lora=None) -> jax.Array:
        """pixels [N, C, H, W] (preprocessed: `jaxlora.vision.preprocess`) -> image embeddings
        [N, tokens_per_image, text hidden], one per image token of the prompt. lora: the tower's
        adapters (`jaxlora.vision.tower_lora.TowerLoraInputs`) or None."""
        states = self.hidden_states(pixels, lora)
        if self.config.feature_strategy == "default":
            states = states[:, 1:]
        return self.project(states)


def tower_params(shapes: dict[str, tuple[int, ...]], weights: dict[str, jax.Array] | None,
                 rngs: nnx.Rngs | None, dtype) -> nnx.Dict:
    """A tower's parameters (`nnx.Param` per name of `shapes`, in `dtype`): `weights` (ValueError
    naming the missing ones), or random ones from `rngs` (default seed 0) when None."""
    if weights is None:
        rngs = rngs or nnx.Rngs(0)
        weights = {name: _random_weight(rngs.params(), name, shape) for name, shape in shapes.items()}
    missing = sorted(set(shapes) - set(weights))
    if missing:
        raise ValueError(f"vision weights missing: {missing}")
    return nnx.Dict({name: nnx.Param(jnp.asarray(weights[name], dtype)) for name in shapes})


def _random_weight(key: jax.Array, name: str, shape: tuple[int, ...]) -> jax.Array:
    if name.endswith(".bias"):
        return jnp.zeros(shape, jnp.float32)
    if "norm" in name:
        return jnp.ones(shape, jnp.float32)
    fan_in = shape[-2] if len(shape) >= 2 and "embedding" not in name else shape[-1]
    return jax.random.normal(key, shape, jnp.float32) * fan_in**-0.5
