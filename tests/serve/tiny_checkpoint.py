"""A tiny random checkpoint on disk for server tests: a 3-layer Llama (vocab 320) written by
`transformers`, a byte-level BPE tokenizer with a chat template, and two PEFT adapters; and the
greedy token ids an in-process engine gives."""

from __future__ import annotations

import json
import pathlib

from jaxlora.lora.peft_io import load_peft_adapter, save_peft_adapter
from jaxlora.sampling import SamplingParams
from tests.jaxlora.hf_checkpoints import save_random_model, tiny_llama_config
from tests.serve.conftest import make_adapters

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Tell me a story.", "Why is the sky blue?"]


def write_checkpoint(directory: pathlib.Path) -> None:
    """The model, tokenizer.json and tokenizer_config.json (EOS <|endoftext|>, id 0) in `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    save_random_model(tiny_llama_config(eos_token_id=0, bos_token_id=0), str(directory))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(QUESTIONS * 20 + ["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                                  "chat_template": CHAT_TEMPLATE}))


def make_checkpoint(directory: pathlib.Path):
    """Writes the checkpoint and two adapters into `directory`; returns (model dir, {adapter name:
    dir}, model, tokenizer, {adapter name: LoraAdapter})."""
    from jaxlora.weights import load_model

    write_checkpoint(directory)
    model, tokenizer = load_model(str(directory))
    paths = {}
    for name, adapter in make_adapters(model.config, 2).items():
        paths[name] = directory / name
        save_peft_adapter(adapter, str(paths[name]))
    adapters = {name: load_peft_adapter(str(path), model.config, name) for name, path in paths.items()}
    return directory, paths, model, tokenizer, adapters


def chat_prompt(tokenizer, question: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]))


def reference_tokens(engine, tokenizer, jobs) -> list[list[int]]:
    """Token ids `engine` gives each (question, model, max_tokens) chat job, greedy, EOS ignored
    (model "tiny": the base model)."""
    got = {i: [] for i in range(len(jobs))}
    for i, (question, name, max_tokens) in enumerate(jobs):
        engine.submit(i, chat_prompt(tokenizer, question), None if name == "tiny" else name,
                      SamplingParams(max_tokens, ignore_eos=True), lambda event, i=i: got[i].append(event.token))
    engine.run_until_idle()
    return [[t for t in got[i] if t is not None] for i in range(len(jobs))]
