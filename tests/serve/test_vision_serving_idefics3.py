"""Serving Idefics3 / SmolVLM (issue 39's second family; `serve.vision`): a tiny random Idefics3
written by `transformers`, its language model in the engine and its SigLIP tower beside it. Over
HTTP with the `openai` client (images as PNG/JPEG data URLs, one and two images between text
parts, with an adapter and without) the answers equal the in-process model's; a typed `<image>`
too many and a remote URL are 400s; `build_app` reads an Idefics3 directory with a PEFT adapter
and refuses one with LoRA on the tower by name."""

import base64
import io

import numpy as np
import pytest

from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.pool import AdapterPool
from jaxlora.sampling import SamplingParams
from jaxlora.vision.generate import generate_text_with_images, generate_with_images
from jaxlora.vision.loading import load_vlm
from serve.engine import Engine, EngineConfig
from serve.vision import ImageServing
from tests.jaxlora.vision.tiny_idefics3 import TOKENS_PER_TILE, write_tiny_idefics3
from tests.serve.conftest import LiveServer

LORA = LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "k_proj", "v_proj", "down_proj"))
NEW = 5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory, Idefics3, tokenizer, processor, images)."""
    from PIL import Image

    directory = str(tmp_path_factory.mktemp("tiny_idefics3_serve"))
    write_tiny_idefics3(directory)
    model, tokenizer, processor = load_vlm(directory)
    connector = model.vision.weights["connector.kernel"]
    connector[...] = connector[...] * 30  # louder image rows: the images decide the random model's tokens
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8))
    images = [noise, Image.new("RGB", (30, 30), (255, 0, 0)), Image.new("RGB", (50, 20), (0, 0, 255))]
    return directory, model, tokenizer, processor, images


def _adapter(model):
    return random_adapter("a0", model.config.text, LORA, seed=3, b_std=0.5)


def _data_url(image, fmt="PNG") -> str:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(out.getvalue()).decode()}"


@pytest.fixture(scope="module")
def server(tiny):
    from serve.app import ServerSettings, create_app
    from serve.protocol import Limits

    _, model, tokenizer, processor, _ = tiny
    config = EngineConfig(page_size=8, num_pages=128, max_model_len=256, max_num_seqs=4, token_budget=64,
                          prefill_chunk=32, max_lora_rank=4, max_adapters_on_device=2)
    engine = Engine(model.language, tokenizer.eos_token_ids, config, {"a0": _adapter(model)},
                    images=ImageServing(model, processor))
    engine.start()
    settings = ServerSettings("tiny-idefics3", (), Limits(max_tokens=16, max_images=2))
    with LiveServer(create_app(engine, tokenizer, settings), engine) as live:
        live.wait_ready()
        yield live


def test_chat_with_images_over_http_equals_the_in_process_model(tiny, server):
    from openai import OpenAI
    from PIL import Image

    _, model, tokenizer, processor, images = tiny
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    params = SamplingParams(max_new_tokens=NEW)
    jpeg = _data_url(images[0], "JPEG")
    as_decoded = Image.open(io.BytesIO(base64.b64decode(jpeg.split(",", 1)[1]))).convert("RGB")
    cases = [([{"type": "text", "text": "what colour is "}, {"type": "image_url", "image_url": {"url": _data_url(images[1])}},
               {"type": "text", "text": " the square?"}], "what colour is <image> the square?", images[1:2]),
             ([{"type": "image_url", "image_url": {"url": jpeg}}, {"type": "text", "text": " and "},
               {"type": "image_url", "image_url": {"url": _data_url(images[2])}}], "<image> and <image>",
              [as_decoded, images[2]])]
    answers = []
    for content, text, expected_images in cases:
        expected = generate_text_with_images(model, tokenizer, processor, [text], [expected_images], params,
                                             chat=True)[0]
        answer = client.chat.completions.create(model="tiny-idefics3", max_tokens=NEW, temperature=0,
                                                messages=[{"role": "user", "content": content}])
        assert answer.choices[0].message.content == expected
        answers.append(expected)
    assert answers[0] != generate_text_with_images(model, tokenizer, processor, ["what colour is <image> the square?"],
                                                   [images[2:3]], params, chat=True)[0]  # the image decides
    with_adapter = client.chat.completions.create(model="a0", max_tokens=NEW, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(images[1])}}]}])
    serving = ImageServing(model, processor)
    ids, pixels = serving.prompt(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "<image>"}])),
                                 images[1:2])
    assert int(np.sum(np.asarray(ids) == model.config.image_token_id)) == 5 * TOKENS_PER_TILE  # 2x2 tiles + global
    pool = AdapterPool(model.config.text, num_slots=1, max_rank=LORA.r)
    slots = [pool.load(_adapter(model))]
    expected = generate_with_images(model, [ids], pixels.pixels, params, pool_arrays=pool.arrays, row_slots=slots)[0]
    assert with_adapter.choices[0].message.content == tokenizer.decode(expected)
    plain = client.chat.completions.create(model="tiny-idefics3", max_tokens=NEW, temperature=0,
                                           messages=[{"role": "user", "content": "the quick brown fox"}])
    assert plain.choices[0].message.content == generate_text_with_images(
        model, tokenizer, processor, ["the quick brown fox"], [[]], params, chat=True)[0]


def test_bad_images_are_400s_and_the_server_keeps_serving(tiny, server):
    import httpx

    good = _data_url(tiny[4][1])

    def chat(*parts):
        content = [{"type": "text", "text": "hi "}] + [
            {"type": "image_url", "image_url": {"url": u}} if isinstance(u, str) else u for u in parts]
        return httpx.post(server.url + "/v1/chat/completions", timeout=120,
                          json={"model": "tiny-idefics3", "max_tokens": 2, "messages": [{"role": "user", "content": content}]})

    for words, parts in {"not fetched": ("https://example.com/cat.png",),
                         "image tokens": ({"type": "text", "text": "<image>"}, good)}.items():
        reply = chat(*parts)
        assert reply.status_code == 400 and words in reply.json()["error"]["message"], reply.text
    assert chat(good).status_code == 200


def test_jaxlora_serve_loads_an_idefics3_directory_with_a_peft_adapter(tiny, tmp_path):
    from jaxlora.vision.adapters import IDEFICS3_LANGUAGE_MODEL_TARGETS, load_vlm_adapter
    from serve.cli import build_app, build_parser
    from tests.jaxlora.vision.test_idefics3 import _peft_adapter

    directory = tiny[0]
    _peft_adapter(directory, tmp_path / "a0", IDEFICS3_LANGUAGE_MODEL_TARGETS)
    app = build_app(build_parser().parse_args(["--model", directory, "--dtype", "float32", "--adapter",
                                               f"a0={tmp_path / 'a0'}", "--max-model-len", "256"]))
    server = app.state.server
    assert server.accepts_images and server.engine.images.tokens_per_image == TOKENS_PER_TILE
    expected = load_vlm_adapter(str(tmp_path / "a0"), tiny[1].config, "a0")
    got = server.engine.residency.load_adapter(str(tmp_path / "a0"), "a0")
    assert sorted(got.modules) == sorted(expected.modules)
    _peft_adapter(directory, tmp_path / "tower", ["q_proj", "v_proj"])  # SigLIP's q/v_proj too
    with pytest.raises(SystemExit, match=r"vision tower \(module model\.vision_model\.encoder\.layers\.0"):
        build_app(build_parser().parse_args(["--model", directory, "--adapter", f"t={tmp_path / 'tower'}"]))
