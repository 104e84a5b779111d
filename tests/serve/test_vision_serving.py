"""Serving a LLaVA (issue 39; `serve.vision`): a tiny random LLaVA written by `transformers`, its
language model in the engine and its tower beside it. The engine's greedy tokens for image+text
requests (one and two images, the prefill chunked through an image) equal `jaxlora.vision`'s
generate; a step mixing an image request with an adapter and a text request without gives each
the tokens it gets alone; prefix caching shares blocks only between requests with the same images;
over HTTP with the `openai` client (images as data URLs) the answers equal the in-process model's,
and bad input is a 400 while the server keeps serving."""

import base64
import io

import numpy as np
import openai
import pytest

from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.pool import AdapterPool
from jaxlora.sampling import SamplingParams
from jaxlora.vision.generate import generate_text_with_images, generate_with_images
from jaxlora.vision.loading import load_vlm
from serve.engine import Engine, EngineConfig, RequestError
from serve.vision import ImageInput, ImageServing
from tests.jaxlora.vision.tiny_llava import IMAGE_TOKEN_ID, write_tiny_llava
from tests.serve.conftest import LiveServer

ONE = "USER: <image>\nwhat colour is the square in the picture? ASSISTANT:"
TWO = "USER: <image> and <image>\nDescribe both images and compare them. ASSISTANT:"
TEXT = "the quick brown fox jumps over the lazy dog"
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "k_proj", "v_proj", "down_proj"))
NEW = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory, LLaVA, tokenizer, image processor settings, images)."""
    from PIL import Image

    directory = str(tmp_path_factory.mktemp("tiny_llava_serve"))
    write_tiny_llava(directory)
    model, tokenizer, processor = load_vlm(directory)
    projector = model.vision.weights["projector.linear_2.kernel"]
    projector[...] = projector[...] * 30  # louder image rows: the images decide the random model's tokens
    noise = [Image.fromarray(np.random.default_rng(s).integers(0, 256, (40 + 8 * s, 56 - 8 * s, 3), dtype=np.uint8))
             for s in range(2)]
    images = [noise[0], Image.new("RGB", (32, 32), (255, 0, 0)), Image.new("RGB", (50, 30), (0, 0, 255)), noise[1]]
    return directory, model, tokenizer, processor, images


def _adapter(model):
    return random_adapter("a0", model.config.text, LORA, seed=3, b_std=0.5)


def _engine(model, processor, adapters=None, eos=(), **kw):
    config = dict(page_size=8, num_pages=64, max_model_len=128, max_num_seqs=4, token_budget=32, prefill_chunk=12,
                  max_lora_rank=4, max_adapters_on_device=2)
    config.update(kw)
    return Engine(model.language, eos, EngineConfig(**config), adapters, images=ImageServing(model, processor))


def _request(tiny, text, images):
    """(expanded prompt ids, ImageInput or None) of a prompt text with `<image>` placeholders."""
    _, model, tokenizer, processor, _ = tiny
    ids = tokenizer.encode(text)
    return ImageServing(model, processor).prompt(ids, images)


def _generate(model, prompt, images, adapter=None):
    """`jaxlora.vision.generate_with_images`' greedy tokens, with `adapter` on the language model."""
    pool = AdapterPool(model.config.text, num_slots=1, max_rank=LORA.r)
    slots = [-1 if adapter is None else pool.load(adapter)]
    return generate_with_images(model, [prompt], None if images is None else images.pixels,
                                SamplingParams(max_new_tokens=NEW), pool_arrays=pool.arrays, row_slots=slots)[0]


def _serve(engine, requests, sampling=SamplingParams(max_new_tokens=NEW)):
    """Greedy tokens of each (prompt, images, adapter), submitted together and run to idle."""
    got = {i: [] for i in range(len(requests))}
    for i, (prompt, images, adapter) in enumerate(requests):
        engine.submit(i, prompt, adapter, sampling, lambda e, i=i: got[i].append(e), images=images)
    engine.run_until_idle()
    for events in got.values():
        assert events[-1].finish_reason in ("length", "stop"), events[-1]
    return [[e.token for e in got[i] if e.token is not None] for i in range(len(requests))]


