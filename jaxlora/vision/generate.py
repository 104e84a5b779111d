"""Generation with images in the prompt (LLaVA, Idefics3): the images (Idefics3: their tiles) are encoded in one batch, written
into the prefill's input embeddings at their image tokens, and `jaxlora.generate.generate` runs
the language model (KV cache, sampling, LoRA adapters per prompt) from there."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlora.generate import generate
from jaxlora.sampling import SamplingParams
from jaxlora.vision.llava import Llava, check_image_tokens
from jaxlora.vision.prompts import expand_prompt


@functools.partial(jax.jit, static_argnums=0)
def _encode(graphdef, state, pixels):
    return nnx.merge(graphdef, state).encode_images(pixels)


@functools.partial(jax.jit, static_argnums=0)
def _embed(graphdef, state, tokens, image_embeds):
    return nnx.merge(graphdef, state).embed(tokens, image_embeds)


def generate_with_images(
    model: Llava,
    prompts: Sequence[Sequence[int]],
    pixel_values: np.ndarray | None,
    params: SamplingParams = SamplingParams(),
    eos_token_ids: Sequence[int] = (),
    pool_arrays: dict | None = None,
    row_slots: Sequence[int] | None = None,
    lora_backend: str = "gather",
) -> list[list[int]]:
    """`jaxlora.generate.generate` for prompts with images.

    Args:
      prompts: token ids, each image as `config.tokens_per_image` image tokens
        (`jaxlora.vision.preprocess.expand_image_tokens`).
      pixel_values: [N, C, H, W] preprocessed images of all prompts, in order (prompt 0's first,
        each prompt's in the order of their tokens); None for text only.
      params, eos_token_ids, pool_arrays, row_slots, lora_backend: as `generate`'s (adapters
        apply to the language model).

    Returns:
      the new token ids of each prompt.
    """
    config = model.config
    count = 0 if pixel_values is None else int(np.shape(pixel_values)[0])
    check_image_tokens(np.concatenate([np.asarray(p, np.int64) for p in prompts]) if prompts else [],
                       config.image_token_id, count, config.tokens_per_image)
    if count == 0:
        return generate(model.language, prompts, params, eos_token_ids, pool_arrays, row_slots, lora_backend)
    graphdef, state = nnx.split(model)
    image_embeds = _encode(graphdef, state, jnp.asarray(pixel_values, model.dtype))

    def embed_prompts(tokens: np.ndarray) -> jax.Array:
        return _embed(graphdef, state, jnp.asarray(tokens), image_embeds)

    return generate(model.language, prompts, params, eos_token_ids, pool_arrays, row_slots, lora_backend,
                    embed_prompts=embed_prompts)


def generate_text_with_images(model: Llava, tokenizer, processor, prompts: Sequence[str],
                              images: Sequence[Sequence], params: SamplingParams = SamplingParams(),
                              chat: bool = False) -> list[str]:
    """String in, string out: each prompt's `<image>` placeholders take its images (Pillow
    images or uint8 arrays) in order, laid out by the family's processor (`load_vlm`'s third
    value: `jaxlora.vision.prompts.expand_prompt`); `chat=True` wraps each prompt as a user message
    in the chat template first."""
    if len(images) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but images for {len(images)}")
    config = model.config
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) if chat else p for p in prompts]
    expanded = [expand_prompt(processor, config.image_token_id, config.tokens_per_image, tokenizer.encode(text), group)
                for text, group in zip(texts, images)]
    pixels = [e.pixels for e in expanded if e.pixels is not None]
    outputs = generate_with_images(model, [e.ids for e in expanded], np.concatenate(pixels) if pixels else None,
                                   params, tokenizer.eos_token_ids)
    return [tokenizer.decode(out) for out in outputs]
