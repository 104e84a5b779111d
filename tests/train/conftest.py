"""Fixtures for training tests: a tiny random Llama with SmolLM2's tokenizer, and small datasets."""

import json
import os

import pytest

from train.demo_tasks import make_examples, write_jsonl


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2):
    """A 2-layer random Llama (SmolLM2's vocabulary) saved as a HF directory with tokenizer.json."""
    from tests.jaxlora.hf_checkpoints import save_random_model, tiny_llama_config

    _, tokenizer = smollm2
    directory = str(tmp_path_factory.mktemp("tiny_model"))
    config = tiny_llama_config(vocab_size=tokenizer.vocab_size, num_hidden_layers=2, hidden_size=64,
                               intermediate_size=128, eos_token_id=list(tokenizer.eos_token_ids),
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    save_random_model(config, directory)
    tokenizer.backend.save(os.path.join(directory, "tokenizer.json"))
    eos = tokenizer.token_text(tokenizer.eos_token_ids[0])
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": eos, "chat_template": tokenizer.chat_template}, f)
    return directory


@pytest.fixture
def datasets(tmp_path):
    paths = {}
    for task, count in (("last_word", 24), ("repeat_twice", 20), ("count_words", 28)):
        paths[task] = str(tmp_path / f"{task}.jsonl")
        write_jsonl(paths[task], make_examples(task, count, seed=1))
    return paths
