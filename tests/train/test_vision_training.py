"""Training LoRA on a vision-language model (issue 39, `train.images`): chat records with images
(data URLs and paths) on a tiny random LLaVA written by `transformers`. The packed training step's
per-adapter loss equals the inference forward's (`Llava`, images merged at their tokens) sample by
sample; bad image input is an error naming the record; and the worked example: an adapter trained
with `jaxlora-train` on a generated colour task answers held-out images where the base model does
not, served over HTTP with the `openai` client with the in-process model's answers."""

import base64
import io
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.plan import build_plan
from jaxlora.lora.pool import AdapterPool
from jaxlora.lora.trainable import split_pool
from jaxlora.models.llama import LoraInputs
from jaxlora.parallel.grad_step import make_grad_step
from jaxlora.vision.llava import TowerEncoder
from jaxlora.vision.loading import load_vlm
from tests.jaxlora.vision.tiny_llava import write_tiny_llava
from tests.pallas_kernels.cases import rel_err
from train.config import ConfigError, JobConfig, lora_config
from train.data import load_job_samples
from train.images import VisionInputs
from train.microbatch import device_batch, pack_microbatch

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
QUESTION = "\nWhat colour is the square?"
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))
# A louder LM head and projector, quieter CLIP positions: a random tiny model whose answer tokens
# can be made confident and whose image rows differ by colour more than by position.
SCALES = {"lm_head": 10.0, "multi_modal_projector.linear_2": 10.0, "position_embedding": 0.05,
          "class_embedding": 0.05}
JOBS = """\
base_model: {model}
output_dir: {out}
capacity: 256
scheduler: greedy
progress: false
dtype: float32
jobs:
  - name: colour
    dataset: colour.jsonl
    lora: {{r: 8, alpha: 16, targets: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}}
    learning_rate: 5.0e-3
    schedule: cosine
    global_batch_size: 8
    steps: 150
    seed: 1
  - name: fox
    dataset: fox.jsonl
    lora: {{r: 4, alpha: 8, targets: [q_proj, v_proj, down_proj]}}
    learning_rate: 2.0e-2
    global_batch_size: 2
    steps: 20
    seed: 2
"""


def colour_image(colour: str, seed: int):
    """A generated RGB image (32 to 48 pixels a side) filled by a noisy square of `colour`."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    height, width = rng.integers(32, 49, 2)
    pixels = np.asarray(COLOURS[colour]) + rng.integers(-25, 26, (height, width, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def data_url(image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def colour_record(part: dict, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]},
                         {"role": "assistant", "content": answer}]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model directory, Llava, tokenizer, processor)."""
    directory = str(tmp_path_factory.mktemp("tiny_llava_train"))
    write_tiny_llava(directory, scales=SCALES)
    return (directory, *load_vlm(directory))


def _vision(model, processor):
    return VisionInputs(model.config, processor, TowerEncoder(model.vision))


def _job(path: str) -> JobConfig:
    return JobConfig(name="j", dataset=path, lora=lora_config({"r": 4}, "test"), learning_rate=1e-3,
                     global_batch_size=1, steps=1)