def test_engine_tokens_with_one_and_two_images_equal_generate(tiny):
    _, model, tokenizer, processor, images = tiny
    one, one_images = _request(tiny, ONE, images[:1])
    two, two_images = _request(tiny, TWO, images[2:])
    assert one.count(IMAGE_TOKEN_ID) == 16 and two.count(IMAGE_TOKEN_ID) == 32
    expected = [generate_with_images(model, [one], one_images.pixels, SamplingParams(max_new_tokens=NEW))[0],
                generate_with_images(model, [two], two_images.pixels, SamplingParams(max_new_tokens=NEW))[0]]
    other = generate_with_images(model, [two], _request(tiny, TWO, images[:2])[1].pixels,
                                 SamplingParams(max_new_tokens=NEW))[0]
    assert other != expected[1]  # the images decide the tokens
    engine = _engine(model, processor)  # prefill chunks of 12 tokens: an image's 16 rows span two steps
    got = _serve(engine, [(one, one_images, None), (two, two_images, None)])
    assert got == expected
    assert engine.images.encodes == 1  # both requests' three images in one tower call
    text = tokenizer.encode(TEXT)  # a text request on the same engine: the language model's own tokens
    assert _serve(engine, [(text, None, None)]) == [generate_with_images(model, [text], None,
                                                                         SamplingParams(max_new_tokens=NEW))[0]]


def test_a_step_mixes_an_image_request_with_an_adapter_and_a_text_request_without(tiny):
    _, model, tokenizer, processor, images = tiny
    adapter = _adapter(model)
    image, pixels = _request(tiny, TWO, images[:2])
    text = tokenizer.encode(TEXT)
    requests = [(image, pixels, "a0"), (text, None, None), (image, pixels, None), (text, None, "a0")]
    alone = [_serve(_engine(model, processor, {"a0": adapter}), [r])[0] for r in requests]
    engine = _engine(model, processor, {"a0": adapter}, prefill_chunk=128, token_budget=256, prefix_caching=False)
    steps = []
    builder_build = engine.builder.build
    engine.builder.build = lambda plan, *a, **k: steps.append(builder_build(plan, *a, **k)) or steps[-1]
    together = _serve(engine, requests)
    assert together == alone
    assert alone[0] != alone[2] and alone[1] != alone[3]  # the adapter changes the tokens
    assert alone[0] == _generate(model, image, pixels, adapter)  # images and the adapter: jaxlora.vision's tokens
    first = steps[0]  # every prompt in the first step: image rows and text rows, with and without the adapter
    assert len(first.plan.rows) == 4 and first.image_rows is not None and first.shapes[0].images >= 64
    assert all(step.image_rows is None and step.shapes[0].images == 0 for step in steps[1:])  # decode: text programs


def test_prefix_blocks_are_shared_only_between_requests_with_the_same_images(tiny):
    _, model, _, processor, images = tiny
    prompt, first = _request(tiny, ONE, images[:1])
    _, second = _request(tiny, ONE, images[1:2])
    alone = [_serve(_engine(model, processor, prefix_caching=False), [(prompt, p, None)])[0] for p in (first, second)]
    assert alone[0] != alone[1]
    engine = _engine(model, processor)
    assert _serve(engine, [(prompt, first, None)]) == alone[:1]
    assert _serve(engine, [(prompt, second, None)]) == alone[1:]  # same ids, other image: no block reused
    assert engine.snapshot()["prefix_cache"]["hit_requests"] == 0
    again = _serve(engine, [(prompt, ImageInput.of(first.pixels.copy()), None)])  # the same image again: reused
    assert again == alone[:1] and engine.snapshot()["prefix_cache"]["hit_requests"] == 1


