"""Image preprocessing equal to `transformers`' CLIP / LLaVA image processor (its Pillow + numpy
backend, `LlavaImageProcessorPil` / `CLIPImageProcessorPil`), without torch: RGB conversion
(transparency composited onto white), optional pad-to-square with the mean colour, resize of the
shortest edge (Pillow, bicubic by default), center crop, rescale (in float64, then float32) and
normalise (float32); and the prompt's image-token layout (each `<image>` token repeated once per
image embedding, as `LlavaProcessor` does).

Settings come from the model directory's `preprocessor_config.json` (`read_image_processor`)."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import json
import math
import os
import re
from typing import Any, Mapping, Sequence

import numpy as np
from PIL import Image

# CLIP's (OpenAI's) normalisation, transformers' OPENAI_CLIP_MEAN / _STD.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC; HF's `resample` values are PIL's
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG"}  # data URL media -> Pillow format
_DATA_URL = re.compile(r"data:(?P<media>[\w/+.-]+)?(?P<params>(?:;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,")


class ImageError(ValueError):
    """An image (or image processor config) that cannot be preprocessed; the message says why."""


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
    """HF image processor settings (`preprocessor_config.json` keys). `shortest_edge`: resize so
    the shorter side has this many pixels (aspect kept); else `resize_to` (height, width)."""

    shortest_edge: int | None = 224
    resize_to: tuple[int, int] | None = None
    crop_size: tuple[int, int] = (224, 224)  # (height, width)
    resample: int = BICUBIC
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    do_convert_rgb: bool = True
    do_pad: bool = False  # LLaVA: pad to a square of the mean colour before resizing

    def __post_init__(self):
        if self.do_resize and self.shortest_edge is None and self.resize_to is None:
            raise ImageError("image processor: do_resize needs size.shortest_edge or size.height/width")

    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every preprocessed image, or None when it depends on the image."""
        if self.do_center_crop:
            return self.crop_size
        if self.do_resize and self.resize_to is not None:
            return self.resize_to
        return None


def _size_pair(value: Any, what: str) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    if isinstance(value, Mapping) and "height" in value and "width" in value:
        return int(value["height"]), int(value["width"])
    raise ImageError(f"image processor: unsupported {what} {value!r} (an int or height/width)")


def image_processor_from_hf(raw: Mapping[str, Any], source: str = "preprocessor_config.json") -> ImageProcessorConfig:
    """The settings of a HF image processor dict (CLIP / LLaVA processors); others refused."""
    kind = str(raw.get("image_processor_type", "CLIPImageProcessor"))
    if not kind.removesuffix("Fast").removesuffix("Pil").endswith(("CLIPImageProcessor", "LlavaImageProcessor")):
        raise ImageError(f"{source}: image_processor_type {kind!r} is not supported (CLIP / LLaVA processors are)")
    size = raw.get("size", {"shortest_edge": 224})
    shortest, resize_to = None, None
    if isinstance(size, Mapping) and size.get("shortest_edge") is not None:
        if size.get("longest_edge") is not None:
            raise ImageError(f"{source}: size with both shortest_edge and longest_edge is not supported")
        shortest = int(size["shortest_edge"])
    elif isinstance(size, int) and not raw.get("default_to_square", False):
        shortest = size
    else:
        resize_to = _size_pair(size, "size")
    values = dict(
        shortest_edge=shortest, resize_to=resize_to, crop_size=_size_pair(raw.get("crop_size", 224), "crop_size"),
        resample=int(raw.get("resample", BICUBIC)),
        image_mean=tuple(float(x) for x in raw.get("image_mean") or CLIP_MEAN),
        image_std=tuple(float(x) for x in raw.get("image_std") or CLIP_STD),
    )
    for key in ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb", "do_pad"):
        if raw.get(key) is not None:
            values[key] = bool(raw[key])
    if raw.get("rescale_factor") is not None:
        values["rescale_factor"] = float(raw["rescale_factor"])
    try:
        return ImageProcessorConfig(**values)
    except ImageError as err:
        raise ImageError(f"{source}: {err}") from None


def read_image_processor(path: str, parse=image_processor_from_hf):
    """The image processor of a HF model directory: `preprocessor_config.json`, or the
    `image_processor` entry of `processor_config.json`, read by `parse(raw dict, file)` (CLIP /
    LLaVA settings by default; Idefics3's: `jaxlora.vision.idefics3_preprocess`)."""
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        file = os.path.join(path, name)
        if not os.path.exists(file):
            continue
        try:
            with open(file) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise ImageError(f"{file}: cannot read: {err}") from err
        raw = raw.get(key) if key else raw
        if isinstance(raw, Mapping):
            return parse(raw, file)
    raise ImageError(f"{path}: no preprocessor_config.json (the image processor's settings)")


