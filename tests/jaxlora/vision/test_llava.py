"""LLaVA-1.5 (jaxlora.vision) against `transformers` and PEFT on a tiny random checkpoint, f32:
preprocessing, the prompt's image-token layout, logits with one and two images, a PEFT adapter of
the language model, LoRA on the vision tower refused by name, greedy generation."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlora.lora.adapter_config import AdapterError
from jaxlora.lora.plan import build_plan
from jaxlora.lora.pool import AdapterPool
from jaxlora.nn.model_config import ConfigError
from jaxlora.models.llama import LoraInputs
from jaxlora.sampling import SamplingParams
from jaxlora.vision.adapters import LANGUAGE_MODEL_TARGETS, load_llava_adapter, load_llava_lora
from jaxlora.vision.config import llava_config_from_hf
from jaxlora.vision.generate import generate_with_images
from jaxlora.vision.llava import check_image_tokens
from jaxlora.vision.loading import load_vlm
from jaxlora.vision.tower_lora import tower_lora_inputs
from jaxlora.vision.preprocess import (expand_image_tokens, image_processor_from_hf, preprocess_image,
                                       preprocess_images)
from tests.jaxlora.hf_checkpoints import relative_error
from tests.jaxlora.vision.tiny_llava import (IMAGE_TOKEN_ID, hf_processor, image_processor_pil, make_image,
                                             write_tiny_llava)

ONE = "USER: <image>\nwhat colour is the square in the picture? ASSISTANT:"
TWO = "USER: <image> and <image>\nDescribe both images and compare them. ASSISTANT:"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory, HF model, our (model, tokenizer, image processor settings), HF processor)."""
    directory = str(tmp_path_factory.mktemp("tiny_llava"))
    hf_model = write_tiny_llava(directory)
    return directory, hf_model, load_vlm(directory), hf_processor(directory)


def _hf_inputs(processor, text, images):
    return processor(text=[text], images=images, return_tensors="np")


def _torch_logits(model, inputs):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.as_tensor(inputs["input_ids"]),
                     pixel_values=torch.as_tensor(inputs["pixel_values"])).logits.numpy()


def _our_inputs(ours, text, images):
    model, tokenizer, settings = ours
    ids = expand_image_tokens(tokenizer.encode(text), model.config.image_token_id, model.config.tokens_per_image)
    return np.array([ids]), preprocess_images(images, settings)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens, pixels, lora, tower_lora):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return nnx.merge(graphdef, state)(tokens, positions, pixel_values=pixels, lora=lora, tower_lora=tower_lora)[0]


@functools.partial(jax.jit, static_argnums=0)
def _encode_jit(graphdef, state, pixels, tower_lora):
    return nnx.merge(graphdef, state).encode_images(pixels, tower_lora)


def _encode(graphdef, state, pixels, tower_lora):
    return np.asarray(_encode_jit(graphdef, state, pixels, tower_lora))


def _our_logits(model, tokens, pixels, lora=None, tower_lora=None):
    return np.asarray(_forward(*nnx.split(model), tokens, pixels, lora, tower_lora))


def test_preprocessing_equals_transformers_processor():
    images = [make_image(48, 40, 0), make_image(30, 70, 1), make_image(50, 50, 2, "RGBA"), make_image(33, 64, 3, "L"),
              make_image(20, 24, 4)]  # smaller than the crop: resized up
    for overrides in ({}, {"do_pad": True}):
        processor = image_processor_pil(**overrides)
        expected = processor(images, return_tensors="np")["pixel_values"]
        settings = image_processor_from_hf(processor.to_dict())
        ours = preprocess_images(images, settings)
        assert ours.shape == expected.shape == (len(images), 3, 32, 32) and ours.dtype == np.float32
        np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)
    array = np.asarray(images[0])  # a uint8 [H, W, 3] array gives the same as the Pillow image
    np.testing.assert_array_equal(preprocess_image(array, settings), preprocess_image(images[0], settings))


