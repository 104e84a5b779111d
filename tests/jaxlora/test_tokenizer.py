"""The tokenizer built from GGUF metadata agrees with transformers' and keeps special tokens whole."""

import os

import pytest

TEXTS = [
    "The capital of France is Paris.",
    "<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces, tabs\tand\nnewlines  ",
    "Ünïcödé — “quotes” and emoji 🎉",
]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(smollm2, hf_tokenizer, text):
    _, tokenizer = smollm2
    assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_digits_are_split_one_by_one(smollm2):
    """SmolLM2's pre-tokenizer ('smollm' in llama.cpp) splits every digit."""
    _, tokenizer = smollm2
    pieces = [tokenizer.token_text(i) for i in tokenizer.encode("12345")]
    assert pieces == ["1", "2", "3", "4", "5"]


def test_chat_template_renders_chatml(smollm2):
    _, tokenizer = smollm2
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.encode("<|im_start|>") == [1]
