"""A tiny training set-up that needs no model files: the `preset:tiny` random Llama (4 layers,
vocabulary 512), a word-level tokenizer over the demo tasks' words, three small datasets and a
3-adapter job file (float32, no LoRA dropout)."""

from __future__ import annotations

import os

from bench.synthetic_jobs import write_word_tokenizer
from train.demo_tasks import make_examples, write_jsonl

TASKS = {"last_word": 12, "repeat_twice": 10, "count_words": 14}

JOBS = """\
base_model: preset:tiny
tokenizer: tokenizer
output_dir: {out}
capacity: 48
checkpoint_every: 4
scheduler: greedy
progress: false
jobs:
  - name: last_word
    dataset: last_word.jsonl
    lora: {{r: 4, alpha: 8, targets: [q_proj, v_proj]}}
    learning_rate: 3.0e-3
    global_batch_size: 3
    steps: 3
    seed: 1
  - name: repeat_twice
    dataset: repeat_twice.jsonl
    lora: {{r: 8, alpha: 8, targets: [q_proj, k_proj, down_proj], use_rslora: true}}
    learning_rate: 1.0e-3
    schedule: cosine
    global_batch_size: 2
    steps: 4
    seed: 2
  - name: count_words
    dataset: count_words.jsonl
    lora: {{r: 4, alpha: 16, targets: [v_proj, o_proj, gate_proj, up_proj]}}
    learning_rate: 2.0e-3
    schedule: linear
    warmup_steps: 1
    global_batch_size: 4
    steps: 3
    seed: 3
"""


def write_tiny_jobs(directory: str, out: str = "out") -> str:
    """Datasets, tokenizer and `jobs.yaml` in `directory`; returns the job file's path."""
    texts = []
    for task, count in TASKS.items():
        records = make_examples(task, count, seed=1)
        write_jsonl(os.path.join(directory, f"{task}.jsonl"), records)
        texts += [r["prompt"] + r["completion"] for r in records]
    write_word_tokenizer(os.path.join(directory, "tokenizer"), texts)
    path = os.path.join(directory, "jobs.yaml")
    with open(path, "w") as f:
        f.write(JOBS.format(out=out))
    return path
