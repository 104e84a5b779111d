"""Image preprocessing equal to `transformers`' Idefics3 image processor (its Pillow + numpy
backend, `Idefics3ImageProcessorPil`; SmolVLM's too), without torch:

  RGB (alpha on white) -> resize so the longest edge is `size.longest_edge` (aspect kept, the
  other edge made even, at most 4096) -> with image splitting (the default): resize up to
  multiples of the tile (`max_image_size.longest_edge`), cut into rows x cols tiles (row-major)
  plus the whole image resized to one tile (the "global image"), or the image alone when it is a
  single tile (rows = cols = 0); without splitting: resized to one tile -> rescale (float64 ->
  float32) and normalise (float32) each tile.

Every tile is `tile` x `tile` pixels, so the processor's padding never pads pixels (only the
count of images in a batch, which here is a list) and its `pixel_attention_mask` is all ones.
Settings come from `preprocessor_config.json` (`idefics3_image_config_from_hf`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np
from PIL import Image

from jaxlora.vision.preprocess import ImageError, read_image_processor, rescale_normalize, resize_array, to_rgb_array

LANCZOS = 1  # PIL.Image.Resampling.LANCZOS, Idefics3's default resample
MAX_IMAGE_SIZE = 4096  # transformers' bound on the resized image's longest edge
IMAGENET_STANDARD = (0.5, 0.5, 0.5)


@dataclasses.dataclass(frozen=True)
class Idefics3ImageConfig:
    """HF Idefics3 image processor settings. `longest_edge`: the first resize's target
    (`size.longest_edge`), or `resize_to` (height, width) when `size` gives both; `tile`: the
    vision tower's square input (`max_image_size.longest_edge`)."""

    longest_edge: int | None = 4 * 364
    resize_to: tuple[int, int] | None = None
    tile: int = 364
    resample: int = LANCZOS
    do_resize: bool = True
    do_image_splitting: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = IMAGENET_STANDARD
    image_std: tuple[float, ...] = IMAGENET_STANDARD
    do_convert_rgb: bool = True

    def __post_init__(self):
        if self.do_resize and self.longest_edge is None and self.resize_to is None:
            raise ImageError("image processor: do_resize needs size.longest_edge or size.height/width")
        if self.tile < 1:
            raise ImageError(f"image processor: max_image_size.longest_edge {self.tile} must be positive")

    def output_size(self) -> tuple[int, int]:
        """(height, width) of every tile."""
        return self.tile, self.tile


def idefics3_image_config_from_hf(raw: Mapping[str, Any], source: str = "preprocessor_config.json"
                                  ) -> Idefics3ImageConfig:
    """The settings of a HF Idefics3 image processor dict; other processors refused by name."""
    kind = str(raw.get("image_processor_type", "Idefics3ImageProcessor"))
    if not kind.removesuffix("Fast").removesuffix("Pil").endswith("Idefics3ImageProcessor"):
        raise ImageError(f"{source}: image_processor_type {kind!r} is not Idefics3's (Idefics3ImageProcessor)")
    size = raw.get("size") or {"longest_edge": 4 * 364}
    tile = raw.get("max_image_size") or {"longest_edge": 364}
    if not isinstance(tile, Mapping) or tile.get("longest_edge") is None:
        raise ImageError(f"{source}: max_image_size {tile!r} is not supported (a longest_edge is)")
    values: dict[str, Any] = dict(tile=int(tile["longest_edge"]), resample=int(raw.get("resample", LANCZOS)))
    if isinstance(size, Mapping) and size.get("longest_edge") is not None:
        values["longest_edge"] = int(size["longest_edge"])
    elif isinstance(size, Mapping) and size.get("height") is not None and size.get("width") is not None:
        values.update(longest_edge=None, resize_to=(int(size["height"]), int(size["width"])))
    else:
        raise ImageError(f"{source}: size {size!r} is not supported (longest_edge, or height and width)")
    for key in ("image_mean", "image_std"):
        if raw.get(key) is not None:
            value = raw[key]
            values[key] = tuple(float(x) for x in (value if isinstance(value, (list, tuple)) else [value] * 3))
    for key in ("do_resize", "do_image_splitting", "do_rescale", "do_normalize", "do_convert_rgb"):
        if raw.get(key) is not None:
            values[key] = bool(raw[key])
    if raw.get("rescale_factor") is not None:
        values["rescale_factor"] = float(raw["rescale_factor"])
    try:
        return Idefics3ImageConfig(**values)
    except ImageError as err:
        raise ImageError(f"{source}: {err}") from None


