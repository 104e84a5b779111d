"""`jaxlora-train` with a `fusion:` section: V-LoRA's accuracy-aware knowledge fusion with real
training and evaluation behind `train.fusion`'s packing.

A candidate adapter for some tasks is one job trained with `Trainer` from scratch on the union of
the tasks' datasets, for the sum of their samples (each task brings its `steps` x
`global_batch_size`, or its epochs over its dataset), with the settings (LoRA, optimizer, batch
size, seed) of its first task. Retraining on every task's data (rather than the paper's
sequential training with a rollback) cannot forget an earlier task by construction; the check
that every task still meets its requirement stays. Accuracy: greedy answers to each task's
`eval_dataset` prompts, exact match of the first line (`train.demo_tasks.is_correct`).

Writes `output_dir/adapter_<i>/` (PEFT) for the packing's adapters, `output_dir/fusion_report.json`,
and every candidate's training run under `output_dir/fusion/candidate_<k>/`."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time

import jax
import jax.numpy as jnp

from jaxlora.generate import SamplingParams, generate
from jaxlora.lora.peft_io import save_peft_adapter
from jaxlora.lora.pool import AdapterPool
from train.config import ConfigError, JobConfig, TrainConfig
from train.data import read_jsonl
from train.demo_tasks import is_correct, write_jsonl
from train.fusion import Fit, FusionTask, adapter_names, fusion_order, pack, packing_report

REPORT_FILE = "fusion_report.json"


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """A task's held-out examples: prompts [n] (token ids) and their expected completions [n]."""

    prompts: list[list[int]]
    answers: list[str]
    answer_tokens: int  # the longest answer's token count


@dataclasses.dataclass(frozen=True)
class TaskData:
    """A task's records as read: training (any `train.data` format) and evaluation (prompt/completion)."""

    train: list[dict]
    eval: list[dict]


def read_task_data(config: TrainConfig) -> dict[str, TaskData]:
    """Every job's datasets, read and checked before any model is loaded (ConfigError naming file:line)."""
    out = {}
    for job in config.jobs:
        evaluation = []
        for number, record in read_jsonl(job.eval_dataset):
            if "prompt" not in record or "completion" not in record:
                raise ConfigError(f"{job.eval_dataset}:{number}: an evaluation record needs 'prompt' and 'completion'")
            evaluation.append(record)
        out[job.name] = TaskData([record for _, record in read_jsonl(job.dataset)], evaluation)
    return out


def eval_set(records: list[dict], tokenizer) -> EvalSet:
    """Tokenized prompts and the expected completions of prompt/completion records."""
    prompts, answers, longest = [], [], 0
    for record in records:
        prompts.append(tokenizer.encode(record["prompt"]))
        answers.append(record["completion"])
        longest = max(longest, len(tokenizer.encode(record["completion"], add_bos=False)))
    return EvalSet(prompts, answers, longest)


def task_samples(job: JobConfig, num_records: int) -> int:
    """How many samples the job trains on alone: steps x batch, or its epochs' whole batches."""
    if job.steps is not None:
        return job.steps * job.global_batch_size
    return job.epochs * num_records // job.global_batch_size * job.global_batch_size


class TrainerBackend:
    """`train.fusion.FusionBackend` over `Trainer` (one fresh job per fit) and greedy generation."""

    def __init__(self, config: TrainConfig, model, tokenizer, data: dict[str, TaskData]):
        """data: `read_task_data(config)`."""
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.jobs = {job.name: job for job in config.jobs}
        self.records = {name: task.train for name, task in data.items()}
        self.eval_sets = {name: eval_set(task.eval, tokenizer) for name, task in data.items()}
        self.trainings = 0

    def fit(self, tasks: tuple[FusionTask, ...]) -> Fit:
        from train.trainer import Trainer

        self.trainings += 1
        directory = os.path.join(self.config.output_dir, "fusion", f"candidate_{self.trainings}")
        job = self._candidate_job([task.name for task in tasks], directory)
        config = dataclasses.replace(self.config, jobs=(job,), output_dir=directory, fusion=None, progress=False)
        trainer = Trainer(config, self.model, self.tokenizer)
        trainer.run()
        adapter = trainer.adapters()[0]
        return Fit(self.evaluate(adapter, [task.name for task in tasks]), adapter)

    def _candidate_job(self, names: list[str], directory: str) -> JobConfig:
        """One job over the union of the tasks' datasets (written to `directory/data.jsonl`)."""
        first = self.jobs[names[0]]
        path = os.path.join(directory, "data.jsonl")
        write_jsonl(path, [record for name in names for record in self.records[name]])
        samples = sum(task_samples(self.jobs[name], len(self.records[name])) for name in names)
        steps = max(1, samples // first.global_batch_size)
        return dataclasses.replace(first, name=os.path.basename(directory), dataset=path, steps=steps, epochs=None)

    def evaluate(self, adapter, names: list[str]) -> dict[str, float]:
        """Each task's accuracy with `adapter`: all tasks' prompts in one greedy batch."""
        sets = [self.eval_sets[name] for name in names]
        tokens = self.config.fusion.max_new_tokens or max(s.answer_tokens for s in sets) + 2
        pool = AdapterPool(self.model.config, num_slots=1, max_rank=adapter.max_rank, dtype=self.model.dtype)
        slot = pool.load(adapter)
        prompts = [prompt for s in sets for prompt in s.prompts]
        outputs = iter(generate(self.model, prompts, SamplingParams(max_new_tokens=tokens), self.tokenizer.eos_token_ids,
                                pool_arrays=pool.arrays, row_slots=[slot] * len(prompts)))
        return {name: sum(is_correct(self.tokenizer.decode(next(outputs)), answer) for answer in s.answers)
                / len(s.answers) for name, s in zip(names, sets)}


def run_fusion(config: TrainConfig, model=None, tokenizer=None, on_trial=None) -> dict:
    """Packs the config's jobs into adapters, writes them and the report; returns the report.
    on_trial: called with each `train.fusion.Trial` as it ends (progress)."""
    if config.fusion is None:
        raise ConfigError("knowledge fusion needs a 'fusion:' section in the job file")
    if jax.process_count() > 1:
        raise ConfigError("knowledge fusion runs in one process (drop --distributed)")
    started = time.perf_counter()
    data = read_task_data(config)  # a bad file stops the run before the model loads
    if model is None:
        from train.base_model import load_base_model

        model, tokenizer = load_base_model(config.base_model, jnp.dtype(config.dtype), config.seed,
                                           config.tokenizer)
    backend = TrainerBackend(config, model, tokenizer, data)
    tasks = fusion_order([FusionTask(job.name, float(job.min_accuracy)) for job in config.jobs],
                         config.fusion.order, config.fusion.seed)
    packing = pack(tasks, backend, config.fusion.policy, on_trial)
    for name, adapter in zip(adapter_names(packing), packing.adapters):
        save_peft_adapter(adapter.fit.adapter, os.path.join(config.output_dir, name),
                          base_model_name=str(config.base_model))
    device = jax.devices()[0]
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": "CPU" if device.platform == "cpu" else device.device_kind, "jax": jax.__version__,
              "base_model": str(config.base_model), "policy": config.fusion.policy, "order": [t.name for t in tasks],
              **packing_report(packing), "wall_s": round(time.perf_counter() - started, 1)}
    with open(os.path.join(config.output_dir, REPORT_FILE), "w") as f:
        json.dump(report, f, indent=1)
    return report