def to_rgb_array(image: Image.Image | np.ndarray, convert_rgb: bool) -> np.ndarray:
    """[C, H, W] uint8 (or the array's dtype): transformers' `convert_to_rgb` (alpha composited
    onto white) then channels first. Arrays are [H, W], or [H, W, C] with C in 1, 3, 4."""
    if isinstance(image, Image.Image):
        if convert_rgb:
            if "A" in image.getbands() or image.info.get("transparency") is not None:
                rgba = image.convert("RGBA")
                white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                image = Image.alpha_composite(white, rgba).convert("RGB")
            else:
                image = image.convert("RGB")
        array = np.array(image)
    else:
        array = np.asarray(image)
        if array.ndim == 3 and array.shape[-1] not in (1, 3, 4):
            raise ImageError(f"an image array must be [H, W] or [H, W, C] with C in 1, 3, 4; got {array.shape}")
        if convert_rgb and array.ndim == 3 and array.shape[-1] == 1:
            array = np.repeat(array, 3, axis=-1)
        elif convert_rgb and array.ndim == 3 and array.shape[-1] == 4:
            if not np.issubdtype(array.dtype, np.integer):
                raise ImageError("an RGBA image array must be uint8")
            alpha = array[..., 3:4] / 255
            array = np.round(alpha * array[..., :3] + (1 - alpha) * 255).astype(array.dtype)
    if array.ndim == 2:
        return array[None]
    if array.ndim != 3:
        raise ImageError(f"an image must have 2 or 3 dimensions, got shape {array.shape}")
    return np.moveaxis(array, -1, 0)


def _pad_to_square(image: np.ndarray, mean: Sequence[float]) -> np.ndarray:
    """LLaVA's `pad_to_square`: [C, H, W] centred in a square of the mean colour (0-255)."""
    channels, height, width = image.shape
    if height == width:
        return image
    side = max(height, width)
    colour = [int(x * 255) for x in mean] if mean else [0]
    if len(colour) not in (1, channels):
        raise ImageError(f"pad colour has {len(colour)} values for {channels} channels")
    out = np.zeros((channels, side, side), image.dtype)
    for channel, value in enumerate(colour):
        out[channel] = value
    if width > height:
        start = (side - height) // 2
        out[:, start:start + height, :] = image
    else:
        start = (side - width) // 2
        out[:, :, start:start + width] = image
    return out