def test_the_engine_refuses_images_that_do_not_match_the_prompt(tiny):
    _, model, tokenizer, processor, images = tiny
    engine = _engine(model, processor)
    prompt, pixels = _request(tiny, TWO, images[:2])
    sampling = SamplingParams(max_new_tokens=2)
    with pytest.raises(RequestError, match="32 image tokens, but 1 images need 16"):
        engine.submit(0, prompt, None, sampling, print, images=ImageInput.of(pixels.pixels[:1]))
    with pytest.raises(RequestError, match="image tokens"):
        engine.submit(1, prompt, None, sampling, print)  # image tokens without images
    text_engine = Engine(model.language, (), EngineConfig(page_size=8, num_pages=32, max_model_len=128,
                                                          max_num_seqs=2, token_budget=16, max_lora_rank=4))
    with pytest.raises(RequestError, match="text only"):
        text_engine.submit(2, prompt, None, sampling, print, images=pixels)


def test_a_preempted_image_request_is_recomputed_with_its_images(tiny):
    """KV pages grow with the output (`reserve_output_kv=False`) in a pool too small for both: the
    newest request is preempted and recomputed later (no prefix cache: its images encoded again),
    same tokens."""
    _, model, _, processor, images = tiny
    requests = [(*_request(tiny, TWO, images[:2]), None), (*_request(tiny, ONE, images[2:3]), None)]
    params = SamplingParams(max_new_tokens=40)
    alone = [_serve(_engine(model, processor), [r], params)[0] for r in requests]
    engine = _engine(model, processor, num_pages=20, reserve_output_kv=False, prefix_caching=False)
    hand_off, preempted = engine._hand_off, []
    engine._hand_off = lambda seqs: (preempted.extend(seqs), hand_off(seqs))
    assert _serve(engine, requests, params) == alone
    assert preempted and engine.images.encodes >= 2


# ---- over HTTP ----------------------------------------------------------------------------------------
def _data_url(image, fmt="PNG") -> str:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(out.getvalue()).decode()}"


@pytest.fixture(scope="module")
def vlm_server(tiny):
    from serve.app import ServerSettings, create_app
    from serve.protocol import Limits

    _, model, tokenizer, processor, _ = tiny
    engine = _engine(model, processor, {"a0": _adapter(model)}, eos=tokenizer.eos_token_ids)
    engine.start()  # no warm-up: the engine tests compiled these programs (the server is ready at once)
    settings = ServerSettings("tiny-llava", (), Limits(max_tokens=16, max_images=2))
    with LiveServer(create_app(engine, tokenizer, settings), engine) as server:
        server.wait_ready()
        yield server


def test_chat_with_images_over_http_equals_the_in_process_model(tiny, vlm_server):
    from openai import OpenAI

    _, model, tokenizer, processor, images = tiny
    client = OpenAI(base_url=vlm_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    params = SamplingParams(max_new_tokens=NEW)
    cases = [([{"type": "text", "text": "what colour is "}, {"type": "image_url", "image_url": {"url": _data_url(images[0])}},
               {"type": "text", "text": " the square?"}], "what colour is <image> the square?", images[:1]),
             ([{"type": "image_url", "image_url": {"url": _data_url(images[3], "JPEG")}}, {"type": "text", "text": " and "},
               {"type": "image_url", "image_url": {"url": _data_url(images[1])}}], "<image> and <image>", None)]
    for content, text, expected_images in cases:
        if expected_images is None:  # the JPEG as the server decodes it
            from PIL import Image

            raw = base64.b64decode(content[0]["image_url"]["url"].split(",", 1)[1])
            expected_images = [Image.open(io.BytesIO(raw)).convert("RGB"), images[1]]
        expected = generate_text_with_images(model, tokenizer, processor, [text], [expected_images], params,
                                             chat=True)[0]
        answer = client.chat.completions.create(model="tiny-llava", max_tokens=NEW, temperature=0,
                                                messages=[{"role": "user", "content": content}])
        assert answer.choices[0].message.content == expected
        assert answer.usage.prompt_tokens == len(tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "user", "content": text}]))) + 15 * len(expected_images)
    with_adapter = client.chat.completions.create(model="a0", max_tokens=NEW, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(images[2])}}]}])
    ids, pixels = _request(tiny, tokenizer.apply_chat_template([{"role": "user", "content": "<image>"}]), images[2:3])
    assert with_adapter.choices[0].message.content == tokenizer.decode(_generate(model, ids, pixels, _adapter(model)))
    plain = client.chat.completions.create(model="tiny-llava", max_tokens=NEW, temperature=0,
                                           messages=[{"role": "user", "content": TEXT}])
    assert plain.choices[0].message.content == generate_text_with_images(model, tokenizer, processor, [TEXT], [[]],
                                                                          params, chat=True)[0]
    completion = client.completions.create(model="tiny-llava", prompt=TEXT, max_tokens=NEW, temperature=0)
    assert completion.choices[0].text == generate_text_with_images(model, tokenizer, processor, [TEXT], [[]],
                                                                   params)[0]


