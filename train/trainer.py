"""The multi-adapter training loop: every job's adapter lives in one device pool over one frozen base
model; microbatches from the scheduler mix samples of several jobs; each adapter steps its own
optimizer when its own global batch is complete; Orbax checkpoints make `resume` exact."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxlora.lora.adapter import LoraAdapter, ModuleLora, empty_module
from jaxlora.lora.peft_io import save_peft_adapter
from jaxlora.lora.pool import AdapterPool
from jaxlora.lora.trainable import apply_adapter_update, slot_params, split_pool
from jaxlora.models.config import PROJECTIONS
from jaxlora.parallel.step import make_grad_step
from jaxlora.scheduler.training.data import TrainingData
from jaxlora.scheduler.training.schedule import SchedulerConfig
from jaxlora.weights import load_model
from train.checkpoint import Checkpointer
from train.config import TrainConfig
from train.data import load_job_samples, sample_order
from train.optim import init_lora_a, make_optimizer
from train.schedule_stream import ScheduleStream
from train.step import add_trees, device_batch, pack_microbatch


@dataclasses.dataclass
class JobState:
    """Host-side bookkeeping of one job (slot i of the pool is job i)."""

    samples: list  # TokenizedSample, dataset order
    order: list[int]  # sample indices in training order
    batch_weights: list[float]  # per global batch: 1 / its number of target tokens
    total_steps: int
    rank: int
    optimizer: object
    steps_done: int = 0
    tokens_since_log: int = 0


class Trainer:
    """Trains all jobs of a `TrainConfig` together; `run()` returns each job's per-step losses."""

    def __init__(self, config: TrainConfig, model=None, tokenizer=None):
        self.config = config
        dtype = jnp.dtype(config.dtype)
        if model is None:
            model, tokenizer = load_model(config.base_model, dtype=dtype)
        self.model, self.tokenizer = model, tokenizer
        self.jobs = [self._job_state(job) for job in config.jobs]
        modules = [m for m in PROJECTIONS if any(m in job.lora.target_modules for job in config.jobs)]
        self.pool = AdapterPool(model.config, len(self.jobs), max(j.rank for j in self.jobs), modules, dtype)
        self.trainable, self.frozen = self._initial_pool()
        self.grads_acc = jax.tree.map(jnp.zeros_like, self.trainable)
        self.loss_acc = jnp.zeros(len(self.jobs), jnp.float32)
        self.opt_states = [job.optimizer.init(slot_params(self.trainable, i, job.rank))
                           for i, job in enumerate(self.jobs)]
        self.grad_step = make_grad_step(model, len(self.jobs), config.lora_backend,
                                         unroll_layers=config.unroll_layers)
        self.dropout_rate = jnp.asarray([job.lora.lora_dropout for job in config.jobs], jnp.float32)
        os.makedirs(config.output_dir, exist_ok=True)
        self.checkpointer = Checkpointer(os.path.join(config.output_dir, "checkpoints"))

    def _job_state(self, job) -> JobState:
        samples = load_job_samples(job, self.tokenizer, self.config.sample_limit, self.config.overlong)
        order = sample_order(len(samples), job)
        size = job.global_batch_size
        targets = [int(samples[i].loss_mask[1:].sum()) for i in order]
        weights = [1.0 / sum(targets[b * size:(b + 1) * size]) for b in range(len(order) // size)]
        total = len(order) // size
        return JobState(samples, order, weights, total, job.lora.max_rank(self.model.config.num_layers),
                        make_optimizer(job, total))

    def _initial_pool(self):
        for index, job in enumerate(self.config.jobs):
            modules = {m: empty_module(self.model.config, job.lora, m) for m in job.lora.target_modules}
            self.pool.load(LoraAdapter(job.name, job.lora, modules), slot=index)
        trainable, frozen = split_pool(self.pool.arrays)
        for index, job in enumerate(self.config.jobs):
            ranks = {m: np.asarray(frozen[m]["rank"][:, index]) for m in trainable}
            trainable = init_lora_a(trainable, index, ranks, seed=job.seed)
        return trainable, frozen

    def _schedule(self) -> ScheduleStream:
        lengths = {i: tuple(len(job.samples[s].tokens) for s in job.order) for i, job in enumerate(self.jobs)}
        sizes = {i: job.global_batch_size for i, job in enumerate(self.config.jobs)}
        data = TrainingData.from_lengths(lengths, sizes)
        config = SchedulerConfig(capacity=self.config.capacity, num_stages=self.config.pipeline_stages,
                                 padding_multiple=1, time_limit_s=self.config.solver_time_limit,
                                 use_milp=self.config.scheduler == "milp")
        return ScheduleStream(data, config, os.path.join(self.config.output_dir, "schedule.json"))

    def run(self, resume: bool = False) -> dict[str, list[float]]:
        start = self._restore() if resume else 0
        if not resume:
            self.checkpointer.clear()
            _remove(os.path.join(self.config.output_dir, "schedule.json"))
        metrics = MetricsLog(self.config, start)
        stream = self._schedule()
        bars = self._progress_bars()
        completions = _Completions(self.config)
        index = -1
        for index, microbatch in enumerate(stream):
            completed = completions.completed(microbatch)
            if index < start:
                continue  # already trained before the checkpoint we resumed from
            self._train_microbatch(index, microbatch)
            for slot, _ in completed:
                self._step_adapter(slot, index, metrics, bars)
            if (index + 1) % self.config.checkpoint_every == 0 and stream.saved.is_set():
                self._save(index + 1)
        if index + 1 > start and stream.saved.is_set():
            self._save(index + 1)
        for bar in bars:
            bar.close()
        self.export()
        return metrics.losses()

    def _train_microbatch(self, index: int, microbatch) -> None:
        entries = []
        for sample in microbatch:
            job = self.jobs[sample.adapter_id]
            batch = sample.sample_index // self.config.jobs[sample.adapter_id].global_batch_size
            entries.append((sample.adapter_id, job.samples[job.order[sample.sample_index]],
                            job.batch_weights[batch]))
        if not entries:
            return  # a no-op microbatch (pipeline bubble filler)
        arrays = pack_microbatch(entries, self.config.capacity, len(self.jobs))
        batch, plan = device_batch(arrays, len(self.jobs))
        key = jax.random.fold_in(jax.random.key(self.config.seed), index)
        per_slot, grads = self.grad_step(self.trainable, self.frozen, batch, plan, self.dropout_rate, key)
        self.grads_acc = add_trees(self.grads_acc, grads)
        self.loss_acc = self.loss_acc + per_slot
        for slot, count in enumerate(arrays.adapter_tokens):
            self.jobs[slot].tokens_since_log += int(count)

    def _step_adapter(self, slot: int, index: int, metrics, bars) -> None:
        job = self.jobs[slot]
        self.trainable, self.grads_acc, self.opt_states[slot] = apply_adapter_update(
            job.optimizer, self.trainable, self.grads_acc, slot, job.rank, self.opt_states[slot])
        loss = float(self.loss_acc[slot])
        self.loss_acc = self.loss_acc.at[slot].set(0.0)
        job.steps_done += 1
        metrics.log(slot, job.steps_done, index, loss, job.tokens_since_log)
        job.tokens_since_log = 0
        if bars:
            bars[slot].update(1)
            bars[slot].set_postfix(loss=f"{loss:.3f}", tok_s=f"{metrics.tokens_per_second(slot):.0f}")

    def _progress_bars(self) -> list:
        if not self.config.progress:
            return []
        return [tqdm(total=job.total_steps, initial=job.steps_done, desc=cfg.name, position=i, leave=True)
                for i, (job, cfg) in enumerate(zip(self.jobs, self.config.jobs))]

    def _state(self, microbatch: int) -> dict:
        return {"microbatch": np.asarray(microbatch, np.int64), "trainable": self.trainable, "grads_acc": self.grads_acc,
                "loss_acc": self.loss_acc, "opt_states": list(self.opt_states),
                "steps_done": np.asarray([job.steps_done for job in self.jobs], np.int64)}

    def _save(self, microbatch: int) -> None:
        self.checkpointer.save(microbatch, self._state(microbatch))

    def _restore(self) -> int:
        state = self.checkpointer.restore_latest(self._state(0))
        if state is None:
            return 0
        self.trainable, self.grads_acc = state["trainable"], state["grads_acc"]
        self.loss_acc, self.opt_states = state["loss_acc"], list(state["opt_states"])
        for job, done in zip(self.jobs, np.asarray(state["steps_done"])):
            job.steps_done = int(done)
        return int(state["microbatch"])

    def adapters(self) -> list[LoraAdapter]:
        """Each job's trained adapter (float32, host memory)."""
        out = []
        for slot, job in enumerate(self.config.jobs):
            modules = {}
            for module in job.lora.target_modules:
                template = empty_module(self.model.config, job.lora, module)
                width = template.a.shape[2]
                a = np.asarray(self.trainable[module]["a"][:, slot, :, :width], np.float32)
                b = np.asarray(self.trainable[module]["b"][:, slot, :width, :], np.float32)
                modules[module] = ModuleLora(a, b, template.rank, template.scale)
            out.append(LoraAdapter(job.name, job.lora, modules))
        return out

    def export(self) -> None:
        """Writes each job's adapter in PEFT format to `output_dir/<job name>/`."""
        for adapter in self.adapters():
            save_peft_adapter(adapter, os.path.join(self.config.output_dir, adapter.name),
                              base_model_name=str(self.config.base_model))


class _Completions:
    """Knows after which microbatch each adapter's global batch is complete, from sample counts."""

    def __init__(self, config: TrainConfig):
        self.sizes = [job.global_batch_size for job in config.jobs]
        self.seen = [0] * len(config.jobs)

    def completed(self, microbatch):
        done = []
        for sample in microbatch:
            self.seen[sample.adapter_id] += 1
            if self.seen[sample.adapter_id] % self.sizes[sample.adapter_id] == 0:
                done.append((sample.adapter_id, self.seen[sample.adapter_id] // self.sizes[sample.adapter_id] - 1))
        return done


class MetricsLog:
    """Per job `metrics.jsonl` (step, microbatch, loss, tokens); truncated to `start` on resume."""

    def __init__(self, config: TrainConfig, start: int):
        self.paths = []
        self.records: list[list[dict]] = []
        self.started = time.time()
        self.tokens = [0] * len(config.jobs)
        for job in config.jobs:
            path = os.path.join(config.output_dir, job.name, "metrics.jsonl")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            kept = [r for r in _read_metrics(path) if r["microbatch"] < start] if start else []
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
            self.paths.append(path)
            self.records.append(kept)

    def log(self, slot: int, step: int, microbatch: int, loss: float, tokens: int) -> None:
        self.tokens[slot] += tokens
        record = {"step": step, "microbatch": microbatch, "loss": loss, "tokens": tokens,
                  "elapsed_s": round(time.time() - self.started, 3)}
        self.records[slot].append(record)
        with open(self.paths[slot], "a") as f:
            f.write(json.dumps(record) + "\n")

    def tokens_per_second(self, slot: int) -> float:
        return self.tokens[slot] / max(time.time() - self.started, 1e-9)

    def losses(self) -> dict[str, list[float]]:
        names = [os.path.basename(os.path.dirname(p)) for p in self.paths]
        return {name: [r["loss"] for r in records] for name, records in zip(names, self.records)}


def _read_metrics(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _remove(path: str) -> None:
    if os.path.exists(path):
        os.remove(path)
