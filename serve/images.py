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

from jaxlora.vision.preprocess import ImageError, decode_data_url
from serve.protocol import ApiError, ImagePart, Limits


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
    pixels, bytes that are not the declared image: `jaxlora.vision.preprocess.decode_data_url`)."""
    try:
        return decode_data_url(url, limits.max_image_bytes, limits.max_image_pixels)
    except ImageError as err:
        raise ApiError(400, str(err), param) from err


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
