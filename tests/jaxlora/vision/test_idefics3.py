"""Idefics3 / SmolVLM (jaxlora.vision, the second family) against `transformers` and PEFT on a
tiny random checkpoint, f32: preprocessing with image splitting, the prompt's tile layout, logits
with one and two images, PEFT adapters on the language model and on the SigLIP tower, the
connector's LoRA refused by name, greedy generation, the serving engine's greedy tokens, and
`jaxlora-generate --image`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlora.lora.adapter_config import AdapterError
from jaxlora.lora.plan import build_plan
from jaxlora.lora.pool import AdapterPool
from jaxlora.models.llama import LoraInputs
from jaxlora.nn.model_config import ConfigError
from jaxlora.sampling import SamplingParams
from jaxlora.vision.adapters import IDEFICS3_LANGUAGE_MODEL_TARGETS, load_vlm_adapter, load_vlm_lora
from jaxlora.vision.generate import generate_with_images
from jaxlora.vision.idefics3_preprocess import idefics3_image_config_from_hf, preprocess_idefics3_image
from jaxlora.vision.loading import load_vlm, vlm_config_from_hf
from jaxlora.vision.prompts import expand_prompt, idefics3_processing
from jaxlora.vision.tower_lora import tower_lora_inputs
from tests.jaxlora.hf_checkpoints import relative_error
from tests.jaxlora.vision.tiny_idefics3 import (IMAGE_TOKEN_ID, TILE, TOKENS_PER_TILE, hf_processor,
                                                image_processor_pil, make_image, write_tiny_idefics3)

ONE = "USER: <image>\nwhat colour is the square in the picture? ASSISTANT:"
TWO = "USER: <image> and <image>\nDescribe both images and compare them. ASSISTANT:"
IMAGES = ((40, 30, 0), (30, 70, 1))  # (height, width, seed): 2x2 and 1x2 tiles (+ the global image)


def _images(count=2):
    return [make_image(h, w, seed) for h, w, seed in IMAGES[:count]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory, HF model, our (model, tokenizer, processor), HF processor)."""
    directory = str(tmp_path_factory.mktemp("tiny_idefics3"))
    hf_model = write_tiny_idefics3(directory)
    return directory, hf_model, load_vlm(directory), hf_processor(directory)


def _hf_inputs(processor, text, images):
    return processor(text=[text], images=[images], return_tensors="np")


def _torch_logits(model, inputs):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.as_tensor(inputs["input_ids"]), pixel_values=torch.as_tensor(inputs["pixel_values"]),
                     pixel_attention_mask=torch.as_tensor(inputs["pixel_attention_mask"])).logits.numpy()


def _our_inputs(ours, text, images):
    model, tokenizer, processor = ours
    expanded = expand_prompt(processor, model.config.image_token_id, model.config.tokens_per_image,
                             tokenizer.encode(text), images)
    return np.array([expanded.ids]), expanded.pixels


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens, pixels, lora, tower_lora):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return nnx.merge(graphdef, state)(tokens, positions, pixel_values=pixels, lora=lora, tower_lora=tower_lora)[0]


def _our_logits(model, tokens, pixels, lora=None, tower_lora=None):
    return np.asarray(_forward(*nnx.split(model), tokens, pixels, lora, tower_lora))


def _close(got, expected):
    assert np.abs(got - expected).max() <= 1e-4 and relative_error(got, expected) <= 1e-4


def test_preprocessing_equals_transformers_processor():
    """Odd-sized RGB, RGBA, grey, tiny and wide images: the tiles' pixel values (image splitting
    on, the processor's default, at its default 4-tile longest edge and at 2 tiles; and off) and
    each image's rows x cols equal `Idefics3ImageProcessorPil`'s (1e-6)."""
    images = [make_image(40, 30, 0), make_image(30, 70, 1), make_image(50, 50, 2, "RGBA"), make_image(33, 64, 3, "L"),
              make_image(7, 9, 4), make_image(20, 130, 5)]
    for overrides in ({"size": {"longest_edge": 4 * TILE}}, {}, {"do_image_splitting": False}):
        processor = image_processor_pil(**overrides)
        expected = processor(images=[images], return_tensors="np", return_row_col_info=True)
        settings = idefics3_image_config_from_hf(processor.to_dict())
        ours = [preprocess_idefics3_image(image, settings) for image in images]
        pixels = np.concatenate([tiles for tiles, _, _ in ours])
        assert pixels.shape == expected["pixel_values"][0].shape and pixels.dtype == np.float32
        np.testing.assert_allclose(pixels, expected["pixel_values"][0], atol=1e-6, rtol=0)
        assert [(rows, cols) for _, rows, cols in ours] == list(zip(expected["rows"][0], expected["cols"][0]))
        assert np.all(expected["pixel_attention_mask"] == 1)  # every tile is whole: no pixel padding
    assert [r for _, r, _ in ours] == [0] * len(images)  # without splitting: one tile an image


