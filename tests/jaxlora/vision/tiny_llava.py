"""A tiny random LLaVA-1.5 written by `transformers` (CLIP tower 32x32 pixels in 8x8 patches, 3
layers of width 32; Llama 2 layers of width 64, vocab 320), its byte-level BPE tokenizer with an
`<image>` special token, the LLaVA image processor's settings, and generated test images."""

from __future__ import annotations

import json
import os

import numpy as np

IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = 1
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
CORPUS = ["USER: what colour is the square in the picture? ASSISTANT: red green blue",
          "Describe both images and compare them.", "the quick brown fox jumps over the lazy dog"]


def tiny_llava_config(**overrides):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=16)
    text = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0)
    values = dict(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID, image_seq_length=16)
    values.update(overrides)
    return LlavaConfig(**values)


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", IMAGE_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    assert tokenizer.token_to_id(IMAGE_TOKEN) == IMAGE_TOKEN_ID
    return tokenizer


def image_processor_pil(**overrides):
    """transformers' LLaVA image processor (Pillow backend) at the tower's 32 pixels."""
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    return LlavaImageProcessorPil(**{"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32},
                                     **overrides})


def hf_processor(directory: str):
    """`LlavaProcessor` over the directory's tokenizer and the Pillow image processor."""
    from transformers import LlavaProcessor, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(directory, "tokenizer.json"),
                                        eos_token="<|endoftext|>")
    return LlavaProcessor(image_processor=image_processor_pil(), tokenizer=tokenizer, patch_size=8,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1)


def write_tiny_llava(directory: str, seed: int = 0, scales: dict[str, float] | None = None, **config_overrides):
    """Writes the model (safetensors), tokenizer and preprocessor config; returns the HF model
    (float32, eager attention, eval mode). scales: parameters whose name contains a key are
    multiplied by its value (e.g. a louder projector or LM head for a model trained in a test)."""
    import torch
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration._from_config(tiny_llava_config(**config_overrides), dtype=torch.float32,
                                                       attn_implementation="eager")
    with torch.no_grad():  # non-trivial norms and biases, so that a mix-up shows
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
            if "class_embedding" in name or "position_embedding" in name:
                param.normal_(0, 0.5)
            for key, factor in (scales or {}).items():
                if key in name:
                    param.mul_(factor)
    model.eval()
    model.save_pretrained(directory, safe_serialization=True)
    make_tokenizer().save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}, f)
    image_processor_pil().save_pretrained(directory)
    return model


def make_image(height: int, width: int, seed: int = 0, mode: str = "RGB"):
    """A generated Pillow image: a colour gradient with a square and noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], -1)
    pixels[height // 4: height // 2, width // 3: width // 2] = rng.integers(0, 256, 3)
    pixels = np.clip(pixels + rng.integers(-20, 21, pixels.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    if mode == "RGBA":
        alpha = Image.fromarray(rng.integers(0, 256, (height, width)).astype(np.uint8), "L")
        image = image.copy()
        image.putalpha(alpha)
    elif mode != "RGB":
        image = image.convert(mode)
    return image
