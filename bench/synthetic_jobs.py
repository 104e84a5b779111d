"""Synthetic training data for `jaxlora-train` at scale, with no downloads: per adapter a JSONL
file of {"text": ...} samples of random words whose lengths follow a workload of
`jaxlora.scheduler.training.workloads` (lognormal XSum / CNN-DM / WikiSum fits), and a word-level
tokenizer (one token per word, so a sample's token count is its word count).

    python -m bench.synthetic_jobs bench/jobs/data_8b --adapters 4 --samples 96 --workload het
"""

from __future__ import annotations

import argparse
import json
import os
import re

import numpy as np

from jaxlora.scheduler.training.workloads import WORKLOADS, adapter_datasets, dataset_lengths
from train.demo_tasks import WORDS, write_jsonl

SPECIALS = ("[UNK]", "<s>", "</s>")


def write_word_tokenizer(directory: str, texts: list[str]) -> None:
    """A word-level `tokenizer.json` (every word and punctuation mark of `texts`, plus [UNK], <s>,
    </s>) and a `tokenizer_config.json` naming BOS and EOS, in `directory`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for text in texts for w in re.findall(r"\w+|[^\w\s]", text)})
    vocab = {token: index for index, token in enumerate(SPECIALS + tuple(words))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)


def write_synthetic_jobs(directory: str, adapters: int, samples: int, workload: str, seed: int = 0) -> None:
    """`directory/adapter<i>.jsonl` for each adapter and `directory/tokenizer/`."""
    rng = np.random.default_rng(seed)
    for index, dataset in enumerate(adapter_datasets(workload, adapters)):
        lengths = dataset_lengths(rng, dataset, samples) - 2  # BOS and EOS are added by the tokenizer
        records = [{"text": " ".join(rng.choice(WORDS, size=int(n)))} for n in lengths]
        write_jsonl(os.path.join(directory, f"adapter{index}.jsonl"), records)
    write_word_tokenizer(os.path.join(directory, "tokenizer"), [" ".join(WORDS)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--samples", type=int, default=96, help="samples per adapter")
    parser.add_argument("--workload", choices=WORKLOADS, default="het")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_synthetic_jobs(args.directory, args.adapters, args.samples, args.workload, args.seed)


if __name__ == "__main__":
    main()
