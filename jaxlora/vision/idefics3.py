"""Idefics3 / SmolVLM in Flax NNX: `Idefics3Tower` (SigLIP + pixel shuffle + connector) + our
`Llama` language model (SmolLM2 for SmolVLM, Llama 3 for Idefics3-8B).

The language model is causal throughout (image tokens included), as LLaVA's: the prompt holds
`tokens_per_image` image tokens per tile, in the order of the tiles (`jaxlora.vision.prompts`),
and their embeddings are replaced, in row-major order, by the tiles' embeddings. Only the tower
differs, so `Idefics3` is a `Llava` with another tower: `encode_images`, `embed`, `__call__`
(`Llama`'s kwargs: cache, LoRA, ...), the training step, generation and the serving engine are
shared."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxlora.models.llama import Llama
from jaxlora.vision.idefics3_config import Idefics3Config
from jaxlora.vision.llava import Llava
from jaxlora.vision.siglip import Idefics3Tower

__all__ = ["Idefics3"]


class Idefics3(Llava):
    """Idefics3: `self.vision` (`Idefics3Tower`) and `self.language` (`Llama`, `config.text`).
    `encode_images(tiles [N, C, S, S]) -> [N, tokens_per_image, d]`; the rest is `Llava`'s."""

    def __init__(self, config: Idefics3Config, *, vision: Idefics3Tower | None = None,
                 language: Llama | None = None, rngs: nnx.Rngs | None = None, dtype=jnp.float32):
        rngs = rngs or nnx.Rngs(0)
        vision = vision if vision is not None else Idefics3Tower(config, rngs=rngs, dtype=dtype)
        super().__init__(config, vision=vision, language=language, rngs=rngs, dtype=dtype)