def _write(directory, records) -> str:
    path = os.path.join(directory, "data.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


def test_packed_step_loss_equals_the_inference_forward(tiny, tmp_path):
    """A packed row of two image samples (adapters 0 and 1, one of them with two images) and a
    text sample: each adapter's loss from the training step equals the sum over its samples of
    `Llava.__call__`'s (pixel values in, LoRA on) weighted NLL; swapping the images changes it."""
    _, model, tokenizer, processor = tiny
    vision = _vision(model, processor)
    images = [colour_image("red", 1), colour_image("blue", 2), colour_image("green", 3)]
    (tmp_path / "imgs").mkdir()
    images[1].save(tmp_path / "imgs" / "b.png")
    two = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(images[0])}},
                                                     {"type": "text", "text": " and "}, {"type": "image"},
                                                     {"type": "text", "text": QUESTION}]},
                        {"role": "assistant", "content": "red blue"}], "images": ["imgs/b.png"]}
    records = [two, colour_record({"type": "image", "path": "imgs/b.png"}, "blue"),
               {"messages": [{"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": "dog"}]},
               colour_record({"type": "image_url", "image_url": {"url": data_url(images[2], "JPEG")}}, "green")]
    samples = load_job_samples(_job(_write(tmp_path, records)), tokenizer, 256, "refuse", vision)
    assert [None if s.pixels is None else len(s.pixels) for s in samples] == [2, 1, None, 1]
    per_image = model.config.tokens_per_image
    assert int((samples[0].tokens == model.config.image_token_id).sum()) == 2 * per_image
    assert not samples[0].loss_mask[samples[0].tokens == model.config.image_token_id].any()
    pool = AdapterPool(model.config.text, num_slots=2, max_rank=LORA.r)
    for slot in range(2):
        pool.load(random_adapter(f"a{slot}", model.config.text, LORA, seed=slot, b_std=0.3), slot=slot)
    entries = [(0, samples[0], 0.5), (1, samples[1], 0.25), (1, samples[2], 1.0), (0, samples[3], 0.125)]
    arrays = pack_microbatch(entries, 256, 2)
    batch, plan = device_batch(arrays, 2)
    rows = vision.encoder(arrays.pixels)
    batch["image_embeds"] = rows.reshape(-1, rows.shape[-1])
    step = make_grad_step(model.language, 2, image_token_id=model.config.image_token_id)
    trainable, frozen = split_pool(pool.arrays)
    got, _ = step(trainable, frozen, batch, plan)

    @jax.jit
    def nll(tokens, pixels, plan_one):  # the inference forward of one sample: its NLL per target
        positions = jnp.arange(tokens.shape[0])[None]
        logits, _ = model(tokens[None], positions, pixel_values=pixels, lora=LoraInputs(pool.arrays, plan_one))
        return jax.nn.logsumexp(logits[0, :-1], -1) - jnp.take_along_axis(logits[0, :-1], tokens[1:, None], -1)[:, 0]

    want = np.zeros(2)
    for slot, sample, weight in entries:
        plan_one = build_plan(np.full((1, len(sample.tokens)), slot, np.int32))
        losses = nll(jnp.asarray(sample.tokens), None if sample.pixels is None else jnp.asarray(sample.pixels), plan_one)
        want[slot] += float(np.sum(np.asarray(losses) * sample.loss_mask[1:]) * weight)
    assert rel_err(np.asarray(got), want) <= 1e-5, (got, want)

    swapped = dict(batch, image_embeds=jnp.roll(batch["image_embeds"], per_image, axis=0))
    other, _ = step(trainable, frozen, swapped, plan)
    assert np.abs(np.asarray(other) - want).max() > 1e-3  # the images move the loss (> 3x the bound above)


