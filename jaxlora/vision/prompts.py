"""A prompt's images, family by family: each image placeholder token (`<image>`) of a tokenised
prompt becomes the family's image-token layout, and the images become the pixel values the
vision tower takes, in the order of their image tokens.

  * LLaVA-1.5 (`ImageProcessorConfig`): each `<image>` -> `tokens_per_image` image tokens; one
    tower image [C, H, W] an image.
  * Idefics3 / SmolVLM (`Idefics3Processing`): each `<image>` -> `Idefics3Processor`'s layout for
    that image's tiles (`<fake_token_around_image>`, `<row_r_col_c>`, `<global-img>`, newlines and
    `tokens_per_image` image tokens a tile); one tower image a tile, so the image tokens of a
    prompt are still `tokens_per_image` per tower image, row-major.

The tower images' embeddings then replace the image tokens in order (`jaxlora.vision.llava.
merge_image_embeddings`), for both families."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from jaxlora.vision.idefics3_preprocess import MAX_IMAGE_SIZE, Idefics3ImageConfig, preprocess_idefics3_image
from jaxlora.vision.preprocess import ImageError, ImageProcessorConfig, expand_image_tokens, preprocess_images

IMAGE_TOKEN = "<image>"  # both families' placeholder in prompts
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"


@dataclasses.dataclass(frozen=True)
class ExpandedPrompt:
    """ids: the prompt with its image layout; counts[i]: how many of `ids` input token i became
    (1 for text); pixels: the tower's images [n, C, H, W] float32 (None without images)."""

    ids: list[int]
    counts: list[int]
    pixels: np.ndarray | None


@dataclasses.dataclass(frozen=True)
class Idefics3Processing:
    """Idefics3's processor: its image settings and the token ids of the layout's pieces (each
    tokenised alone: they sit between special tokens, so the whole layout tokenises the same)."""

    image: Idefics3ImageConfig
    image_token_id: int
    tokens_per_image: int  # image tokens a tile (the processor's image_seq_len)
    fake: tuple[int, ...]
    global_image: tuple[int, ...]
    newline: tuple[int, ...]
    two_newlines: tuple[int, ...]
    row_col: tuple[tuple[tuple[int, ...], ...], ...]  # [r][c]: `<row_{r+1}_col_{c+1}>`

    def output_size(self) -> tuple[int, int]:
        return self.image.output_size()

    def layout(self, rows: int, cols: int) -> list[int]:
        """The ids one image of rows x cols tiles (0, 0: a single tile) becomes."""
        images = [self.image_token_id] * self.tokens_per_image
        tail = [*self.fake, *self.global_image, *images, *self.fake]
        if rows == 0 and cols == 0:
            return tail
        if rows > len(self.row_col) or cols > len(self.row_col[0]):
            raise ImageError(f"an image of {rows}x{cols} tiles is more than this processor makes")
        ids: list[int] = []
        for r in range(rows):
            for c in range(cols):
                ids += [*self.fake, *self.row_col[r][c], *images]
            if r + 1 < rows:
                ids += self.newline
        return ids + [*self.two_newlines, *tail]


def idefics3_processing(image: Idefics3ImageConfig, encode: Callable[[str], list[int]], image_token_id: int,
                        tokens_per_image: int) -> Idefics3Processing:
    """Builds the layout's pieces with `encode` (text -> ids, no BOS); ValueError unless
    `<image>` and `<fake_token_around_image>` are single (added) tokens, `<image>` the config's."""
    for token, want in ((IMAGE_TOKEN, image_token_id), (FAKE_TOKEN, None)):
        ids = encode(token)
        if len(ids) != 1 or (want is not None and ids[0] != want):
            raise ValueError(f"the tokenizer reads {token!r} as {ids}, not as one added token"
                             + (f" (id {want})" if want is not None else ""))
    side = 1  # tiles a side at most: from the first resize's longest edge (any up to 4096 without it)
    if image.do_image_splitting:
        longest = (max(image.resize_to) if image.resize_to else image.longest_edge) if image.do_resize else None
        side = max(1, math.ceil(min(longest or MAX_IMAGE_SIZE, MAX_IMAGE_SIZE) / image.tile))
    row_col = tuple(tuple(tuple(encode(f"<row_{r + 1}_col_{c + 1}>")) for c in range(side)) for r in range(side))
    return Idefics3Processing(image, image_token_id, tokens_per_image, tuple(encode(FAKE_TOKEN)),
                              tuple(encode(GLOBAL_TOKEN)), tuple(encode("\n")), tuple(encode("\n\n")), row_col)


def expand_prompt(processor, image_token_id: int, tokens_per_image: int, ids: Sequence[int],
                  images: Sequence) -> ExpandedPrompt:
    """A tokenised prompt with one `image_token_id` per image and its images (Pillow images or
    uint8 arrays, in order) -> `ExpandedPrompt`; ValueError (ImageError) if the placeholders and
    the images differ in number. processor: the family's (`ImageProcessorConfig` for LLaVA,
    `Idefics3Processing`)."""
    placeholders = sum(1 for token in ids if token == image_token_id)
    if isinstance(processor, Idefics3Processing):
        if placeholders != len(images):
            raise ImageError(f"the prompt holds {placeholders} image tokens ({IMAGE_TOKEN} placeholders), but "
                             f"{len(images)} images were given")
        tiles = [preprocess_idefics3_image(image, processor.image) for image in images]
        layouts = iter([processor.layout(rows, cols) for _, rows, cols in tiles])
        pieces = [next(layouts) if token == image_token_id else [token] for token in ids]
        pixels = np.concatenate([t for t, _, _ in tiles]) if tiles else None
        return ExpandedPrompt([t for piece in pieces for t in piece], [len(p) for p in pieces], pixels)
    if not isinstance(processor, ImageProcessorConfig):
        raise TypeError(f"no prompt layout for a {type(processor).__name__}")
    if placeholders != len(images):
        raise ImageError(f"the prompt holds {placeholders * tokens_per_image} image tokens, but {len(images)} images "
                         f"need {len(images) * tokens_per_image} ({tokens_per_image} each: one {IMAGE_TOKEN} an image)")
    counts = [tokens_per_image if token == image_token_id else 1 for token in ids]
    return ExpandedPrompt(expand_image_tokens(ids, image_token_id, tokens_per_image), counts,
                          preprocess_images(images, processor) if images else None)