def test_bad_images_are_400s_and_the_vlm_server_keeps_serving(tiny, vlm_server):
    import httpx
    from openai import OpenAI

    _, _, _, _, images = tiny
    good = _data_url(images[0])

    def chat(*parts):
        content = [{"type": "text", "text": "hi "}] + [
            {"type": "image_url", "image_url": {"url": u}} if isinstance(u, str) else u for u in parts]
        return httpx.post(vlm_server.url + "/v1/chat/completions", timeout=60,
                          json={"model": "tiny-llava", "max_tokens": 2, "messages": [{"role": "user", "content": content}]})

    cases = {"not fetched": ("https://example.com/cat.png",), "malformed": ("data:image/png;base64,%%%",),
             "at most 2": (good, good, good),
             "image tokens": ({"type": "text", "text": "<image>"}, good)}  # a typed placeholder: 2 for 1 image
    for words, parts in cases.items():
        reply = chat(*parts)
        assert reply.status_code == 400, reply.text
        assert words in reply.json()["error"]["message"], reply.json()
    reply = httpx.post(vlm_server.url + "/v1/completions", timeout=60,
                       json={"model": "tiny-llava", "max_tokens": 2, "prompt": "USER: <image> hi"})
    assert reply.status_code == 400 and "image tokens" in reply.json()["error"]["message"]  # no images there
    client = OpenAI(base_url=vlm_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError, match="not fetched"):
        client.chat.completions.create(model="tiny-llava", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert chat(good).status_code == 200


def test_jaxlora_serve_loads_a_llava_directory_with_a_peft_adapter(tiny, tmp_path):
    """`build_app` on a LLaVA directory: the language model in the engine, the tower beside it,
    images accepted, a PEFT adapter saved on the LLaVA read as its language model's; fine-tuning in
    the server refused for it."""
    from jaxlora.vision.adapters import LANGUAGE_MODEL_TARGETS, load_llava_adapter
    from serve.cli import build_app, build_parser
    from tests.jaxlora.vision.test_llava import _peft_adapter

    directory = tiny[0]
    _peft_adapter(directory, tmp_path / "a0", LANGUAGE_MODEL_TARGETS)
    app = build_app(build_parser().parse_args(["--model", directory, "--dtype", "float32", "--adapter",
                                               f"a0={tmp_path / 'a0'}", "--max-model-len", "128"]))
    server = app.state.server
    assert server.accepts_images and server.engine.images.tokens_per_image == 16
    assert server.engine.adapter_names() == ["a0"]
    expected = load_llava_adapter(str(tmp_path / "a0"), tiny[1].config, "a0")
    got = server.engine.residency.load_adapter(str(tmp_path / "a0"), "a0")
    assert sorted(got.modules) == sorted(expected.modules)
    (tmp_path / "data").mkdir()
    with pytest.raises(SystemExit, match="not built for a vision-language model"):
        build_app(build_parser().parse_args(["--model", directory, "--data-dir", str(tmp_path / "data"),
                                             "--adapter-dir", str(tmp_path)]))
