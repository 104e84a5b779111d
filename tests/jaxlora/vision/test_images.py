"""Request images (jaxlora.vision.images): data URLs decode with bounds; every refusal says why."""

import base64
import io

import numpy as np
import pytest
from PIL import Image

from jaxlora.vision.images import ImageLimits, check_image_count, image_from_file, image_from_url
from jaxlora.vision.preprocess import ImageError


def _encoded(fmt: str, size=(40, 30)) -> bytes:
    pixels = (np.arange(size[0] * size[1] * 3) % 251).astype(np.uint8).reshape(size[1], size[0], 3)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def _url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg")])
def test_data_urls_decode(fmt, mime):
    image = image_from_url(_url(_encoded(fmt), mime))
    assert image.size == (40, 30) and image.mode == "RGB"
    if fmt == "PNG":  # lossless: the same pixels
        np.testing.assert_array_equal(np.asarray(image), np.asarray(Image.open(io.BytesIO(_encoded(fmt)))))


def test_bad_images_are_refused_with_the_reason(tmp_path):
    png = _encoded("PNG")
    cases = [
        ("https://example.com/cat.png", "only data: URLs.*'https'.*fetches no remote images"),
        ("data:image/png,abc", "malformed data URL"),
        ("data:image/png;base64,@@@", "malformed base64"),
        (_url(b"not an image at all"), "not a decodable image"),
        (_url(png[: len(png) // 2]), "not a decodable image"),  # truncated
    ]
    for url, reason in cases:
        with pytest.raises(ImageError, match=reason):
            image_from_url(url)
    with pytest.raises(ImageError, match="more than the limit of 100 bytes"):
        image_from_url(_url(png), ImageLimits(max_bytes=100))
    with pytest.raises(ImageError, match="40x30 pixels, more than the limit of 1000"):
        image_from_url(_url(png), ImageLimits(max_pixels=1000))
    with pytest.raises(ImageError, match="3 images, more than the limit of 2"):
        check_image_count(3, ImageLimits(max_images=2))
    (tmp_path / "a.png").write_bytes(png)
    assert image_from_file("a.png", base_dir=str(tmp_path)).size == (40, 30)
    with pytest.raises(ImageError, match="cannot read"):
        image_from_file("missing.png", base_dir=str(tmp_path))
