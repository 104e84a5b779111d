"""Images in the serving engine (issue 39): a VLM's vision tower beside the engine's language model.

`ImageServing` holds the tower (LLaVA: CLIP ViT + projector, `jaxlora.vision.clip.VisionTower`;
Idefics3: SigLIP + pixel shuffle + connector, `jaxlora.vision.siglip.Idefics3Tower`), the
processor (image settings and prompt layout: `jaxlora.vision.prompts`) and the image token. The
tower's unit is an image for LLaVA and a tile for Idefics3 (an image of rows x cols tiles is
rows * cols + 1 tower images): "images" below are the tower's. A request with images
(`Engine.submit(..., images=ImageInput)`) carries its preprocessed pixel values [n, C, H, W] and a
digest of them. At the step that first computes one of its image tokens (its first prefill chunk,
after any cached prefix; or again after a preemption) the engine encodes the pixel values of every
such request of the step in one jitted call (`encode`: the images padded to a power of two), keeps
each request's rows [n * P, d] until its prefill is done, and gives each prefill chunk's step the
rows of its requests (`step_rows`: concatenated, padded to a power of two of rows) with each token's
row (`jaxlora.vision.llava.image_row_index`; -1: text) for `paged_hidden(image_rows=)`. A step
without image tokens runs the same programs as a text-only engine.

Prefix caching: an image request's blocks are cached under a root salted with its images' digest
(`Sequence.prefix_salt`), so they are shared only with requests of the same images.
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.buckets import bucket
from jaxlora.lora.adapter import LoraAdapter
from jaxlora.vision.adapters import load_vlm_adapter
from jaxlora.vision.loading import IMAGE_TOKEN
from jaxlora.vision.llava import Llava, TowerEncoder, check_image_tokens, image_row_index
from jaxlora.vision.prompts import expand_prompt

__all__ = ["IMAGE_TOKEN", "ImageInput", "ImageServing"]


@dataclasses.dataclass(frozen=True)
class ImageInput:
    """A request's images: pixel values [n, C, H, W] float32 (in the order of their tokens) and a
    digest of them (the prefix cache's salt)."""

    pixels: np.ndarray
    digest: bytes

    @staticmethod
    def of(pixels: np.ndarray) -> "ImageInput":
        pixels = np.ascontiguousarray(pixels, np.float32)
        digest = hashlib.sha256(repr(pixels.shape).encode() + pixels.tobytes()).digest()
        return ImageInput(pixels, digest)

    def __len__(self) -> int:
        return int(self.pixels.shape[0])


class ImageServing:
    """A VLM's vision side for the engine (module doc): `Engine(model.language, ...,
    images=ImageServing(model, processor))`, model and processor from `load_vlm`."""

    def __init__(self, model: Llava, processor):
        self.config = model.config
        self.processor = processor
        self.image_token_id = int(model.config.image_token_id)
        self.tokens_per_image = int(model.config.tokens_per_image)
        self.dtype = model.dtype
        self._encoder = TowerEncoder(model.vision, model.dtype)
        self.encodes = 0  # tower calls (tests, stats)

    # ---- requests -------------------------------------------------------------------------------
    def prompt(self, ids: list[int], images: list) -> tuple[list[int], ImageInput | None]:
        """A tokenised prompt with one image token per image (`<image>`) and its images (Pillow
        images or uint8 arrays) -> the ids with the family's image layout and the `ImageInput` (the
        tower's images; None without images); ValueError if the placeholders and the images do
        not match."""
        expanded = expand_prompt(self.processor, self.image_token_id, self.tokens_per_image, ids, images)
        return expanded.ids, (ImageInput.of(expanded.pixels) if images else None)

    def check(self, prompt: list[int], images: ImageInput | None) -> None:
        """ValueError unless the prompt holds exactly the images' image tokens."""
        check_image_tokens(prompt, self.image_token_id, 0 if images is None else len(images), self.tokens_per_image)
        if images is not None:
            want = (3, self.config.vision.image_size, self.config.vision.image_size)
            if tuple(images.pixels.shape[1:]) != want:
                raise ValueError(f"pixel values of shape {tuple(images.pixels.shape[1:])}; this model takes {want}")

    def read_adapter(self, path: str, name: str) -> LoraAdapter:
        """A PEFT adapter saved on the VLM, as an adapter of its language model (stored dtype
        kept; the tower's and projector's LoRA refused by name)."""
        return load_vlm_adapter(path, self.config, name, keep_dtype=True)

    # ---- steps ----------------------------------------------------------------------------------
    def encode(self, pixels: list[np.ndarray]) -> list[jax.Array]:
        """The rows [n_i * P, d] of each request's pixel values [n_i, C, H, W], in one tower call
        over the images padded to a power of two."""
        counts = [len(p) for p in pixels]
        out = self._encoder(np.concatenate(pixels))
        self.encodes += 1
        rows, start = [], 0
        for count in counts:
            rows.append(out[start:start + count].reshape(-1, out.shape[-1]))
            start += count
        return rows

    def step_rows(self, chunks: list[tuple[list[int], int, int, jax.Array | None]], num_tokens: int):
        """(rows [M, d], index [num_tokens] int32) of a step's rows in order, each (prompt, start,
        count, its request's image rows or None); M: the rows of the step's image requests,
        padded to a power of two (>= 8). None when no row holds an image token."""
        index = np.full(num_tokens, -1, np.int32)
        parts, offset, total = [], 0, 0
        for prompt, start, count, rows in chunks:
            if rows is not None:
                end = min(start + count, len(prompt))
                if end > start:
                    index[offset:offset + end - start] = image_row_index(prompt, self.image_token_id, start, end,
                                                                         total)
                parts.append(rows)
                total += rows.shape[0]
            offset += count
        if not parts or not (index >= 0).any():
            return None
        size = bucket(total, 8)
        if size > total:
            parts.append(jnp.zeros((size - total, parts[0].shape[-1]), parts[0].dtype))
        return jnp.concatenate(parts), index

    def plan_rows(self, plan_rows, requests: dict, num_tokens: int) -> tuple | None:
        """A step's (image rows [M, d], index [num_tokens]) or None (`step_rows`), its rows
        (`PlanRow`s in serving order) looked up in `requests` (seq_id -> the engine's `Request`):
        the images of the requests whose chunk holds image tokens are encoded now if they are not
        yet (one tower call), and a request's rows are let go once its prefill is done."""
        chunks, new = [], []
        for row in plan_rows:
            request = requests.get(row.seq.seq_id)
            prompt = row.seq.prompt
            end = min(row.start + row.count, len(prompt))
            if (request is None or request.images is None or end <= row.start
                    or self.image_token_id not in prompt[row.start:end]):
                chunks.append((prompt, row.start, row.count, None))
                continue
            if request.image_embeds is None:  # one row per request in a step
                new.append(request)
            chunks.append((prompt, row.start, row.count, request))
        if new:
            for request, rows in zip(new, self.encode([r.images.pixels for r in new])):
                request.image_embeds = rows
        chunks = [(p, start, count, None if r is None else r.image_embeds) for p, start, count, r in chunks]
        out = self.step_rows(chunks, num_tokens)
        for row in plan_rows:  # a request's rows are kept until its prefill is done
            request = requests.get(row.seq.seq_id)
            if request is not None and request.images is not None and row.start + row.count >= len(row.seq.prompt):
                request.image_embeds = None
        return out