def _resize_shape(height: int, width: int, config: ImageProcessorConfig) -> tuple[int, int]:
    """(height, width) after the resize: transformers' `get_resize_output_image_size` with
    default_to_square=False (int() of the scaled longer side), or the fixed size."""
    if config.shortest_edge is None:
        return config.resize_to
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = config.shortest_edge, int(config.shortest_edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def resize_array(image: np.ndarray, size: tuple[int, int], resample: int) -> np.ndarray:
    """[C, H, W] uint8 resized by Pillow to size (height, width), as transformers' `resize`."""
    if image.dtype != np.uint8:
        raise ImageError(f"resizing needs a uint8 image (as Pillow holds it), got {image.dtype}")
    pixels = np.moveaxis(image, 0, -1)
    pixels = pixels[..., 0] if pixels.shape[-1] == 1 else pixels
    resized = np.array(Image.fromarray(pixels).resize((size[1], size[0]), resample=resample))
    resized = resized[..., None] if resized.ndim == 2 else resized
    return np.moveaxis(resized, -1, 0)


def _center_crop(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """transformers' `center_crop` of [C, H, W]: the centred window, zero-padded where the image
    is smaller than it."""
    _, height, width = image.shape
    crop_h, crop_w = size
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    if top >= 0 and left >= 0 and top + crop_h <= height and left + crop_w <= width:
        return image[:, top:top + crop_h, left:left + crop_w]
    new_h, new_w = max(crop_h, height), max(crop_w, width)
    padded = np.zeros(image.shape[:-2] + (new_h, new_w), image.dtype)
    top_pad, left_pad = math.ceil((new_h - height) / 2), math.ceil((new_w - width) / 2)
    padded[..., top_pad:top_pad + height, left_pad:left_pad + width] = image
    top, left = top + top_pad, left + left_pad
    return padded[..., max(0, top):min(new_h, top + crop_h), max(0, left):min(new_w, left + crop_w)]


def preprocess_image(image: Image.Image | np.ndarray, config: ImageProcessorConfig) -> np.ndarray:
    """One image (a Pillow image, or a uint8 [H, W(, C)] array) -> pixel values [C, H', W']
    float32, as the `transformers` processor computes them."""
    array = to_rgb_array(image, config.do_convert_rgb)
    if config.do_pad:
        array = _pad_to_square(array, config.image_mean)
    if config.do_resize:
        array = resize_array(array, _resize_shape(array.shape[1], array.shape[2], config), config.resample)
    if config.do_center_crop:
        array = _center_crop(array, config.crop_size)
    return rescale_normalize(array, config.rescale_factor if config.do_rescale else None,
                             (config.image_mean, config.image_std) if config.do_normalize else None)


def rescale_normalize(array: np.ndarray, rescale_factor: float | None,
                      mean_std: tuple[tuple[float, ...], tuple[float, ...]] | None) -> np.ndarray:
    """[C, H, W] -> float32 [C, H, W]: times rescale_factor (in float64, then float32; None: not
    rescaled), then (x - mean) / std per channel in float32 (None: not normalised), as transformers'
    `rescale` and `normalize`."""
    if rescale_factor is not None:
        array = (array.astype(np.float64) * rescale_factor).astype(np.float32)
    if mean_std is not None:
        if not np.issubdtype(array.dtype, np.floating):
            array = array.astype(np.float32)
        mean = np.array(mean_std[0], dtype=array.dtype)
        std = np.array(mean_std[1], dtype=array.dtype)
        if len(mean) != array.shape[0] or len(std) != array.shape[0]:
            raise ImageError(f"image_mean/std have {len(mean)}/{len(std)} values for {array.shape[0]} channels")
        array = ((array.T - mean) / std).T
    return np.ascontiguousarray(array, dtype=np.float32)


def preprocess_images(images: Sequence[Image.Image | np.ndarray], config: ImageProcessorConfig) -> np.ndarray:
    """Images -> pixel values [N, C, H, W] float32 (every image preprocessed to the same size)."""
    if not images:
        raise ImageError("no images to preprocess")
    arrays = [preprocess_image(image, config) for image in images]
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise ImageError(f"preprocessed images differ in shape: {sorted(shapes)}")
    return np.stack(arrays)


def expand_image_tokens(token_ids: Sequence[int], image_token_id: int, tokens_per_image: int) -> list[int]:
    """The prompt's image-token layout: each `image_token_id` repeated `tokens_per_image` times
    (`LlavaProcessor` repeats the `<image>` text before tokenising; the tokenizer splits on the
    special token, so this is the same ids)."""
    out: list[int] = []
    for token in token_ids:
        out.extend([token] * tokens_per_image if token == image_token_id else [token])
    return out


def count_images(token_ids: Sequence[int], image_token_id: int, tokens_per_image: int) -> int:
    """How many images an expanded prompt holds; ImageError if a run of image tokens is not a
    whole number of images."""
    total = sum(1 for token in token_ids if token == image_token_id)
    if total % tokens_per_image:
        raise ImageError(f"{total} image tokens are not a multiple of {tokens_per_image} tokens per image")
    return total // tokens_per_image


def decode_data_url(url: str, max_bytes: int, max_pixels: int) -> Image.Image:
    """The RGB image of a `data:image/png;base64,...` (or image/jpeg) URL, at most `max_bytes`
    decoded bytes and `max_pixels` pixels; ImageError saying what is wrong (not a data URL: a
    remote or file URL is never fetched; malformed; another media type; too large; unreadable)."""
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else "(none)"
        raise ImageError(f"image URLs are not fetched (scheme {scheme!r}): the server fetches nothing on a "
                         "client's behalf; send the image inline as a data: URL "
                         "(data:image/png;base64,... or data:image/jpeg;base64,...)")
    header = _DATA_URL.match(url)
    if header is None or header.group("b64") is None:
        raise ImageError("malformed image data URL: expected data:image/png;base64,<data> or "
                         "data:image/jpeg;base64,<data>")
    media = (header.group("media") or "").lower()
    if media not in MEDIA_TYPES:
        raise ImageError(f"image media type {media or '(none)'!r} is not accepted: PNG or JPEG only "
                         "(image/png, image/jpeg)")
    encoded = url[header.end():]
    if len(encoded) > 4 * (-(-max_bytes // 3)) + 4:
        raise ImageError(f"image is larger than {max_bytes} bytes")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ImageError(f"malformed image data URL: the data is not valid base64 ({err})") from err
    if len(raw) > max_bytes:
        raise ImageError(f"image is larger than {max_bytes} bytes ({len(raw)})")
    return open_image(raw, max_pixels, MEDIA_TYPES[media])


def open_image(raw: bytes, max_pixels: int, expected: str | None = None) -> Image.Image:
    """Decodes image bytes (as an `expected` Pillow format, e.g. "PNG"; None: PNG or JPEG) to RGB,
    its size checked from the header before its pixels are decoded; ImageError otherwise."""
    formats = [expected] if expected else ["PNG", "JPEG"]
    try:
        with Image.open(io.BytesIO(raw), formats=formats) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise ImageError(f"image has {width}x{height} pixels, more than the {max_pixels} allowed")
            return image.convert("RGB")
    except ImageError:
        raise
    except Image.DecompressionBombError as err:  # past Pillow's own bound, refused before its size is read
        raise ImageError(f"image has more than the {max_pixels} pixels allowed") from err
    except Exception as err:  # Pillow's UnidentifiedImageError, truncated data, a bomb warning ...
        raise ImageError(f"image data is not a readable {expected or 'PNG or JPEG'} image "
                         f"({type(err).__name__})") from err
