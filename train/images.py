"""Images in training records (issue 39): chat `messages` whose `content` is a list of parts, as
OpenAI's chat API and TRL's vision datasets write them:

  {"type": "text", "text": "What colour is the square?"}
  {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}   (OpenAI)
  {"type": "image", "path": "imgs/3.png"}    (also "image": or "url": instead of "path")
  {"type": "image"}                          (TRL: the record's next `images` entry, a path or data URL)

An image's reference is a `data:` URL (PNG/JPEG) or a path relative to the dataset file's
directory (never outside it); remote URLs are refused (training fetches nothing). Each message
renders as its text parts joined, each image as the model's placeholder (`<image>`) where it was,
as the server renders a chat request (`serve.protocol.ChatMessage.text`), so a trained adapter
sees the very prompts it is served with; each placeholder then becomes the family's image layout
(`jaxlora.vision.prompts`: LLaVA's image tokens, Idefics3's tiles). `VisionInputs` holds a VLM's
frozen tower and processor for the trainer (`train.base_model.load_training_model`)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from jaxlora.vision.llava import TowerEncoder
from jaxlora.vision.loading import IMAGE_TOKEN
from jaxlora.vision.preprocess import ImageError, decode_data_url, open_image
from jaxlora.vision.prompts import expand_prompt
from train.config import ConfigError

MAX_IMAGES = 8  # images in one record (the server's default Limits.max_images)
MAX_IMAGE_BYTES = 16 << 20  # one image file or data URL, decoded
MAX_IMAGE_PIXELS = 4096 * 4096  # one image, read from its header before decoding
IMAGE_PART_TYPES = ("image_url", "image")


@dataclasses.dataclass(frozen=True)
class VisionInputs:
    """A VLM's vision side in training: its config (image token, tokens per tower image; a
    `LlavaConfig` or `Idefics3Config`), processor (`load_vlm`'s: image settings, prompt layout)
    and frozen tower (`TowerEncoder`: pixels [N, C, H, W] -> rows [N', P, d])."""

    config: object
    processor: object
    encoder: TowerEncoder

    @property
    def image_token_id(self) -> int:
        return int(self.config.image_token_id)

    @property
    def tokens_per_image(self) -> int:
        return int(self.config.tokens_per_image)


def check_content(content, where: str) -> None:
    """ConfigError unless a message's `content` is a string or a list of text/image parts."""
    if isinstance(content, str):
        return
    if not isinstance(content, list) or not content:
        raise ConfigError(f"{where}: content must be a string or a non-empty list of parts")
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind in IMAGE_PART_TYPES:
            _reference(part, f"{where}[{j}]")
            continue
        raise ConfigError(f"{where}[{j}]: expected a part {{type: text, text}}, {{type: image_url, image_url: "
                          "{url}}} or {type: image, path}")


def message_text(content, placeholder: str) -> str:
    """A message's text: a string as it is; parts joined, each image part as `placeholder`."""
    if isinstance(content, str):
        return content
    return "".join(part["text"] if part["type"] == "text" else placeholder for part in content)


def count_image_parts(messages: list[dict]) -> int:
    return sum(1 for m in messages if isinstance(m["content"], list)
               for part in m["content"] if part["type"] in IMAGE_PART_TYPES)


def _reference(part: dict, where: str) -> str | None:
    """An image part's reference (data URL, remote URL or path), None for a TRL part (it takes
    the record's next `images` entry); ConfigError for a malformed part."""
    if part["type"] == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise ConfigError(f"{where}: an image_url part needs image_url: {{url: ...}} (a data: URL or a path)")
        return url
    given = [part[key] for key in ("path", "image", "url") if key in part]
    if len(given) > 1 or (given and not isinstance(given[0], str)):
        raise ConfigError(f"{where}: an image part takes one string: path, image or url")
    return given[0] if given else None


def record_images(record: dict, base_dir: str, where: str, vision: VisionInputs | None) -> list:
    """The RGB Pillow images of a chat record's image parts, in order; ConfigError naming the
    record (and part) for images on a text-only model (`vision` None), a remote URL, a malformed
    data URL, a missing or unreadable file, a path outside `base_dir`, or more than MAX_IMAGES."""
    messages = record["messages"]
    total = count_image_parts(messages)
    if total and vision is None:
        raise ConfigError(f"{where}: the record holds {total} image(s), but the base model reads text only (no "
                          "vision tower): train on a vision-language model directory (LLaVA)")
    if total > MAX_IMAGES:
        raise ConfigError(f"{where}: {total} images in the record; at most {MAX_IMAGES}")
    extra = record.get("images") or []
    if not isinstance(extra, list) or not all(isinstance(e, str) for e in extra):
        raise ConfigError(f"{where}: 'images' must be a list of paths or data URLs")
    images, next_extra = [], 0
    for i, message in enumerate(messages):
        for j, part in enumerate(message["content"] if isinstance(message["content"], list) else []):
            if part["type"] not in IMAGE_PART_TYPES:
                continue
            place = f"{where}: messages[{i}].content[{j}]"
            reference = _reference(part, place)
            if reference is None:
                if next_extra >= len(extra):
                    raise ConfigError(f"{place}: an image part without a path takes the record's next 'images' "
                                      f"entry, but it has only {len(extra)}")
                reference, next_extra = extra[next_extra], next_extra + 1
            images.append(_load(reference, base_dir, place))
    if next_extra < len(extra):
        raise ConfigError(f"{where}: 'images' has {len(extra)} entries, but {next_extra} image parts use them")
    return images


def _load(reference: str, base_dir: str, place: str):
    """One image reference -> an RGB Pillow image; ConfigError naming `place` otherwise."""
    try:
        if reference.startswith("data:") or "://" in reference:
            return decode_data_url(reference, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS)
        return open_image(_read_file(reference, base_dir), MAX_IMAGE_PIXELS)
    except ImageError as err:
        raise ConfigError(f"{place}: {err}") from None


def _read_file(path: str, base_dir: str) -> bytes:
    root = os.path.realpath(base_dir)
    full = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, full]) != root:
        raise ImageError(f"image path {path!r} is outside the dataset's directory {root}")
    try:
        if os.path.getsize(full) > MAX_IMAGE_BYTES:
            raise ImageError(f"image file {path!r} is larger than {MAX_IMAGE_BYTES} bytes")
        with open(full, "rb") as f:
            return f.read()
    except OSError as err:
        raise ImageError(f"cannot read image file {path!r}: {err.strerror or err}") from None


def with_images(tokens: list[int], mask: list[bool], images: list, vision: VisionInputs | None,
                where: str) -> tuple[list[int], list[bool], np.ndarray | None]:
    """A rendered record's (tokens, loss mask) with each image placeholder token expanded to the
    family's image layout (`jaxlora.vision.prompts.expand_prompt`; no loss on any of its tokens)
    and the tower's pixel values [n, C, H, W] (None without images); ConfigError for placeholders
    that do not match the images. A text-only model (`vision` None): unchanged (`record_images`
    refused its images)."""
    if vision is None:
        return tokens, mask, None
    image_id = vision.image_token_id
    if tokens.count(image_id) != len(images):
        raise ConfigError(f"{where}: {len(images)} image part(s) but the rendered prompt has "
                          f"{tokens.count(image_id)} {IMAGE_TOKEN} placeholder(s)")
    try:
        expanded = expand_prompt(vision.processor, image_id, vision.tokens_per_image, tokens, images)
    except ImageError as err:
        raise ConfigError(f"{where}: {err}") from None
    mask = [m and t != image_id for t, m, n in zip(tokens, mask, expanded.counts) for _ in range(n)]
    return expanded.ids, mask, expanded.pixels
