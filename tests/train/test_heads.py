"""Classification jobs (train/heads.py): config and data errors name file and line; packed texts
give each text's own features; `jaxlora-train` trains a head job beside an LM job and writes the
head beside the PEFT files; on SmolLM2 the generated topic task reaches >= 95% held-out accuracy."""

import json
import os
import re
import types

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bench.synthetic_jobs import write_word_tokenizer
from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.head import TaskHead, load_head
from jaxlora.lora.peft_io import load_peft_adapter
from jaxlora.models import presets
from jaxlora.models.llama import Llama
from train.base_model import PRESETS
from train.cli import main as train_main
from train.config import ConfigError, load_train_config
from train.demo_tasks import LABELLED_TASKS, make_examples, make_labelled_examples, write_jsonl
from train.heads import adapter_pool, classify, encode_text, head_forward, load_labelled_samples, pack_texts

LABELS = list(LABELLED_TASKS["topic"][0])
HEAD_JOB = """\
output_dir: out
capacity: 64
jobs:
  - name: topic
    dataset: topic.jsonl
    head: {head}
    steps: 2
"""


def _job_file(tmp_path, head) -> str:
    path = tmp_path / "jobs.yaml"
    path.write_text(HEAD_JOB.format(head=head))
    return str(path)


@pytest.mark.parametrize("head, expected", [
    ("{labels: [only]}", r"jobs\.yaml:6: head: labels must be a list of 2"),
    ("{labels: [a, a]}", r"jobs\.yaml:6: head: labels must be distinct"),
    ("{labels: [a, '']}", r"jobs\.yaml:6: head: each label must be a non-empty string"),
    ("[a, b]", r"jobs\.yaml:6: 'head' must be a mapping with one key"),
    ("{labels: [a, b], pooling: mean}", r"jobs\.yaml:6: 'head' must be a mapping with one key"),
])
def test_bad_head_config_names_the_line(tmp_path, head, expected):
    with pytest.raises(ConfigError, match=expected):
        load_train_config(_job_file(tmp_path, head))


@pytest.mark.parametrize("record, expected", [
    ({"text": "a tiger", "label": "plant"}, r"topic\.jsonl:2: label 'plant' is not one of"),
    ({"text": "a tiger"}, r"topic\.jsonl:2: a head job's records are"),
    ({"prompt": "a", "completion": "b"}, r"topic\.jsonl:2: a head job's records are"),
])
def test_bad_labelled_record_names_the_line(tmp_path, smollm2, record, expected):
    write_jsonl(str(tmp_path / "topic.jsonl"), [{"text": "a piano", "label": "music"}, record])
    config = load_train_config(_job_file(tmp_path, "{labels: %s}" % LABELS))
    with pytest.raises(ConfigError, match=expected):
        load_labelled_samples(config.jobs[0], smollm2[1], 64, "refuse")


def test_packed_texts_give_each_text_its_own_logits():
    config = presets.TINY
    model = Llama(config, rngs=nnx.Rngs(3))
    adapter = random_adapter("a", config, LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj",
                                                                                         "down_proj")), b_std=0.2)
    pool = adapter_pool(model, adapter)
    rng = np.random.default_rng(0)
    texts = [types.SimpleNamespace(tokens=rng.integers(0, config.vocab_size, n).astype(np.int32))
             for n in (5, 9, 3, 12, 7)]
    head = {"weight": jnp.asarray(rng.normal(size=(3, config.hidden_size)), jnp.float32),
            "bias": jnp.asarray(rng.normal(size=3), jnp.float32)}
    batch, plan, rows, ends = pack_texts(texts, 16)
    assert batch["tokens"].shape[0] == 4  # 36 tokens first-fit in rows of 16: 3 rows, padded to 4
    packed = np.asarray(head_forward(model, pool, head, batch, plan, rows, ends, "gather"))
    for index, text in enumerate(texts):
        alone = np.asarray(head_forward(model, pool, head, *pack_texts([text], len(text.tokens)), "gather"))[0]
        assert np.linalg.norm(packed[index] - alone) <= 1e-5 * np.linalg.norm(alone)
    assert np.isfinite(packed).all() and np.abs(packed).max() > 0.1


