"""A classification adapter trained on the generated topic task (`train.demo_tasks`) on SmolLM2:
the job file, its data, and held-out records no training text repeats (half of them in sentences
the training data never uses)."""

from __future__ import annotations

import os

from train.config import load_train_config
from train.demo_tasks import LABELLED_TASKS, make_labelled_examples, write_jsonl

JOB = """\
output_dir: out
capacity: 256
progress: false
jobs:
  - name: topic
    dataset: topic.jsonl
    head: {{labels: {labels}}}
    lora: {{r: 8, alpha: 16, targets: [q_proj, v_proj]}}
    learning_rate: 2.0e-3
    global_batch_size: 16
    steps: {steps}
"""


def write_topic_job(directory: str, train_count: int = 256, steps: int = 16, held_out: int = 100):
    """(job file path, held-out records) of the topic task in `directory`: `held_out` texts of the
    training sentences with word combinations not trained on, then `held_out` texts in sentences
    never seen in training (`topic_new_sentences`)."""
    train = make_labelled_examples("topic", train_count, seed=1)
    held = make_labelled_examples("topic", held_out, seed=2, exclude=[r["text"] for r in train])
    held += make_labelled_examples("topic_new_sentences", held_out, seed=2)
    write_jsonl(os.path.join(directory, "topic.jsonl"), train)
    path = os.path.join(directory, "jobs.yaml")
    with open(path, "w") as f:
        f.write(JOB.format(labels=list(LABELLED_TASKS["topic"][0]), steps=steps))
    return path, held


def train_topic_adapter(directory: str, model, tokenizer):
    """Trains the topic job on `model` (`train.heads`, as jaxlora-train does); returns (the adapter
    folder, the held-out records, the per-step losses)."""
    from train.heads import train_head_jobs

    path, held = write_topic_job(directory)
    config = load_train_config(path)
    losses = train_head_jobs(config, config.jobs, model, tokenizer)["topic"]
    return os.path.join(config.output_dir, "topic"), held, losses
