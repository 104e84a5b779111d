"""Images from requests and job files, with bounds: `data:` URLs (base64 PNG / JPEG / ...), raw
bytes, or files. Remote URLs are refused (jaxlora fetches nothing). Every refusal is an
`ImageError` whose message says why (a server answers it with a 400).

    limits = ImageLimits(max_bytes=8 << 20, max_pixels=16_000_000, max_images=8)
    image = image_from_url("data:image/png;base64,iVBOR...", limits)
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import os
import re
import warnings

from PIL import Image

from jaxlora.vision.preprocess import ImageError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_DATA_URL = re.compile(r"^data:(image/[A-Za-z0-9.+-]+)?((?:;[A-Za-z0-9=_.+-]+)*);base64,(.*)$", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    """Bounds on request images: encoded bytes of one image, its pixels (width * height, checked
    before it is decoded), images in one request, and the decoders allowed."""

    max_bytes: int = 8 << 20
    max_pixels: int = 16_000_000
    max_images: int = 8
    formats: tuple[str, ...] = FORMATS


def image_from_bytes(data: bytes, limits: ImageLimits = ImageLimits(), source: str = "image") -> Image.Image:
    """Decodes one encoded image (fully loaded, so a truncated file fails here); ImageError if it
    is too large in bytes or pixels, not an image, or of a format not in `limits.formats`."""
    if len(data) > limits.max_bytes:
        raise ImageError(f"{source}: {len(data)} bytes, more than the limit of {limits.max_bytes} bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=list(limits.formats))
            width, height = image.size
            if width * height > limits.max_pixels:
                raise ImageError(f"{source}: {width}x{height} pixels, more than the limit of {limits.max_pixels}")
            image.load()
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ImageError(f"{source}: too many pixels ({err})") from None
    except Exception as err:  # Pillow raises many types for bad data (UnidentifiedImageError, OSError, ...)
        raise ImageError(f"{source}: not a decodable image ({', '.join(limits.formats)}): {err}") from None
    return image


def image_from_url(url: str, limits: ImageLimits = ImageLimits(), source: str = "image_url") -> Image.Image:
    """An image from a `data:` URL (base64); remote (http, https, ...) URLs are refused."""
    if not isinstance(url, str) or not url:
        raise ImageError(f"{source}: expected a data: URL string")
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url[:16] else "a path"
        raise ImageError(f"{source}: only data: URLs (base64 images) are accepted, got {scheme!r}: the server "
                         f"fetches no remote images")
    match = _DATA_URL.match(url)
    if not match:
        raise ImageError(f"{source}: malformed data URL (expected data:image/<type>;base64,<data>)")
    payload = match.group(3)
    if len(payload) > (limits.max_bytes * 4) // 3 + 8:  # base64 of more than max_bytes: refused undecoded
        raise ImageError(f"{source}: more than the limit of {limits.max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ImageError(f"{source}: malformed base64 in the data URL: {err}") from None
    return image_from_bytes(data, limits, source)


def image_from_file(path: str, limits: ImageLimits = ImageLimits(), base_dir: str | None = None) -> Image.Image:
    """An image from a file (a training job's path, relative to `base_dir`)."""
    full = path if base_dir is None or os.path.isabs(path) else os.path.join(base_dir, path)
    try:
        size = os.path.getsize(full)
        if size > limits.max_bytes:
            raise ImageError(f"{full}: {size} bytes, more than the limit of {limits.max_bytes} bytes")
        with open(full, "rb") as f:
            data = f.read()
    except OSError as err:
        raise ImageError(f"{full}: cannot read: {err}") from None
    return image_from_bytes(data, limits, full)


def check_image_count(count: int, limits: ImageLimits, source: str = "request") -> None:
    if count > limits.max_images:
        raise ImageError(f"{source}: {count} images, more than the limit of {limits.max_images}")