def test_jaxlora_train_runs_a_head_job_beside_an_lm_job(tmp_path, capsys):
    records = make_labelled_examples("topic", 24, seed=1)
    write_jsonl(str(tmp_path / "topic.jsonl"), records)
    lm = make_examples("last_word", 8, seed=1)
    write_jsonl(str(tmp_path / "last_word.jsonl"), lm)
    write_word_tokenizer(str(tmp_path / "tokenizer"), [r["text"] for r in records] + [r["prompt"] + r["completion"]
                                                                                      for r in lm])
    (tmp_path / "jobs.yaml").write_text(f"""\
base_model: preset:tiny
tokenizer: tokenizer
output_dir: out
capacity: 64
progress: false
scheduler: greedy
jobs:
  - name: last_word
    dataset: last_word.jsonl
    lora: {{r: 4, alpha: 8, targets: [q_proj, v_proj]}}
    global_batch_size: 2
    steps: 2
  - name: topic
    dataset: topic.jsonl
    head: {{labels: {LABELS}}}
    lora: {{r: 4, alpha: 8, targets: [q_proj, v_proj], dropout: 0.1}}
    learning_rate: 1.0e-2
    global_batch_size: 8
    steps: 3
""")
    assert train_main([str(tmp_path / "jobs.yaml")]) == 0
    assert re.search(r"topic: 3 steps, final loss \d", capsys.readouterr().out)
    out = tmp_path / "out"
    steps = [json.loads(line) for line in (out / "topic" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3] and abs(steps[0]["loss"] - np.log(len(LABELS))) < 1e-4
    config = PRESETS["tiny"]
    head = load_head(str(out / "topic"), config.hidden_size)
    assert head.labels == tuple(LABELS) and np.abs(head.weight).max() > 0
    assert load_peft_adapter(str(out / "topic"), config).modules.keys() == {"q_proj", "v_proj"}
    assert load_head(str(out / "last_word"), config.hidden_size) is None
    assert train_main([str(tmp_path / "jobs.yaml"), "--resume"]) == 2
    assert "not checkpointed" in capsys.readouterr().err


def test_topic_head_reaches_95_percent_on_held_out_texts(topic_head_adapter, smollm2):
    path, held, losses = topic_head_adapter
    model, tokenizer = smollm2
    adapter = load_peft_adapter(path, model.config)
    head = load_head(path, model.config.hidden_size)
    samples = [types.SimpleNamespace(tokens=encode_text(tokenizer, r["text"], 256)) for r in held]
    probs = classify(model, adapter_pool(model, adapter), head, samples, 256)
    right = np.asarray([head.labels[i] == r["label"] for i, r in zip(probs.argmax(-1), held)])
    half = len(held) // 2  # word combinations not trained on; then sentences not trained on
    print(f"topic head: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.4f}, held-out accuracy "
          f"{right[:half].mean():.3f} (new combinations) and {right[half:].mean():.3f} (new sentences), "
          f"{half} texts each")
    assert right[:half].mean() >= 0.95 and right[half:].mean() >= 0.95
    assert isinstance(head, TaskHead) and os.path.isfile(os.path.join(path, "adapter_config.json"))


def test_knowledge_fusion_refuses_head_jobs(tmp_path, capsys):
    write_jsonl(str(tmp_path / "topic.jsonl"), make_labelled_examples("topic", 8, seed=1))
    write_jsonl(str(tmp_path / "eval.jsonl"), make_examples("last_word", 2, seed=1))
    path = _job_file(tmp_path, "{labels: %s}" % LABELS)
    with open(path, "a") as f:
        f.write("    eval_dataset: eval.jsonl\n    min_accuracy: 0.5\nfusion: {}\n")
    assert train_main([path]) == 2
    assert "jobs ['topic'] have task heads" in capsys.readouterr().err