def read_idefics3_image_config(path: str) -> Idefics3ImageConfig:
    """The Idefics3 image processor settings of a HF model directory (`preprocessor_config.json`
    or `processor_config.json`'s `image_processor`)."""
    return read_image_processor(path, parse=idefics3_image_config_from_hf)


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """(height, width) with the longest edge `longest` (aspect kept, int() of the other edge, made
    even), then scaled under MAX_IMAGE_SIZE: transformers' Idefics3 `get_resize_output_image_size`."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """(height, width) rounded up to multiples of `tile` along the longer edge first, the other
    from the aspect: transformers' Idefics3 `resize_for_vision_encoder`."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def split_tiles(image: np.ndarray, tile: int, resample: int) -> tuple[list[np.ndarray], int, int]:
    """[C, H, W] uint8, H and W multiples of `tile` -> (tiles: rows x cols crops row-major, then
    the whole image resized to one tile; rows; cols), or ([image], 0, 0) if it is one tile."""
    _, height, width = image.shape
    if height <= tile and width <= tile:
        return [image], 0, 0
    rows, cols = (height - tile) // tile + 1, (width - tile) // tile + 1
    tiles = [image[:, r * tile:(r + 1) * tile, c * tile:(c + 1) * tile] for r in range(rows) for c in range(cols)]
    tiles.append(resize_array(image, (tile, tile), resample))
    return tiles, rows, cols


def preprocess_idefics3_image(image: Image.Image | np.ndarray, config: Idefics3ImageConfig
                              ) -> tuple[np.ndarray, int, int]:
    """One image (Pillow, or uint8 [H, W(, C)]) -> (pixel values [n, C, tile, tile] float32 of its
    tiles in the processor's order, rows, cols); n = rows * cols + 1, or 1 when rows = cols = 0."""
    array = to_rgb_array(image, config.do_convert_rgb)
    if config.do_resize:
        size = config.resize_to or longest_edge_size(array.shape[1], array.shape[2], config.longest_edge)
        array = resize_array(array, size, config.resample)
    if config.do_image_splitting:
        array = resize_array(array, tile_multiple_size(array.shape[1], array.shape[2], config.tile), config.resample)
        tiles, rows, cols = split_tiles(array, config.tile, config.resample)
    else:
        tiles, rows, cols = [resize_array(array, (config.tile, config.tile), config.resample)], 0, 0
    scale = config.rescale_factor if config.do_rescale else None
    mean_std = (config.image_mean, config.image_std) if config.do_normalize else None
    return np.stack([rescale_normalize(t, scale, mean_std) for t in tiles]), rows, cols


def image_prompt_text(rows: int, cols: int, tokens_per_tile: int, image_token: str = "<image>",
                      fake_token: str = "<fake_token_around_image>", global_token: str = "<global-img>") -> str:
    """The text one `<image>` becomes (`Idefics3Processor`'s layout): each tile as
    `<fake_token_around_image><row_r_col_c>` + `<image>` x tokens_per_tile, a newline after each
    row, then `\\n<fake_token_around_image><global-img>` + `<image>` x tokens_per_tile +
    `<fake_token_around_image>`; an image of one tile (rows = cols = 0) only the global part,
    without the newlines."""
    images = image_token * tokens_per_tile
    tail = f"{fake_token}{global_token}{images}{fake_token}"
    if rows == 0 and cols == 0:
        return tail
    grid = "".join("".join(f"{fake_token}<row_{r + 1}_col_{c + 1}>{images}" for c in range(cols)) + "\n"
                   for r in range(rows))
    return f"{grid}\n{tail}"