def _colour_data(directory: str, count: int) -> None:
    """colour.jsonl (images alternately as data URLs and as PNG files under imgs/) and fox.jsonl
    (text chats) in `directory`; the colours cycle, so every global batch holds each."""
    names = list(COLOURS)
    os.makedirs(os.path.join(directory, "imgs"), exist_ok=True)
    records = []
    for i in range(count):
        colour = names[i % len(names)]
        image = colour_image(colour, 1000 + i)
        if i % 2:
            part = {"type": "image_url", "image_url": {"url": data_url(image)}}
        else:
            image.save(os.path.join(directory, "imgs", f"{i}.png"))
            part = {"type": "image", "path": f"imgs/{i}.png"}
        records.append(colour_record(part, colour))
    _write(directory, records)
    os.replace(os.path.join(directory, "data.jsonl"), os.path.join(directory, "colour.jsonl"))
    fox = [{"messages": [{"role": "user", "content": f"the quick brown fox {w}"}, {"role": "assistant", "content": w}]}
           for w in ("jumps", "over", "the", "lazy")]
    with open(os.path.join(directory, "fox.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in fox)


def _answers(model, tokenizer, processor, images, adapter=None) -> list[str]:
    """The in-process model's greedy answers (3 tokens at most) to the colour question, one per
    image, with `adapter` (read as the server reads it) on the language model or none."""
    from jaxlora.sampling import SamplingParams
    from jaxlora.vision.generate import generate_with_images
    from jaxlora.vision.preprocess import expand_image_tokens, preprocess_images

    text = tokenizer.apply_chat_template([{"role": "user", "content": "<image>" + QUESTION}], add_generation_prompt=True)
    ids = expand_image_tokens(tokenizer.encode(text), model.config.image_token_id, model.config.tokens_per_image)
    pool, slots = None, None
    if adapter is not None:
        pool = AdapterPool(model.config.text, num_slots=1, max_rank=adapter.config.r)
        slots = [pool.load(adapter)] * len(images)
    out = generate_with_images(model, [ids] * len(images), preprocess_images(images, processor),
                               SamplingParams(max_new_tokens=3), tokenizer.eos_token_ids,
                               None if pool is None else pool.arrays, slots)
    return [tokenizer.decode(tokens) for tokens in out]


def _accuracy(answers, colours) -> float:
    return float(np.mean([bool(a.split()) and a.split()[0] == c for a, c in zip(answers, colours)]))


def test_worked_example_train_with_jaxlora_train_then_serve_over_http(tiny, tmp_path):
    """Issue 39's CPU worked example: `jaxlora-train` trains a colour adapter (48 generated
    images, 3 colours) beside a text adapter in one run; on 30 held-out images the adapter answers
    >= 90% right where the base model answers <= 30%; `jaxlora-serve`'s app on the LLaVA with the
    saved adapter answers over HTTP (`openai` client, images as data URLs) as the in-process model."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    from jaxlora.vision.adapters import load_llava_adapter
    from serve.cli import build_app, build_parser
    from tests.serve.conftest import LiveServer
    from train.cli import main

    directory, model, tokenizer, processor = tiny
    _colour_data(str(tmp_path), 48)
    (tmp_path / "jobs.yaml").write_text(JOBS.format(model=directory, out=tmp_path / "out"))
    assert main([str(tmp_path / "jobs.yaml")]) == 0
    fox_losses = [json.loads(line)["loss"] for line in open(tmp_path / "out" / "fox" / "metrics.jsonl")]
    assert len(fox_losses) == 20 and fox_losses[-1] < fox_losses[0] / 2  # the text adapter trained beside it

    names = list(COLOURS)
    colours = [names[i % len(names)] for i in range(30)]
    held_out = [colour_image(c, 5000 + i) for i, c in enumerate(colours)]
    adapter = load_llava_adapter(str(tmp_path / "out" / "colour"), model.config, "colour")
    trained, base = _answers(model, tokenizer, processor, held_out, adapter), _answers(model, tokenizer, processor,
                                                                                        held_out)
    assert _accuracy(trained, colours) >= 0.9, trained
    assert _accuracy(base, colours) <= 0.3, base

    app = build_app(build_parser().parse_args(["--model", directory, "--dtype", "float32", "--max-model-len", "128",
                                               "--adapter", f"colour={tmp_path / 'out' / 'colour'}"]))
    engine = app.state.server.engine
    engine.start()  # no warm-up: the programs compile as the first requests need them
    with LiveServer(app, engine) as server:
        server.wait_ready()
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)

        def ask(job):
            image, name = job
            content = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": QUESTION}]
            reply = client.chat.completions.create(model=name, max_tokens=3, temperature=0,
                                                   messages=[{"role": "user", "content": content}])
            return reply.choices[0].message.content

        base_name = app.state.server.settings.model_name
        jobs = [(image, "colour") for image in held_out] + [(image, base_name) for image in held_out[:6]]
        with ThreadPoolExecutor(8) as pool:
            served = list(pool.map(ask, jobs))
    assert served[:30] == trained
    assert served[30:] == base[:6]


def test_bad_image_input_is_an_error_naming_the_record(tiny, tmp_path, capsys):
    """A remote URL, a malformed data URL, a missing file, a path outside the dataset's directory,
    too many images, a TRL image part without an `images` entry, a typed `<image>` too many, an
    over-long sample with images (never truncated), images on a text-only model: each a
    ConfigError naming the dataset line (and the part); a malformed part already when read."""
    from train.base_model import load_base_model
    from train.cli import main
    from train.data import read_jsonl

    directory, model, tokenizer, processor = tiny
    vision = _vision(model, processor)
    good = {"type": "image_url", "image_url": {"url": data_url(colour_image("red", 0))}}
    (tmp_path / "data").mkdir()
    colour_image("blue", 1).save(tmp_path / "outside.png")  # exists, but outside data/
    cases = {
        "not fetched.*'https'": [colour_record({"type": "image_url", "image_url": {"url": "https://x/cat.png"}}, "r")],
        "malformed image data URL": [colour_record({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%"}},
                                                   "r")],
        "cannot read image file 'imgs/none.png'": [colour_record({"type": "image", "path": "imgs/none.png"}, "r")],
        "outside the dataset's directory": [colour_record({"type": "image", "path": "../outside.png"}, "r")],
        "9 images in the record; at most 8": [{"messages": [{"role": "user", "content": [good] * 9},
                                                             {"role": "assistant", "content": "r"}]}],
        "takes the record's next 'images' entry, but it has only 0": [colour_record({"type": "image"}, "r")],
        "placeholder": [colour_record(good, "r") | {"messages": [
            {"role": "user", "content": [good, {"type": "text", "text": "<image>"}]}, {"role": "assistant", "content": "r"}]}],
    }
    for words, records in cases.items():
        path = _write(str(tmp_path / "data"), [colour_record(good, "red")] + records)
        with pytest.raises(ConfigError, match=r"data\.jsonl:2: .*" + words):
            load_job_samples(_job(path), tokenizer, 256, "refuse", vision)
    path = _write(str(tmp_path / "data"), [colour_record(good, "red")])
    with pytest.raises(ConfigError, match=r"data\.jsonl:1: .*never truncated"):
        load_job_samples(_job(path), tokenizer, 20, "truncate", vision)
    with pytest.raises(ConfigError, match=r"data\.jsonl:1: the record holds 1 image\(s\), but the base model reads text"):
        load_job_samples(_job(path), tokenizer, 256, "refuse", None)  # vision None: a text-only model
    bad_part = _write(str(tmp_path / "data"), [colour_record({"type": "video", "path": "a.mp4"}, "r")])
    with pytest.raises(ConfigError, match=r"data\.jsonl:1: messages\[0\]\.content\[0\]: expected a part"):
        read_jsonl(bad_part)
    with pytest.raises(ConfigError, match="vision-language model: task heads and knowledge fusion"):
        load_base_model(directory, jnp.float32)
    remote = _write(str(tmp_path / "data"), [colour_record(good, "red"), colour_record(
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}, "r")])
    os.replace(remote, tmp_path / "data" / "colour.jsonl")
    (tmp_path / "data" / "fox.jsonl").write_text(json.dumps({"text": "the quick brown fox"}) + "\n")
    (tmp_path / "data" / "jobs.yaml").write_text(JOBS.format(model=directory, out=tmp_path / "out"))
    assert main([str(tmp_path / "data" / "jobs.yaml")]) == 2  # jaxlora-train: exit status 2, the record named
    assert re.search(r"error: .*colour\.jsonl:2: messages\[0\]\.content\[0\]: image URLs are not fetched",
                     capsys.readouterr().err)
