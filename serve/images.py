"""Images in chat requests (OpenAI's `image_url` content parts), checked before anything is queued.

The server fetches nothing on a client's behalf: an image comes inline as a `data:` URL
(`data:image/png;base64,...` or `image/jpeg`), never as an http(s) or file URL. Every image is
bounded before it is decoded: its base64 text by the request body's own bound, its decoded bytes by
`Limits.max_image_bytes`, its pixel count by `Limits.max_image_pixels` (read from the header, so a
decompression bomb is refused before its pixels exist), and a request's images by
`Limits.max_images`. Each refusal is a 400 (`ApiError`) that names the reason and the part
(`messages[i].content[j]`). A model without a vision tower refuses every image with a 400 that says
so (`check_images`); nothing a client sends is silently dropped.
"""

from __future__ import annotations

import base64
import binascii
import io
import re

from serve.protocol import ApiError, ImagePart, Limits

MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG"}
_DATA_URL = re.compile(r"data:(?P<media>[\w/+.-]+)?(?P<params>(?:;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,")


def image_parts(messages: list) -> list[tuple[str, ImagePart]]:
    """[(param, part)] of every `image_url` part of chat `messages` (ChatMessage), in order; param
    is the part's place for error messages, `messages[i].content[j]`."""
    found = []
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            found.extend((f"messages[{i}].content[{j}]", part) for j, part in enumerate(message.content)
                         if isinstance(part, ImagePart))
    return found


def decode_image(url: str, limits: Limits, param: str):
    """The RGB `PIL.Image` of a `data:` URL, within `limits`; ApiError 400 naming what is wrong
    (a remote URL, a malformed data URL, a media type other than PNG/JPEG, too many bytes or
    pixels, bytes that are not the declared image)."""
    from PIL import Image

    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else "(none)"
        raise ApiError(400, f"image URLs are not fetched (scheme {scheme!r}): the server fetches nothing on a "
                            "client's behalf; send the image inline as a data: URL "
                            "(data:image/png;base64,... or data:image/jpeg;base64,...)", param)
    header = _DATA_URL.match(url)
    if header is None or header.group("b64") is None:
        raise ApiError(400, "malformed image data URL: expected data:image/png;base64,<data> or "
                            "data:image/jpeg;base64,<data>", param)
    media = (header.group("media") or "").lower()
    if media not in MEDIA_TYPES:
        raise ApiError(400, f"image media type {media or '(none)'!r} is not accepted: PNG or JPEG only "
                            "(image/png, image/jpeg)", param)
    encoded = url[header.end():]
    if len(encoded) > 4 * (-(-limits.max_image_bytes // 3)) + 4:
        raise ApiError(400, f"image is larger than {limits.max_image_bytes} bytes", param)
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ApiError(400, f"malformed image data URL: the data is not valid base64 ({err})", param) from err
    if len(raw) > limits.max_image_bytes:
        raise ApiError(400, f"image is larger than {limits.max_image_bytes} bytes ({len(raw)})", param)
    return _open(raw, MEDIA_TYPES[media], limits, param, Image)


def _open(raw: bytes, expected: str, limits: Limits, param: str, Image):
    """Decodes `raw` as an `expected` ("PNG"/"JPEG") image, its size checked from the header first."""
    try:
        with Image.open(io.BytesIO(raw), formats=[expected]) as image:
            width, height = image.size
            if width * height > limits.max_image_pixels:
                raise ApiError(400, f"image has {width}x{height} pixels, more than the {limits.max_image_pixels} "
                                    "allowed", param)
            return image.convert("RGB")
    except ApiError:
        raise
    except Image.DecompressionBombError as err:  # past Pillow's own bound, refused before its size is read
        raise ApiError(400, f"image has more than the {limits.max_image_pixels} pixels allowed", param) from err
    except Exception as err:  # Pillow's UnidentifiedImageError, truncated data, a bomb warning ...
        raise ApiError(400, f"image data is not a readable {expected} image ({type(err).__name__})", param) from err


def check_images(messages: list, limits: Limits, accepts_images: bool, model: str) -> list:
    """Every image of chat `messages` decoded and bounded (`decode_image`; at most
    `limits.max_images` in a request), then refused with a 400 if the model cannot read images;
    returns the RGB images in order (none: [])."""
    parts = image_parts(messages)
    if len(parts) > limits.max_images:
        raise ApiError(400, f"{len(parts)} images in the request; at most {limits.max_images}", "messages")
    images = [decode_image(part.image_url.url, limits, param) for param, part in parts]
    if images and not accepts_images:
        raise ApiError(400, f"model {model!r} reads text only: it has no vision tower, so image_url content "
                            "parts cannot be served", parts[0][0])
    return images
