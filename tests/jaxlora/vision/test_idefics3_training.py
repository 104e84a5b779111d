"""Training LoRA on Idefics3 / SmolVLM (issue 39's second family; `train.images`): chat records
with images (data URLs, paths, TRL's `images`) on a tiny random Idefics3 written by
`transformers`. Each image becomes its tiles' layout with no loss on any of its tokens; the
packed training step's per-adapter loss equals the inference forward's sample by sample; a
`jaxlora-train` job runs and saves a PEFT adapter that `load_vlm_adapter` reads back exactly and
PEFT loads onto the HF model with our logits (1e-4)."""

import json
import os

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
from tests.jaxlora.hf_checkpoints import relative_error
from tests.jaxlora.vision.tiny_idefics3 import TOKENS_PER_TILE, write_tiny_idefics3
from tests.train.test_vision_training import QUESTION, colour_image, colour_record, data_url
from train.config import JobConfig, lora_config
from train.data import load_job_samples
from train.images import VisionInputs
from train.microbatch import device_batch, pack_microbatch

LORA = LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))
JOBS = """\
base_model: {model}
output_dir: {out}
capacity: 512
progress: false
dtype: float32
jobs:
  - name: colour
    dataset: data.jsonl
    lora: {{r: 4, alpha: 8, targets: [q_proj, v_proj, o_proj, down_proj]}}
    learning_rate: 1.0e-2
    global_batch_size: 2
    steps: 3
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model directory, Idefics3, tokenizer, processor, HF model)."""
    directory = str(tmp_path_factory.mktemp("tiny_idefics3_train"))
    hf_model = write_tiny_idefics3(directory)
    return (directory, *load_vlm(directory), hf_model)


def _records(directory) -> str:
    """data.jsonl: a record with two images (a data URL and a TRL `images` path), one with a path
    part, one with a JPEG data URL, and a text record."""
    os.makedirs(os.path.join(directory, "imgs"), exist_ok=True)
    colour_image("blue", 2).save(os.path.join(directory, "imgs", "b.png"))
    two = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(colour_image("red", 1))}},
                                                     {"type": "text", "text": " and "}, {"type": "image"},
                                                     {"type": "text", "text": QUESTION}]},
                        {"role": "assistant", "content": "red blue"}], "images": ["imgs/b.png"]}
    records = [two, colour_record({"type": "image", "path": "imgs/b.png"}, "blue"),
               colour_record({"type": "image_url", "image_url": {"url": data_url(colour_image("green", 3), "JPEG")}},
                             "green"),
               {"messages": [{"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": "dog"}]}]
    path = os.path.join(directory, "data.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


def test_samples_hold_the_tile_layout_and_the_packed_loss_equals_the_inference_forward(tiny, tmp_path):
    _, model, tokenizer, processor, _ = tiny
    vision = VisionInputs(model.config, processor, TowerEncoder(model.vision))
    job = JobConfig(name="j", dataset=_records(str(tmp_path)), lora=lora_config({"r": 4}, "test"), learning_rate=1e-3,
                    global_batch_size=1, steps=1)
    samples = load_job_samples(job, tokenizer, 512, "refuse", vision)
    assert [None if s.pixels is None else len(s.pixels) for s in samples][3] is None
    image_id = model.config.image_token_id
    for sample in samples[:3]:  # each image: its tiles' image tokens
        assert int((sample.tokens == image_id).sum()) == len(sample.pixels) * TOKENS_PER_TILE
        first, last = np.flatnonzero(sample.tokens == image_id)[[0, -1]]
        assert not sample.loss_mask[first - 2:last + 2].any()  # the layout (a user turn) carries no loss
    pool = AdapterPool(model.config.text, num_slots=2, max_rank=LORA.r)
    for slot in range(2):
        pool.load(random_adapter(f"a{slot}", model.config.text, LORA, seed=slot, b_std=0.3), slot=slot)
    entries = [(0, samples[0], 0.5), (1, samples[1], 0.25), (1, samples[3], 1.0), (0, samples[2], 0.125)]
    arrays = pack_microbatch(entries, 512, 2)
    batch, plan = device_batch(arrays, 2)
    rows = vision.encoder(arrays.pixels)
    batch["image_embeds"] = rows.reshape(-1, rows.shape[-1])
    got, _ = make_grad_step(model.language, 2, image_token_id=image_id)(*split_pool(pool.arrays), batch, plan)

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
    assert relative_error(np.asarray(got), want) <= 1e-5, (got, want)


def test_jaxlora_train_saves_an_adapter_that_loads_back_and_in_peft(tiny, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import Idefics3ForConditionalGeneration

    from jaxlora.vision.adapters import load_vlm_adapter
    from tests.jaxlora.vision.test_idefics3 import ONE, _hf_inputs, _lora, _our_inputs, _torch_logits
    from tests.jaxlora.vision.tiny_idefics3 import hf_processor, make_image
    from train.cli import main

    directory, model, tokenizer, processor, hf_model = tiny
    _records(str(tmp_path))
    (tmp_path / "jobs.yaml").write_text(JOBS.format(model=directory, out=tmp_path / "out"))
    assert main([str(tmp_path / "jobs.yaml")]) == 0
    out = str(tmp_path / "out" / "colour")
    losses = [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl"))]
    assert len(losses) == 3 and all(np.isfinite(losses))
    adapter = load_vlm_adapter(out, model.config, "colour")
    assert set(adapter.modules) == {"q_proj", "v_proj", "o_proj", "down_proj"}
    assert max(float(np.abs(m.b).max()) for m in adapter.modules.values()) > 0  # B moved off its zero init
    base = Idefics3ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    peft_model = PeftModel.from_pretrained(base, out).eval()
    assert not any("vision_model" in name for name, _ in peft_model.named_modules() if name.endswith("lora_A"))
    images = [make_image(40, 30, 0)]
    inputs = _hf_inputs(hf_processor(directory), ONE, images)
    expected = _torch_logits(peft_model, inputs)
    tokens, pixels = _our_inputs((model, tokenizer, processor), ONE, images)
    got = np.asarray(model(jnp.asarray(tokens), jnp.arange(tokens.shape[1])[None], pixel_values=jnp.asarray(pixels),
                           lora=_lora(model, adapter, tokens))[0])
    assert relative_error(expected, _torch_logits(hf_model, inputs)) > 1e-4  # the trained adapter matters
    assert np.abs(got - expected).max() <= 1e-4 and relative_error(got, expected) <= 1e-4
