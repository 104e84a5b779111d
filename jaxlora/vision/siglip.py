"""Idefics3's vision tower (SigLIP with NaViT-style position buckets) and connector in Flax NNX.

tiles [N, C, S, S] -> patches (one matmul over each patch's C*p*p pixels, plus the conv's bias)
-> + position embeddings (for a full tile, patch (i, j) takes the bucket transformers computes
from its fractional coordinates: `position_ids`; row-major for the shipped checkpoints' 32, 27
and 26 patches a side on the CPU; transformers' CUDA arange rounds its boundaries otherwise and
gives other buckets at 26 and 27, so transformers itself differs by device there) -> encoder layers (CLIP's layer:
`jaxlora.vision.clip.encoder_layer`, no mask, scanned over stacked weights) -> post LayerNorm ->
pixel shuffle (each s x s block of patches concatenated along features) -> connector (one linear,
no bias) -> [N, tokens_per_image, text hidden]. No CLS, no pre-LayerNorm.

Weights (`Idefics3Tower.weights`, flat names; kernels [in, out]):
  patch_embedding [C*p*p, D], patch_bias [D], position_embedding [P, D],
  layers.* as `jaxlora.vision.clip` ([L, ...]), post_layernorm.weight/.bias [D],
  connector.kernel [D * s^2, d].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlora.nn.layers import dense
from jaxlora.vision.clip import LAYER_NORMS, encoder_layer, layer_norm, linear_shapes, patchify, tower_params
from jaxlora.vision.idefics3_config import Idefics3Config


def weight_shapes(config: Idefics3Config) -> dict[str, tuple[int, ...]]:
    """The shape of every weight of the tower and connector, keyed by its flat name (module doc)."""
    vision, layers, d = config.vision, config.vision.num_layers, config.vision.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embedding": (vision.patch_features, d),
        "patch_bias": (d,),
        "position_embedding": (vision.num_patches, d),
        "post_layernorm.weight": (d,),
        "post_layernorm.bias": (d,),
        "connector.kernel": (config.connector_in, config.text.hidden_size),
    }
    for norm in LAYER_NORMS:
        shapes[f"layers.{norm}.weight"] = shapes[f"layers.{norm}.bias"] = (layers, d)
    for name, (fan_in, fan_out) in linear_shapes(vision).items():
        shapes[f"layers.{name}.kernel"] = (layers, fan_in, fan_out)
        shapes[f"layers.{name}.bias"] = (layers, fan_out)
    return shapes


def torch_cpu_arange(start: float, end: float, step: float) -> np.ndarray:
    """float32 `torch.arange(start, end, step)` as torch computes it on the CPU: ceil((end -
    start) / step) elements; those in whole pairs of 8-lane vectors as a float32 base (start + step
    * its first index, in double) plus lane * step in double, the rest as start + step * i in
    double; each rounded to float32 (one rounding more than start + step * i for most)."""
    size = max(0, int(np.ceil((end - start) / step)))
    out = np.asarray(start + step * np.arange(size, dtype=np.float64), np.float32)
    vectors = size // 16 * 16  # torch's CPU loop: two 8-float vectors at a time, the tail element-wise
    if vectors:
        bases = np.asarray(start + step * np.arange(0, vectors, 8, dtype=np.float64), np.float32)
        lanes = np.arange(8, dtype=np.float64) * step
        out[:vectors] = np.asarray(bases.astype(np.float64)[:, None] + lanes[None, :], np.float32).reshape(-1)
    return out


def position_ids(side: int) -> np.ndarray:
    """[side * side] int32: the position embedding row of each patch of a full tile, as
    transformers' `Idefics3VisionEmbeddings` buckets them on the CPU: float32 fractional
    coordinates i * (1 / side) against the boundaries `torch.arange(1/side, 1.0, 1/side)`,
    `bucketize(right=True)`. Row-major i * side + j for most sides (every power of two; 26, 27);
    float rounding moves some rows and columns to the bucket below for others (19, 25, 29, ...).
    transformers on a GPU computes the boundaries in float32 and may differ (module doc)."""
    boundaries = torch_cpu_arange(1 / side, 1.0, 1 / side)
    step = np.float32(1.0) / np.float32(side)
    coords = np.minimum(np.arange(side, dtype=np.float32) * step, np.float32(1.0 - 1e-6))
    buckets = np.searchsorted(boundaries, coords, side="right")
    return (buckets[:, None] * side + buckets[None, :]).reshape(-1).astype(np.int32)


def pixel_shuffle(x: jax.Array, scale: int) -> jax.Array:
    """x [N, P, D] (P = side^2 patches, row-major) -> [N, P / s^2, D * s^2]: transformers'
    `Idefics3Connector.pixel_shuffle` (each s x s block's features concatenated)."""
    n, seq, d = x.shape
    side = int(round(seq**0.5))
    x = x.reshape(n, side, side // scale, d * scale).transpose(0, 2, 1, 3)
    x = x.reshape(n, side // scale, side // scale, d * scale * scale).transpose(0, 2, 1, 3)
    return x.reshape(n, seq // scale**2, d * scale * scale)


class Idefics3Tower(nnx.Module):
    """SigLIP tower + pixel shuffle + connector: `encode(tiles [N, C, S, S]) -> [N,
    tokens_per_image, text hidden]`. Weights in `self.weights[name]` (names in the module doc)."""

    def __init__(self, config: Idefics3Config, *, weights: dict[str, jax.Array] | None = None,
                 rngs: nnx.Rngs | None = None, dtype=jnp.float32):
        self.config = config
        self.dtype = dtype
        self.weights = tower_params(weight_shapes(config), weights, rngs, dtype)

    def _w(self, name: str) -> jax.Array:
        return self.weights[name][...]

    def hidden_states(self, pixels: jax.Array, lora=None) -> jax.Array:
        """tiles [N, C, S, S] -> the last hidden state after the post LayerNorm [N, P, D]. lora: a
        `jaxlora.vision.tower_lora.TowerLoraInputs` (each tile its adapter) or None."""
        vision = self.config.vision
        if pixels.shape[1:] != (vision.num_channels, vision.image_size, vision.image_size):
            raise ValueError(f"pixel values must be [N, {vision.num_channels}, {vision.image_size}, "
                             f"{vision.image_size}], got {tuple(pixels.shape)}")
        patches = dense(patchify(pixels.astype(self.dtype), vision.patch_size), self._w("patch_embedding"))
        positions = jnp.take(self._w("position_embedding"), position_ids(vision.image_size // vision.patch_size),
                             axis=0)
        hidden = (patches + self._w("patch_bias").astype(jnp.float32) + positions.astype(jnp.float32))
        layers = {name[len("layers."):]: self._w(name) for name in self.weights if name.startswith("layers.")}
        slots = None if lora is None else lora.slots

        def step(hidden, per_layer):
            layer_weights, layer_lora = per_layer
            return encoder_layer(vision, layer_weights, hidden, layer_lora, slots), None

        last, _ = jax.lax.scan(step, hidden.astype(self.dtype), (layers, None if lora is None else lora.weights))
        return layer_norm(last, self._w("post_layernorm.weight"), self._w("post_layernorm.bias"),
                          vision.layer_norm_eps)

    def encode(self, pixels: jax.Array, lora=None) -> jax.Array:
        """tiles [N, C, S, S] (preprocessed: `jaxlora.vision.idefics3_preprocess`) -> image
        embeddings [N, tokens_per_image, text hidden], one per image token of the prompt."""
        shuffled = pixel_shuffle(self.hidden_states(pixels, lora), self.config.scale_factor)
        return dense(shuffled, self._w("connector.kernel")).astype(shuffled.dtype)