def test_position_buckets_equal_transformers():
    """Each patch's position embedding row, read from transformers' `Idefics3VisionEmbeddings`
    (patch weights zero, position row k = k), equals `position_ids` at sides where float rounding
    makes them row-major (6, 26, 27, 32) and where it does not (19, 25, 29)."""
    import torch
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

    from jaxlora.vision.siglip import position_ids

    for side in (6, 19, 25, 26, 27, 29, 32):
        embeddings = Idefics3VisionEmbeddings(Idefics3VisionConfig(hidden_size=1, image_size=2 * side, patch_size=2))
        with torch.no_grad():
            for param in embeddings.patch_embedding.parameters():
                param.zero_()
            embeddings.position_embedding.weight.copy_(torch.arange(side * side, dtype=torch.float32)[:, None])
            rows = embeddings(torch.zeros(1, 3, 2 * side, 2 * side), torch.ones(1, side, side, dtype=torch.bool))
        expected = rows[0, :, 0].numpy().astype(int)
        assert expected.tolist() == position_ids(side).tolist(), side
        assert (expected == np.arange(side * side)).all() == (side in (6, 26, 27, 32)), side


@pytest.mark.parametrize("overrides", [{}, {"do_image_splitting": False}], ids=["split", "not split"])
def test_prompt_layout_and_pixels_equal_processor(tiny, overrides):
    """Our ids (tokenise, then each `<image>` -> its tiles' layout) equal `Idefics3Processor`'s,
    with image splitting (rows of `<row_r_col_c>` tiles, newlines, the global image) and without."""
    directory, _, ours, _ = tiny
    model, tokenizer, processor = ours
    settings = idefics3_image_config_from_hf(image_processor_pil(**overrides).to_dict())
    processing = idefics3_processing(settings, tokenizer.encode, IMAGE_TOKEN_ID, TOKENS_PER_TILE)
    expected = _hf_inputs(hf_processor(directory, **overrides), TWO, _images())
    tokens, pixels = _our_inputs((model, tokenizer, processing), TWO, _images())
    assert tokens.tolist() == expected["input_ids"].tolist()
    tiles = (5 + 3) if not overrides else 2  # 2x2 + global, 1x2 + global
    assert len(pixels) == tiles and int(np.sum(tokens == IMAGE_TOKEN_ID)) == tiles * TOKENS_PER_TILE
    np.testing.assert_allclose(pixels, expected["pixel_values"][0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("count", [1, 2], ids=["one image", "two images"])
def test_logits_equal_transformers(tiny, count):
    _, hf_model, ours, processor = tiny
    text = ONE if count == 1 else TWO
    expected = _torch_logits(hf_model, _hf_inputs(processor, text, _images(count)))
    tokens, pixels = _our_inputs(ours, text, _images(count))
    got = _our_logits(ours[0], tokens, pixels)
    _close(got, expected)
    other = _our_logits(ours[0], tokens, np.roll(pixels, 1, axis=0))  # the tiles in another order
    assert relative_error(other, expected) > 1e-3  # the images matter


def _peft_adapter(directory, out, target_modules, **options):
    """Saves a PEFT LoRA (random non-zero B) on a fresh HF Idefics3 from `directory`; returns the PEFT model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Idefics3ForConditionalGeneration

    torch.manual_seed(1)
    base = Idefics3ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=target_modules,
                                                 init_lora_weights=False, **options)).eval()
    peft_model.save_pretrained(str(out))
    return peft_model


def _lora(model, adapter, tokens):
    pool = AdapterPool(model.config.text, num_slots=2, max_rank=8)
    slot = pool.load(adapter)
    return LoraInputs(pool.arrays, build_plan(np.full(tokens.shape, slot)))


def test_peft_adapter_on_the_language_model_equals_peft(tiny, tmp_path):
    directory, hf_model, ours, processor = tiny
    model = ours[0]
    peft_model = _peft_adapter(directory, tmp_path, IDEFICS3_LANGUAGE_MODEL_TARGETS, use_rslora=True,
                               rank_pattern={"layers.1.mlp.down_proj": 2}, alpha_pattern={"o_proj": 3})
    inputs = _hf_inputs(processor, TWO, _images())
    expected = _torch_logits(peft_model, inputs)
    adapter = load_vlm_adapter(str(tmp_path), model.config)
    assert set(adapter.modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert adapter.modules["down_proj"].rank.tolist() == [4, 2]
    tokens, pixels = _our_inputs(ours, TWO, _images())
    got = _our_logits(model, tokens, pixels, _lora(model, adapter, tokens))
    assert relative_error(expected, _torch_logits(hf_model, inputs)) > 1e-2  # the adapter matters
    _close(got, expected)


def test_peft_adapter_on_the_vision_tower_equals_peft_and_is_refused_by_the_language_loader(tiny, tmp_path):
    """PEFT's plain ["q_proj", "v_proj", ...] also puts LoRA on SigLIP's linears: `load_vlm_lora`
    reads both parts (logits 1e-4 of PEFT's); `load_vlm_adapter` (what serving reads) refuses it
    naming the module; LoRA on the connector is refused by both."""
    directory, _, ours, processor = tiny
    model = ours[0]
    peft_model = _peft_adapter(directory, tmp_path / "tower", ["q_proj", "v_proj", "out_proj", "fc2"],
                               rank_pattern={"fc2": 2}, alpha_pattern={"out_proj": 3})
    expected = _torch_logits(peft_model, _hf_inputs(processor, TWO, _images()))
    both = load_vlm_lora(str(tmp_path / "tower"), model.config)
    assert set(both.language.modules) == {"q_proj", "v_proj"}
    assert set(both.tower.modules) == {"q_proj", "v_proj", "out_proj", "fc2"}
    tokens, pixels = _our_inputs(ours, TWO, _images())
    lora = _lora(model, both.language, tokens)
    got = _our_logits(model, tokens, pixels, lora, tower_lora_inputs([both.tower], [0] * len(pixels)))
    assert relative_error(_our_logits(model, tokens, pixels, lora), expected) > 1e-3  # the tower's part matters
    _close(got, expected)
    with pytest.raises(AdapterError, match=r"vision tower \(module model\.vision_model\.encoder\.layers\.0\."
                                           r"mlp\.fc2\).*SigLIP"):
        load_vlm_adapter(str(tmp_path / "tower"), model.config)
    _peft_adapter(directory, tmp_path / "connector", ["proj"])
    for load in (load_vlm_adapter, load_vlm_lora):
        with pytest.raises(AdapterError, match=r"connector \(module model\.connector\.modality_projection\.proj\)"):
            load(str(tmp_path / "connector"), model.config)


def _full_forward_greedy(model, prompt, pixels, steps):
    """Greedy tokens by the full forward alone (no cache): the prompt padded to one length, the
    argmax read at its last real position each step (causal: the padding after it is unseen)."""
    length = len(prompt) + steps
    out = []
    for _ in range(steps):
        ids = prompt + out
        tokens = np.array([ids + [0] * (length - len(ids))])
        out.append(int(np.argmax(_our_logits(model, tokens, pixels)[0, len(ids) - 1])))
    return out


def test_greedy_generation_equals_transformers_and_the_full_forward(tiny):
    import torch

    _, hf_model, ours, processor = tiny
    model = ours[0]
    jobs = [(ONE, _images(1)), (TWO, [make_image(50, 20, 3), make_image(24, 24, 4)])]
    expected = []
    for text, images in jobs:
        inputs = _hf_inputs(processor, text, images)
        with torch.no_grad():
            out = hf_model.generate(**{k: torch.as_tensor(v) for k, v in inputs.items()}, max_new_tokens=5,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    prepared = [_our_inputs(ours, text, images) for text, images in jobs]
    prompts = [tokens[0].tolist() for tokens, _ in prepared]
    pixels = np.concatenate([p for _, p in prepared])
    got = generate_with_images(model, prompts, pixels, SamplingParams(max_new_tokens=5))
    assert got == expected
    assert _full_forward_greedy(model, prompts[0], prepared[0][1], 5) == got[0]


def test_the_engine_greedy_tokens_equal_the_full_forward(tiny):
    """The serving engine (its language model paged, the tower beside it): prefill chunks of 16
    tokens (a tile's 9 rows split over two steps), two image requests and a text one in the same
    steps: each request's greedy tokens equal the full forward's (and `generate_with_images`')."""
    from serve.engine import Engine, EngineConfig
    from serve.vision import ImageServing

    _, _, ours, _ = tiny
    model, tokenizer, processor = ours
    serving = ImageServing(model, processor)
    requests = [serving.prompt(tokenizer.encode(ONE), _images(1)), serving.prompt(tokenizer.encode(TWO), _images()),
                (tokenizer.encode("the quick brown fox"), None)]
    engine = Engine(model.language, (), EngineConfig(page_size=8, num_pages=128, max_model_len=256, max_num_seqs=4,
                                                     token_budget=48, prefill_chunk=16, max_lora_rank=4), None,
                    images=serving)
    got = {i: [] for i in range(len(requests))}
    for i, (prompt, images) in enumerate(requests):
        engine.submit(i, prompt, None, SamplingParams(max_new_tokens=4), lambda e, i=i: got[i].append(e), images=images)
    engine.run_until_idle()
    tokens = [[e.token for e in got[i] if e.token is not None] for i in range(len(requests))]
    for (prompt, images), served in zip(requests, tokens):
        pixels = None if images is None else images.pixels
        assert served == _full_forward_greedy(model, prompt, pixels, 4)
    assert serving.encodes == 1  # both image requests' 13 tiles in one tower call


def test_jaxlora_generate_cli_with_images(tiny, tmp_path, capsys):
    from PIL import Image

    from jaxlora.generate_cli import generate_main
    from jaxlora.vision.generate import generate_text_with_images

    directory, _, ours, _ = tiny
    _images(1)[0].save(tmp_path / "square.png")
    expected = generate_text_with_images(*ours, [ONE], [[Image.open(tmp_path / "square.png")]],
                                         SamplingParams(max_new_tokens=2))[0]
    assert generate_main([ONE, "--model", directory, "--image", str(tmp_path / "square.png"),
                          "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().out == f"> {ONE}\n{expected}\n\n"


SMOLVLM_TEMPLATE = (  # HuggingFaceTB/SmolVLM-Instruct's chat template: it reads content as typed parts
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def test_a_chat_template_that_reads_typed_parts_renders_as_the_processor(tiny):
    """SmolVLM's template iterates a message's parts: our rendering of a chat whose image parts
    are `<image>` placeholders (what the server and jaxlora-train render) equals
    `Idefics3Processor.apply_chat_template` on the typed parts, so the ids and tiles do too."""
    import dataclasses

    directory, _, ours, _ = tiny
    model, tokenizer, processor = ours
    tokenizer = dataclasses.replace(tokenizer, chat_template=SMOLVLM_TEMPLATE)
    hf = hf_processor(directory)
    hf.chat_template = SMOLVLM_TEMPLATE
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"},
                                          {"type": "image"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
             {"role": "user", "content": [{"type": "text", "text": "And now?"}]}]
    ours_text = tokenizer.apply_chat_template([{"role": "user", "content": "<image>What is it?<image>"},
                                               {"role": "assistant", "content": "red"},
                                               {"role": "user", "content": "And now?"}])
    expected = hf.apply_chat_template(parts, add_generation_prompt=True)
    assert ours_text == expected and ours_text.count("<image>") == 2
    inputs = _hf_inputs(hf, expected, _images())
    tokens, _ = _our_inputs((model, tokenizer, processor), ours_text, _images())
    assert tokens.tolist() == inputs["input_ids"].tolist()
    plain = dataclasses.replace(tokenizer, image_placeholder=None)  # a text model's tokenizer: strings as they are
    assert "What is it?" not in plain.apply_chat_template([{"role": "user", "content": "What is it?"}])


def test_unsupported_configs_are_refused(tiny, tmp_path):
    import json
    import shutil

    from jaxlora.weights import WeightsError

    base = {"model_type": "idefics3", "vision_config": {"image_size": 24, "patch_size": 4}, "text_config": {}}
    assert vlm_config_from_hf(base).tokens_per_image == 9
    for model_type, words in (("smolvlm", "SmolVLM2"), ("idefics2", "perceiver"), ("gemma3", "'llava', 'idefics3'"),
                              ("qwen2_vl", "not a vision-language model jaxlora runs")):
        with pytest.raises(ConfigError, match=words):
            vlm_config_from_hf({**base, "model_type": model_type})
    with pytest.raises(ConfigError, match="text_config model_type 'mistral'"):
        vlm_config_from_hf({**base, "text_config": {"model_type": "mistral"}})
    with pytest.raises(ConfigError, match="scale_factor 4 does not divide the tower's 6 patches"):
        vlm_config_from_hf({**base, "scale_factor": 4})
    shutil.copytree(tiny[0], tmp_path / "m")
    (tmp_path / "m" / "processor_config.json").write_text(json.dumps({"image_seq_len": 16}))
    with pytest.raises(WeightsError, match="image_seq_len 16 is not the model's 9"):
        load_vlm(str(tmp_path / "m"))
