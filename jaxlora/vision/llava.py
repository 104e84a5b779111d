"""LLaVA-1.5 in Flax NNX: `VisionTower` (CLIP ViT + projector) + our `Llama` language model.

The prompt holds `tokens_per_image` image tokens per image (`jaxlora.vision.preprocess.
expand_image_tokens`); their embeddings are replaced, in order over the rows of the batch (as
`transformers`' masked_scatter does), by the images' embeddings; the language model then runs as
for text, with any LoRA adapters of the language model (`lora=`: each token its own adapter slot,
image tokens included, as PEFT applies it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlora.buckets import bucket
from jaxlora.models.llama import KVCache, Llama
from jaxlora.vision.clip import VisionTower
from jaxlora.vision.config import LlavaConfig

__all__ = ["Llava", "TowerEncoder", "check_image_tokens", "embed_with_images", "image_row_index",
           "merge_image_embeddings"]


def merge_image_embeddings(text: jax.Array, tokens: jax.Array, image_token_id: int, images: jax.Array) -> jax.Array:
    """text [B, T, d] with the image-token positions of tokens [B, T] replaced, in row-major order,
    by the rows of images [M, d] (M = N images * tokens_per_image; [N, P, d] is flattened).
    Positions past the M-th image token keep their text embedding (`check_image_tokens` refuses
    a mismatch before the jitted call)."""
    images = images.reshape(-1, images.shape[-1]).astype(text.dtype)
    mask = tokens == image_token_id
    index = jnp.cumsum(mask.reshape(-1)).reshape(mask.shape) - 1
    valid = mask & (index < images.shape[0])
    picked = jnp.take(images, jnp.clip(index, 0, images.shape[0] - 1), axis=0)
    return jnp.where(valid[..., None], picked, text)


def embed_with_images(language: Llama, tokens: jax.Array, image_token_id: int,
                      image_embeds: jax.Array | None = None) -> jax.Array:
    """tokens [B, T] -> the language model's input embeddings [B, T, d]: the token table's rows,
    image tokens replaced by image_embeds ([N, P, d] or [M, d], in row-major order of the image
    tokens; rows past the last image token are unused; None: text only)."""
    mask = tokens == image_token_id
    text = language.embed(jnp.where(mask, 0, tokens))  # the image token's own row is never used
    if image_embeds is None:
        return text
    return merge_image_embeddings(text, tokens, image_token_id, image_embeds)


@functools.partial(jax.jit, static_argnums=0)
def _encode(graphdef, state, pixels):
    return nnx.merge(graphdef, state).encode(pixels)


class TowerEncoder:
    """A frozen vision tower (`VisionTower`: CLIP ViT + projector, no LoRA) as one jitted call
    whose image count is padded to a power of two (one program per bucket)."""

    def __init__(self, tower: VisionTower, dtype=jnp.float32):
        self._graphdef, self._state = nnx.split(tower)
        self.dtype = dtype

    def __call__(self, pixels: np.ndarray) -> jax.Array:
        """pixels [N, C, H, W] (host) -> embeddings [N', P, d], N' = N rounded up to a power of
        two (rows of the padding images after the N real ones)."""
        pixels = np.asarray(pixels, np.float32)
        padded = bucket(len(pixels), 1)
        if padded > len(pixels):
            pixels = np.concatenate([pixels, np.zeros((padded - len(pixels),) + pixels.shape[1:], np.float32)])
        return _encode(self._graphdef, self._state, jnp.asarray(pixels, self.dtype))


def check_image_tokens(tokens, image_token_id: int, num_images: int, tokens_per_image: int) -> None:
    """ValueError unless tokens (host ids, any shape) hold exactly num_images * tokens_per_image
    image tokens (transformers raises the same)."""
    found = int(np.sum(np.asarray(tokens) == image_token_id))
    if found != num_images * tokens_per_image:
        raise ValueError(f"the prompt holds {found} image tokens, but {num_images} images need "
                         f"{num_images * tokens_per_image} ({tokens_per_image} each: expand each <image> token "
                         f"with jaxlora.vision.preprocess.expand_image_tokens)")


def image_row_index(prompt, image_token_id: int, begin: int = 0, end: int | None = None, first_row: int = 0
                    ) -> np.ndarray:
    """For the tokens prompt[begin:end] of one request (a chunk of its prefill), the row of the
    step's image embeddings each takes ([end - begin] int32; -1: a text token): the request's
    image tokens, counted from the prompt's start, offset by `first_row` (where the request's
    rows start among the step's; `jaxlora.models.paged.paged_hidden(image_rows=)`)."""
    mask = np.asarray(prompt) == image_token_id
    before = np.cumsum(mask) - 1
    end = len(mask) if end is None else end
    return np.where(mask[begin:end], before[begin:end] + first_row, -1).astype(np.int32)


class Llava(nnx.Module):
    """LLaVA-1.5: `self.vision` (`VisionTower`) and `self.language` (`Llama`, with the text
    config `config.text`)."""

    def __init__(self, config: LlavaConfig, *, vision: VisionTower | None = None, language: Llama | None = None,
                 rngs: nnx.Rngs | None = None, dtype=jnp.float32):
        self.config = config
        self.dtype = dtype
        rngs = rngs or nnx.Rngs(0)
        self.vision = vision if vision is not None else VisionTower(config, rngs=rngs, dtype=dtype)
        self.language = language if language is not None else Llama(config.text, rngs=rngs, dtype=dtype)

    def encode_images(self, pixels: jax.Array, tower_lora=None) -> jax.Array:
        """pixels [N, C, H, W] -> image embeddings [N, tokens_per_image, d]; tower_lora: each
        image's adapter on the vision tower (`jaxlora.vision.tower_lora.TowerLoraInputs`) or None."""
        return self.vision.encode(pixels, tower_lora)

    def embed(self, tokens: jax.Array, image_embeds: jax.Array | None = None) -> jax.Array:
        """tokens [B, T] -> input embeddings [B, T, d]: the token table's rows, image tokens
        replaced by image_embeds ([N, P, d] or [N*P, d]; None: text only)."""
        return embed_with_images(self.language, tokens, self.config.image_token_id, image_embeds)

    def __call__(self, tokens: jax.Array, positions: jax.Array, *, pixel_values: jax.Array | None = None,
                 image_embeds: jax.Array | None = None, tower_lora=None, **language_kwargs) -> tuple[jax.Array, KVCache | None]:
        """Runs the model on a prompt with images.

        Args:
          tokens: [B, T] ids, each image as `tokens_per_image` image tokens (in image order).
          positions: [B, T] positions (RoPE, cache slots), as for `Llama`.
          pixel_values: [N, C, H, W] preprocessed images, in the order of their tokens; or
          image_embeds: [N, tokens_per_image, d] already encoded (`encode_images`). Neither: text.
          tower_lora: LoRA on the vision tower per image (`jaxlora.vision.tower_lora`), or None.
          language_kwargs: `Llama.__call__`'s (cache, logit_indices, lora, lora_backend, ...).

        Returns:
          `Llama.__call__`'s (logits [B, T, vocab] or [B, vocab] float32, cache or None).
        """
        if pixel_values is not None:
            if image_embeds is not None:
                raise ValueError("pass pixel_values or image_embeds, not both")
            image_embeds = self.encode_images(pixel_values, tower_lora)
        embeds = self.embed(tokens, image_embeds)
        return self.language(tokens, positions, embeds=embeds, **language_kwargs)
