"""Text <-> token ids: a HF `tokenizers` tokenizer (from `tokenizer.json` or built from GGUF
metadata) plus the model's special tokens and chat template."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
from typing import Any, Mapping, Sequence

import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4
# A chat template that reads a message's content as a list of typed parts (VLM templates:
# SmolVLM's `line['type']`, llava-hf's `selectattr('type', 'equalto', 'image')`).
_PARTS_TEMPLATE = re.compile(r"""\[\s*['"]type['"]\s*\]|\.type\b|selectattr\(\s*['"]type['"]""")

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's pre-tokenizer names -> (split each digit first?, the split regex).
_GGUF_PRE_TOKENIZERS = {
    "default": (False, _GPT2_SPLIT),
    "gpt2": (False, _GPT2_SPLIT),
    "smollm": (True, _GPT2_SPLIT),
    "starcoder": (True, _GPT2_SPLIT),
    "refact": (True, _GPT2_SPLIT),
    "llama-bpe": (False, _LLAMA3_SPLIT),
    "llama3": (False, _LLAMA3_SPLIT),
    "smaug-bpe": (False, _LLAMA3_SPLIT),
    "qwen2": (False, _QWEN2_SPLIT),
    "deepseek-r1-qwen": (False, _QWEN2_SPLIT),
}


class TokenizerError(ValueError):
    """A tokenizer that cannot be built from the given file."""


@dataclasses.dataclass
class Tokenizer:
    """Encodes text, decodes ids, and renders chat messages with the model's template."""

    backend: HFTokenizer
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None
    # A VLM's image placeholder (`jaxlora.vision.loading.load_vlm` sets "<image>"): string contents
    # are given as typed parts to a template that reads parts (`content_parts`).
    image_placeholder: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_text(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        add_bos = self.add_bos if add_bos is None else add_bos
        if add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...])."""
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template; send plain text instead")
        template = _compile_template(self.chat_template)
        if self.image_placeholder and _PARTS_TEMPLATE.search(self.chat_template):
            messages = [{**m, "content": content_parts(m["content"], self.image_placeholder)}
                        if isinstance(m.get("content"), str) else m for m in messages]
        special = {
            "bos_token": self._text_of(self.bos_token_id),
            "eos_token": self._text_of(self.eos_token_ids[0] if self.eos_token_ids else None),
        }
        return template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **special
        )

    def _text_of(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")


def content_parts(text: str, placeholder: str) -> list[dict]:
    """A message's text as the typed parts a VLM chat template reads: text parts, and an
    `{"type": "image"}` part at each `placeholder` (the template renders it back: SmolVLM's
    writes `<image>` where it was, llava-hf's all images first)."""
    parts: list[dict] = []
    for i, piece in enumerate(text.split(placeholder)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts or [{"type": "text", "text": ""}]


def _raise_exception(message: str):
    raise TokenizerError(f"chat template: {message}")


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
    return env.from_string(source)


def tokenizer_from_hf_dir(path: str) -> Tokenizer:
    """Loads `tokenizer.json` (and `tokenizer_config.json` if present) from a HF model directory."""
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tokenizer_file):
        raise TokenizerError(f"{tokenizer_file}: not found (jaxlora needs a fast-tokenizer tokenizer.json)")
    try:
        backend = HFTokenizer.from_file(tokenizer_file)
    except Exception as err:
        raise TokenizerError(f"{tokenizer_file}: cannot parse: {err}") from err
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    model_config = _read_json(os.path.join(path, "config.json"))
    generation = _read_json(os.path.join(path, "generation_config.json"))

    def token_id(value):
        if isinstance(value, dict):
            value = value.get("content")
        return backend.token_to_id(value) if isinstance(value, str) else None

    bos = token_id(config.get("bos_token"))
    eos = token_id(config.get("eos_token"))
    eos_ids = generation.get("eos_token_id", model_config.get("eos_token_id", eos))
    eos_ids = tuple(eos_ids) if isinstance(eos_ids, list) else (() if eos_ids is None else (eos_ids,))
    chat_template = config.get("chat_template")
    template_file = os.path.join(path, "chat_template.jinja")
    if chat_template is None and os.path.exists(template_file):
        with open(template_file) as f:
            chat_template = f.read()
    return Tokenizer(
        backend=backend,
        bos_token_id=bos if bos is not None else model_config.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=token_id(config.get("pad_token")),
        add_bos=False,  # tokenizer.json's post-processor adds BOS where the model wants it
        chat_template=chat_template if isinstance(chat_template, str) else None,
    )


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def tokenizer_from_gguf_metadata(metadata: Mapping[str, Any], source: str) -> Tokenizer:
    """Builds the tokenizer that GGUF metadata describes (byte-level BPE: `tokenizer.ggml.model`
    == "gpt2", as SmolLM2, Llama 3 and Qwen2 use)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerError(
            f"{source}: tokenizer.ggml.model={kind!r} is not supported (jaxlora builds byte-level "
            "BPE 'gpt2' tokenizers from GGUF); pass a HF directory with tokenizer.json instead"
        )
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    pre_name = metadata.get("tokenizer.ggml.pre", "default")
    split_digits, pattern = _GGUF_PRE_TOKENIZERS.get(pre_name, _GGUF_PRE_TOKENIZERS["default"])
    steps = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
    steps += [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    token_types = list(metadata.get("tokenizer.ggml.token_type", []))
    specials = [tokens[i] for i, kind in enumerate(token_types) if kind == _GGUF_CONTROL]
    user_defined = [tokens[i] for i, kind in enumerate(token_types) if kind == _GGUF_USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    return Tokenizer(
        backend=backend,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=metadata.get("tokenizer.chat_template"),
    )
