"""Images in chat requests (`serve.images`, issue 39's bad input): `image_url` parts are read only
from inline `data:` URLs (PNG/JPEG), bounded in count, bytes and pixels; a remote URL, a malformed
data URL, another media type, an oversized image, bytes that are not the declared image, too many
images, or any image for a model without a vision tower is a 400 naming the reason, and the server
keeps serving. Images are generated here with Pillow (random pixels, never zeros)."""

import base64
import io

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from serve.images import check_images, decode_image
from serve.protocol import ApiError, ChatMessage, Limits

BASE = "SmolLM2-135M-Instruct"


def _image_bytes(width=13, height=7, fmt="PNG", seed=0) -> bytes:
    pixels = np.random.default_rng(seed).integers(1, 255, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def _data_url(raw: bytes, media="image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(raw).decode()}"


def _messages(*urls, text="What is in the picture?"):
    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [ChatMessage.model_validate({"role": "user", "content": parts})]


def _refused(call, *words):
    with pytest.raises(ApiError) as err:
        call()
    assert err.value.status == 400
    for word in words:
        assert word in err.value.message, err.value.message
    return err.value


def test_png_and_jpeg_data_urls_decode_to_rgb_images_in_order():
    png, jpeg = _image_bytes(13, 7, "PNG", 1), _image_bytes(9, 11, "JPEG", 2)
    first = ChatMessage.model_validate({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(png), "detail": "low"}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": _data_url(jpeg, "image/jpeg")}}]})
    second = _messages(_data_url(png))[0]
    images = check_images([first, second], Limits(), accepts_images=True, model="vlm")
    assert [im.size for im in images] == [(13, 7), (9, 11), (13, 7)]
    assert all(im.mode == "RGB" for im in images)
    decoded = np.asarray(images[0])
    assert np.array_equal(decoded, np.asarray(Image.open(io.BytesIO(png)).convert("RGB")))
    assert first.text() == "and"  # image parts are not text


@pytest.mark.parametrize("url, words", [
    ("https://example.com/cat.png", ["not fetched", "'https'", "data:"]),
    ("file:///etc/passwd", ["not fetched", "'file'"]),
    ("cat.png", ["not fetched"]),
    ("data:image/png,notbase64", ["malformed"]),
    ("data:image/png;base64", ["malformed"]),
    ("data:image/png;base64,@@@not-base64@@@", ["malformed", "base64"]),
    ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", ["'image/gif'", "PNG or JPEG"]),
    ("data:;base64,AAAA", ["'(none)'", "PNG or JPEG"]),
])
def test_bad_image_urls_are_refused_by_name(url, words):
    _refused(lambda: decode_image(url, Limits(), "messages[0].content[1]"), *words)


def test_bytes_that_are_not_the_declared_image_are_refused():
    _refused(lambda: decode_image(_data_url(_image_bytes(fmt="PNG"), "image/jpeg"), Limits(), "p"),
             "not a readable JPEG")
    _refused(lambda: decode_image(_data_url(b"\x89PNG\r\n\x1a\n" + bytes(range(1, 60))), Limits(), "p"),
             "not a readable PNG")


def test_oversized_images_are_refused_before_decoding():
    raw = _image_bytes(64, 64, seed=3)
    err = _refused(lambda: decode_image(_data_url(raw), Limits(max_image_bytes=len(raw) - 1), "messages[0].content[2]"),
                   "larger than")
    assert err.param == "messages[0].content[2]"
    _refused(lambda: decode_image(_data_url(raw), Limits(max_image_bytes=100), "p"), "larger than")  # by its text
    _refused(lambda: decode_image(_data_url(raw), Limits(max_image_pixels=64 * 64 - 1), "p"), "64x64 pixels")
    assert decode_image(_data_url(raw), Limits(max_image_pixels=64 * 64, max_image_bytes=len(raw)), "p").size == (64, 64)


def test_too_many_images_and_a_text_only_model_are_refused():
    url = _data_url(_image_bytes())
    _refused(lambda: check_images(_messages(*[url] * 3), Limits(max_images=2), True, "vlm"), "3 images", "at most 2")
    err = _refused(lambda: check_images(_messages(url), Limits(), False, "smol"), "'smol'", "text only")
    assert err.param == "messages[0].content[1]"
    assert check_images(_messages(), Limits(), False, "smol") == []  # text parts alone are fine
    # the more specific reason first: a remote URL on a text-only model says it is not fetched
    _refused(lambda: check_images(_messages("http://x/y.png"), Limits(), False, "smol"), "not fetched")


def _chat(server, content):
    return httpx.post(server.url + "/v1/chat/completions", timeout=60,
                      json={"model": BASE, "max_tokens": 2, "messages": [{"role": "user", "content": content}]})


def test_the_server_answers_each_bad_image_with_a_400_and_keeps_serving(live_server, client):
    good = _data_url(_image_bytes())
    cases = {
        "not fetched": "https://example.com/cat.png",
        "malformed": "data:image/png;base64,%%%",
        "PNG or JPEG": "data:image/webp;base64,AAAA",
        "text only": good,
    }
    for words, url in cases.items():
        reply = _chat(live_server, [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}])
        assert reply.status_code == 400, reply.text
        assert words in reply.json()["error"]["message"]
    many = [{"type": "image_url", "image_url": {"url": good}}] * (Limits().max_images + 1)
    reply = _chat(live_server, many)
    assert reply.status_code == 400 and "at most" in reply.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="text only"):  # the official client, as a user sends it
        client.chat.completions.create(model=BASE, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": good}}]}])
    answer = client.chat.completions.create(model=BASE, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert answer.choices[0].message.content is not None
