"""A tiny random Idefics3 (SmolVLM's architecture) written by `transformers`: SigLIP-style tower on
24x24 tiles in 4x4 patches (6 a side: position buckets that are not a power of two), 2 layers of
width 32, pixel shuffle x2 (9 image tokens a tile); Llama 2 layers of width 64, vocab 320; its
byte-level BPE tokenizer with Idefics3's special tokens, and the Idefics3 image processor's
settings (image splitting on, as the processor's default; longest edge 2 tiles to keep prompts
short)."""

from __future__ import annotations

import json
import os

from tests.jaxlora.vision.tiny_llava import CHAT_TEMPLATE, CORPUS, make_image  # noqa: F401  (make_image re-exported)

IMAGE_TOKEN_ID = 1
TILE = 24
TOKENS_PER_TILE = 9
SPECIALS = (["<|endoftext|>", "<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
            + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])


def tiny_idefics3_config(**overrides):
    from transformers import Idefics3Config, LlamaConfig
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=TILE, patch_size=4)
    text = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0)
    values = dict(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN_ID, scale_factor=2)
    values.update(overrides)
    return Idefics3Config(**values)


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 20 + ["\n\n", "a\nb"] * 10, trainer)
    assert tokenizer.token_to_id("<image>") == IMAGE_TOKEN_ID
    return tokenizer


def image_processor_pil(**overrides):
    """transformers' Idefics3 image processor (Pillow backend) on the tower's 24-pixel tiles."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    return Idefics3ImageProcessorPil(**{"size": {"longest_edge": 2 * TILE}, "max_image_size": {"longest_edge": TILE},
                                        **overrides})


def hf_processor(directory: str, **image_overrides):
    """`Idefics3Processor` over the directory's tokenizer and the Pillow image processor."""
    from transformers import Idefics3Processor, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(directory, "tokenizer.json"),
                                        eos_token="<|endoftext|>")
    return Idefics3Processor(image_processor=image_processor_pil(**image_overrides), tokenizer=tokenizer,
                             image_seq_len=TOKENS_PER_TILE)


def write_tiny_idefics3(directory: str, seed: int = 0, scales: dict[str, float] | None = None, **config_overrides):
    """Writes the model (safetensors), tokenizer, preprocessor and processor configs; returns the HF
    model (float32, eager attention, eval mode). scales: parameters whose name contains a key are
    multiplied by its value."""
    import torch
    from transformers import Idefics3ForConditionalGeneration

    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration._from_config(tiny_idefics3_config(**config_overrides),
                                                          dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # non-trivial norms and biases, so that a mix-up shows
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
            if "position_embedding" in name:
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
    with open(os.path.join(directory, "processor_config.json"), "w") as f:
        json.dump({"image_seq_len": TOKENS_PER_TILE, "processor_class": "Idefics3Processor"}, f)
    return model
