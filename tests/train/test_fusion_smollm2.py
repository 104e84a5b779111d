"""Knowledge fusion end to end on the embedded SmolLM2-135M (`run_fusion`, what `jaxlora-train`
runs for a job file with `fusion:`; the model loaded once for the session): two generated tasks,
a few steps; the written PEFT adapter answers with the accuracies the report states."""

import json
import os

import numpy as np

from jaxlora.generate import SamplingParams, generate
from jaxlora.lora.peft_io import load_peft_adapter
from jaxlora.lora.pool import AdapterPool
from train.config import load_train_config
from train.demo_tasks import is_correct, make_examples, write_jsonl
from train.fusion import format_table, format_trial
from train.fusion_run import run_fusion

JOBS = """\
base_model: default
output_dir: out
capacity: 128
checkpoint_every: 1000
scheduler: greedy
tensorboard: false
fusion: {{order: given, max_new_tokens: 8}}
jobs:
{jobs}"""
JOB = """\
  - name: {task}
    dataset: {task}.jsonl
    eval_dataset: {task}_eval.jsonl
    min_accuracy: 0.0
    global_batch_size: 4
    steps: 3
    learning_rate: 3.0e-3
    lora: {{r: 4, alpha: 8, targets: [q_proj, v_proj]}}
"""
TASKS = ("last_word", "repeat_twice")


def test_fusion_on_smollm2(tmp_path, smollm2):
    for task in TASKS:
        write_jsonl(str(tmp_path / f"{task}.jsonl"), make_examples(task, 16, seed=0))
        write_jsonl(str(tmp_path / f"{task}_eval.jsonl"), make_examples(task, 6, seed=1))
    (tmp_path / "jobs.yaml").write_text(JOBS.format(jobs="".join(JOB.format(task=t) for t in TASKS)))
    model, tokenizer = smollm2
    progress = []
    returned = run_fusion(load_train_config(str(tmp_path / "jobs.yaml")), model, tokenizer,
                          on_trial=lambda trial: progress.append(format_trial(trial)))
    assert "2 tasks in 1 adapters; every requirement met; 2 adapters trained" in format_table(returned)
    assert len(progress) == 2 and progress[1].startswith("adapter_1 <- repeat_twice: last_word ")
    out = tmp_path / "out"
    report = json.loads((out / "fusion_report.json").read_text())
    assert report == returned
    assert report["device"] == "CPU" and report["order"] == list(TASKS)
    assert [t["tasks"] for t in report["trials"]] == [["last_word"], ["last_word", "repeat_twice"]]
    assert report["adapters"][0]["tasks"] == list(TASKS) and not os.path.exists(out / "adapter_2")
    # The saved adapter, reloaded, gives the reported accuracies (it is the accepted candidate's).
    adapter = load_peft_adapter(str(out / "adapter_1"), model.config)
    pool = AdapterPool(model.config, num_slots=1, max_rank=adapter.max_rank)
    slot = pool.load(adapter)
    for task in TASKS:
        examples = make_examples(task, 6, seed=1)
        prompts = [tokenizer.encode(e["prompt"]) for e in examples]
        outputs = generate(model, prompts, SamplingParams(max_new_tokens=8), tokenizer.eos_token_ids,
                           pool_arrays=pool.arrays, row_slots=[slot] * len(prompts))
        correct = [is_correct(tokenizer.decode(o), e["completion"]) for o, e in zip(outputs, examples)]
        assert np.isclose(np.mean(correct), report["adapters"][0]["accuracy"][task])