def test_prompt_layout_and_pixels_equal_processor(tiny):
    _, _, ours, processor = tiny
    images = [make_image(48, 40, 0), make_image(30, 70, 1)]
    expected = _hf_inputs(processor, TWO, images)
    tokens, pixels = _our_inputs(ours, TWO, images)
    assert tokens.tolist() == expected["input_ids"].tolist()
    assert int(np.sum(tokens == IMAGE_TOKEN_ID)) == 2 * ours[0].config.tokens_per_image == 32
    np.testing.assert_allclose(pixels, expected["pixel_values"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("text,count", [(ONE, 1), (TWO, 2)], ids=["one image", "two images"])
def test_logits_equal_transformers(tiny, text, count):
    _, hf_model, ours, processor = tiny
    images = [make_image(48, 40, 0), make_image(30, 70, 1)][:count]
    expected = _torch_logits(hf_model, _hf_inputs(processor, text, images))
    tokens, pixels = _our_inputs(ours, text, images)
    got = _our_logits(ours[0], tokens, pixels)
    assert np.abs(got - expected).max() <= 1e-4 and relative_error(got, expected) <= 1e-4
    other = _our_logits(ours[0], tokens, preprocess_images([make_image(40, 40, 9)] * count, ours[2]))
    assert relative_error(other, expected) > 1e-3  # the image matters


def _peft_adapter(directory, out, target_modules, **options):
    """Saves a PEFT LoRA (random non-zero B) on a fresh HF LLaVA from `directory`; returns the PEFT model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(1)
    base = LlavaForConditionalGeneration.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=target_modules,
                                                 init_lora_weights=False, **options)).eval()
    peft_model.save_pretrained(str(out))
    return peft_model


def test_peft_adapter_on_the_language_model_equals_peft(tiny, tmp_path):
    directory, hf_model, ours, processor = tiny
    model = ours[0]
    peft_model = _peft_adapter(directory, tmp_path, LANGUAGE_MODEL_TARGETS, use_rslora=True,
                               rank_pattern={"layers.1.mlp.down_proj": 2}, alpha_pattern={"o_proj": 3})
    images = [make_image(48, 40, 0), make_image(30, 70, 1)]
    inputs = _hf_inputs(processor, TWO, images)
    expected = _torch_logits(peft_model, inputs)
    adapter = load_llava_adapter(str(tmp_path), model.config)
    assert set(adapter.modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert adapter.modules["down_proj"].rank.tolist() == [4, 2]
    pool = AdapterPool(model.config.text, num_slots=2, max_rank=8)
    slot = pool.load(adapter)
    tokens, pixels = _our_inputs(ours, TWO, images)
    got = _our_logits(model, tokens, pixels, LoraInputs(pool.arrays, build_plan(np.full(tokens.shape, slot))))
    assert relative_error(expected, _torch_logits(hf_model, inputs)) > 1e-2  # the adapter matters
    assert np.abs(got - expected).max() <= 1e-4 and relative_error(got, expected) <= 1e-4


def test_saved_language_adapter_loads_in_peft_and_back(tiny, tmp_path):
    """`save_llava_adapter` (what jaxlora-train writes for a LLaVA): PEFT loads it onto the HF
    LLaVA (its language model only: CLIP's q/v_proj untouched) with our logits (1e-4); a rank
    pattern keyed by our module name is renamed; `load_llava_adapter` reads it back exactly."""
    import torch
    from peft import PeftModel
    from transformers import LlavaForConditionalGeneration

    from jaxlora.lora.adapter import random_adapter
    from jaxlora.lora.adapter_config import LoraConfig
    from jaxlora.vision.adapters import save_llava_adapter

    directory, hf_model, ours, processor = tiny
    model = ours[0]
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "down_proj"),
                      rank_pattern={"model.layers.1.mlp.down_proj": 2})
    adapter = random_adapter("t", model.config.text, lora, seed=5, b_std=0.3)
    save_llava_adapter(adapter, str(tmp_path), base_model_name=directory)
    base = LlavaForConditionalGeneration.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    peft_model = PeftModel.from_pretrained(base, str(tmp_path)).eval()
    assert not any("vision_tower" in name for name, _ in peft_model.named_modules() if name.endswith("lora_A"))
    images = [make_image(48, 40, 0)]
    expected = _torch_logits(peft_model, _hf_inputs(processor, ONE, images))
    back = load_llava_adapter(str(tmp_path), model.config)
    assert back.modules["down_proj"].rank.tolist() == [4, 2]
    for name, module in adapter.modules.items():
        assert np.array_equal(back.modules[name].a, module.a) and np.array_equal(back.modules[name].b, module.b)
    pool = AdapterPool(model.config.text, num_slots=2, max_rank=4)
    slot = pool.load(back)
    tokens, pixels = _our_inputs(ours, ONE, images)
    got = _our_logits(model, tokens, pixels, LoraInputs(pool.arrays, build_plan(np.full(tokens.shape, slot))))
    assert relative_error(expected, _torch_logits(hf_model, _hf_inputs(processor, ONE, images))) > 1e-3
    assert np.abs(got - expected).max() <= 1e-4 and relative_error(got, expected) <= 1e-4


def test_lora_on_the_vision_tower_is_refused_by_module(tiny, tmp_path):
    directory, _, ours, _ = tiny
    _peft_adapter(directory, tmp_path, ["q_proj", "v_proj"])  # also CLIP's q/v_proj
    with pytest.raises(AdapterError, match=r"vision tower \(module model\.vision_tower\.encoder\.layers\.0\."
                                           r"self_attn\.q_proj\)"):
        load_llava_adapter(str(tmp_path), ours[0].config)


def test_peft_adapter_on_the_vision_tower_equals_peft(tiny, tmp_path):
    """PEFT's plain ["q_proj", "v_proj", ...] puts LoRA on CLIP's linears too: `load_llava_lora`
    reads both parts; each image runs with its own tower adapter (slot) or none (-1)."""
    directory, hf_model, ours, processor = tiny
    model = ours[0]
    peft_model = _peft_adapter(directory, tmp_path, ["q_proj", "v_proj", "out_proj", "fc2"],
                               rank_pattern={"fc2": 2}, alpha_pattern={"out_proj": 3})
    images = [make_image(48, 40, 0), make_image(30, 70, 1)]
    expected = _torch_logits(peft_model, _hf_inputs(processor, TWO, images))
    both = load_llava_lora(str(tmp_path), model.config)
    assert set(both.language.modules) == {"q_proj", "v_proj"}
    assert set(both.tower.modules) == {"q_proj", "v_proj", "out_proj", "fc2"}
    assert both.tower.modules["fc2"].rank.tolist() == [2, 2] and both.tower.modules["out_proj"].scale[0] == 3 / 4
    pool = AdapterPool(model.config.text, num_slots=2, max_rank=8)
    tokens, pixels = _our_inputs(ours, TWO, images)
    slot = pool.load(both.language)
    lora = LoraInputs(pool.arrays, build_plan(np.full(tokens.shape, slot)))
    got = _our_logits(model, tokens, pixels, lora, tower_lora_inputs([both.tower], [0, 0]))
    assert relative_error(_our_logits(model, tokens, pixels, lora), expected) > 1e-3  # the tower's part matters
    assert np.abs(got - expected).max() <= 1e-4 and relative_error(got, expected) <= 1e-4
    mixed = _encode(*nnx.split(model), pixels, tower_lora_inputs([both.tower], [0, -1]))
    everywhere = _encode(*nnx.split(model), pixels, tower_lora_inputs([both.tower], [0, 0]))
    nowhere = _encode(*nnx.split(model), pixels, tower_lora_inputs([both.tower], [-1, -1]))
    np.testing.assert_array_equal(mixed, np.stack([everywhere[0], nowhere[1]]))
    np.testing.assert_allclose(nowhere, model.encode_images(pixels), atol=1e-6)


def test_lora_on_the_projector_is_refused_by_module(tiny, tmp_path):
    directory, _, ours, _ = tiny
    _peft_adapter(directory, tmp_path, ["linear_1"])
    with pytest.raises(AdapterError, match=r"multimodal projector \(module model\.multi_modal_projector\.linear_1\)"):
        load_llava_lora(str(tmp_path), ours[0].config)


def test_greedy_generation_equals_transformers(tiny):
    import torch

    _, hf_model, ours, processor = tiny
    model = ours[0]
    images = [make_image(48, 40, 0), make_image(30, 70, 1), make_image(40, 60, 2)]
    jobs = [(ONE, images[:1]), (TWO, images[1:])]
    expected = []
    for text, job_images in jobs:
        inputs = _hf_inputs(processor, text, job_images)
        with torch.no_grad():
            out = hf_model.generate(input_ids=torch.as_tensor(inputs["input_ids"]),
                                    pixel_values=torch.as_tensor(inputs["pixel_values"]), max_new_tokens=6,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    prompts = [_our_inputs(ours, text, job_images)[0][0].tolist() for text, job_images in jobs]
    got = generate_with_images(model, prompts, preprocess_images(images, ours[2]), SamplingParams(max_new_tokens=6))
    assert got == expected
    # the first token is the full forward's argmax (test_logits_equal_transformers compiled it)
    tokens, pixels = np.array([prompts[0]]), preprocess_images(images[:1], ours[2])
    assert int(np.argmax(_our_logits(model, tokens, pixels)[0, -1])) == got[0][0]


def _renamed_checkpoint(directory, out, rename):
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(directory, out)
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    save_file({rename(name): tensor for name, tensor in tensors.items()}, os.path.join(out, "model.safetensors"))


@pytest.mark.parametrize("layout", ["llava-hf hub", "transformers in memory"])
def test_checkpoint_layouts_load_alike(tiny, tmp_path, layout):
    """The llava-hf hub files (`vision_tower.vision_model.`) and transformers' in-memory names
    (`model.language_model.`, `model.vision_tower.`, `lm_head.`) load as what transformers writes."""
    directory, _, ours, _ = tiny
    hub = lambda name: name.replace("vision_tower.", "vision_tower.vision_model.")
    memory = lambda name: ("lm_head.weight" if name == "language_model.lm_head.weight" else
                           name.replace("language_model.model.", "model.language_model.")
                           .replace("vision_tower.", "model.vision_tower.")
                           .replace("multi_modal_projector.", "model.multi_modal_projector."))
    _renamed_checkpoint(directory, tmp_path / "renamed", hub if layout == "llava-hf hub" else memory)
    model = load_vlm(str(tmp_path / "renamed"))[0]
    tokens, pixels = _our_inputs(ours, ONE, [make_image(48, 40, 0)])
    np.testing.assert_array_equal(_our_logits(model, tokens, pixels), _our_logits(ours[0], tokens, pixels))


def test_feature_layers_list_and_full_strategy_equal_transformers(tmp_path):
    """vision_feature_layer [-4, -1] (the embeddings and the last layer, concatenated) and the CLS
    position kept ("full": 17 tokens an image)."""
    from transformers import LlavaProcessor

    hf_model = write_tiny_llava(str(tmp_path), seed=2, vision_feature_layer=[-4, -1],
                                vision_feature_select_strategy="full")
    ours = load_vlm(str(tmp_path))
    assert ours[0].config.feature_layers == (0, 3) and ours[0].config.tokens_per_image == 17
    base = hf_processor(str(tmp_path))
    processor = LlavaProcessor(image_processor=base.image_processor, tokenizer=base.tokenizer, patch_size=8,
                               vision_feature_select_strategy="full", num_additional_image_tokens=1)
    images = [make_image(48, 40, 0), make_image(30, 70, 1)]
    inputs = _hf_inputs(processor, TWO, images)
    tokens, pixels = _our_inputs(ours, TWO, images)
    assert tokens.tolist() == inputs["input_ids"].tolist()
    expected = _torch_logits(hf_model, inputs)
    got = _our_logits(ours[0], tokens, pixels)
    assert np.abs(got - expected).max() <= 1e-4 and relative_error(got, expected) <= 1e-4


def test_image_token_count_must_match_images(tiny):
    model = tiny[2][0]
    prompt = expand_image_tokens([5, IMAGE_TOKEN_ID, 7], IMAGE_TOKEN_ID, model.config.tokens_per_image)
    check_image_tokens(prompt, IMAGE_TOKEN_ID, 1, model.config.tokens_per_image)
    with pytest.raises(ValueError, match="holds 16 image tokens, but 2 images need 32"):
        generate_with_images(model, [prompt], np.zeros((2, 3, 32, 32), np.float32), SamplingParams(max_new_tokens=1))


def test_unsupported_configs_are_refused():
    base = {"model_type": "llava", "vision_config": {"model_type": "clip_vision_model"}, "text_config": {}}
    assert llava_config_from_hf(base).tokens_per_image == 49  # CLIP's defaults: 224 / 32
    with pytest.raises(ConfigError, match="LLaVA-NeXT"):
        llava_config_from_hf({**base, "model_type": "llava_next"})
    with pytest.raises(ConfigError, match="siglip_vision_model"):
        llava_config_from_hf({**base, "vision_config": {"model_type": "siglip_vision_model"}})
    with pytest.raises(ConfigError, match="vision_feature_layer 30"):
        llava_config_from_hf({**base, "vision_feature_layer": 30})


def test_paged_chunked_prefill_with_images_equals_the_full_forward(tiny):
    """The serving step's primitive: `paged_forward(image_rows=)` over two prefill chunks, the
    first ending inside the second image, gives the full forward's logits at both chunk ends."""
    from jaxlora.models.paged import PagedBatch, PagedKVCache, paged_forward
    from jaxlora.vision.llava import image_row_index

    _, _, ours, _ = tiny
    model = ours[0]
    tokens, pixels = _our_inputs(ours, TWO, [make_image(48, 40, 0), make_image(30, 70, 1)])
    full = _our_logits(model, tokens, pixels)[0]
    prompt, split = tokens[0], int(np.flatnonzero(tokens[0] == IMAGE_TOKEN_ID)[20])  # inside image 2
    rows = model.encode_images(pixels).reshape(-1, model.config.text.hidden_size)  # the request's 32 rows
    cache = PagedKVCache.zeros(model.config.text, num_pages=8, page_size=16)
    for begin, end in ((0, split), (split, len(prompt))):
        batch = PagedBatch(jnp.asarray(prompt[begin:end], jnp.int32), jnp.arange(begin, end, dtype=jnp.int32),
                           jnp.zeros(end - begin, jnp.int32), jnp.arange(8, dtype=jnp.int32)[None],
                           jnp.asarray([end - begin - 1], jnp.int32))
        index = image_row_index(prompt, IMAGE_TOKEN_ID, begin, end)
        logits, cache = paged_forward(model.language, batch, cache, image_rows=(rows, jnp.asarray(index)))
        np.testing.assert_allclose(np.asarray(logits[0]), full[end - 1], atol=1e-5)


def test_jaxlora_generate_cli_with_images(tiny, tmp_path, capsys):
    from jaxlora.generate_cli import generate_main
    from jaxlora.vision.generate import generate_text_with_images
    from PIL import Image

    directory, _, ours, _ = tiny
    make_image(48, 40, 0).save(tmp_path / "square.png")
    expected = generate_text_with_images(*ours, [ONE], [[Image.open(tmp_path / "square.png")]],
                                         SamplingParams(max_new_tokens=1))[0]
    assert generate_main([ONE, "--model", directory, "--image", str(tmp_path / "square.png"),
                          "--max-new-tokens", "1"]) == 0
    assert capsys.readouterr().out == f"> {ONE}\n{expected}\n\n"
    assert generate_main([TWO, "--model", directory, "--image", str(tmp_path / "square.png")]) == 2
    assert "the prompts hold 2 <image> placeholders but 1 --image files" in capsys.readouterr().err


def test_llava_names_of_every_transformers_layout():
    from jaxlora.vision.config import split_llava_name

    cases = {
        "language_model.model.layers.3.mlp.up_proj.weight": ("text", "model.layers.3.mlp.up_proj.weight"),
        "model.language_model.layers.3.mlp.up_proj": ("text", "model.layers.3.mlp.up_proj"),
        "language_model.lm_head.weight": ("text", "lm_head.weight"),
        "lm_head.weight": ("text", "lm_head.weight"),
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.bias": ("vision", "encoder.layers.0.mlp.fc1.bias"),
        "model.vision_tower.encoder.layers.0.self_attn.q_proj": ("vision", "encoder.layers.0.self_attn.q_proj"),
        "model.multi_modal_projector.linear_2.weight": ("projector", "linear_2.weight"),
        "model.layers.0.self_attn.q_proj": None,
    }
    for name, expected in cases.items():
        assert split_llava_name(name) == expected, name
