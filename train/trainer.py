"""The multi-adapter training loop: every job's adapter lives in one pool over one frozen base
model; microbatches from the scheduler mix samples of several jobs; each adapter steps its own
optimizer when its own global batch is complete; Orbax checkpoints make `resume` exact, on the
same mesh or another.

The job file's `mesh:` decides where steps run (`train.mesh`, `train.executors`): one device,
GSPMD data/tensor parallel (one packed row per data shard and step, `train.groups`), or the MPMD
1F1B pipeline. Every process of a multi-host run executes this same loop; process 0 computes the
schedule (shared with the others) and writes metrics, adapters and the schedule file."""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from jaxlora.lora.adapter import LoraAdapter, empty_module
from jaxlora.lora.peft_io import save_peft_adapter
from jaxlora.lora.pool import AdapterPool
from jaxlora.lora.trainable import apply_adapter_update, slot_adapter, split_pool
from jaxlora.nn.model_config import PROJECTIONS
from jaxlora.models.packed import pack_projections
from jaxlora.scheduler.core import IDLE, TRAIN, TRAINING_ONLY, WorkItem
from jaxlora.scheduler.training.samples import Sample, TrainingData
from jaxlora.scheduler.training.schedule import SchedulerConfig
from jaxlora.vision.adapters import save_vlm_adapter
from train.base_model import base_model_config, load_training_model
from train.checkpoint import Checkpointer
from train.config import ConfigError, TrainConfig
from train.data import load_job_samples, sample_order
from train.executors import PipelineExecutor, SpmdExecutor
from train.flops import peak_tflops, sample_flops
from train.groups import StepGroup, step_groups
from train.mesh import build_meshes, check_mesh
from train.metrics_log import MetricsLog
from train.optim import init_lora_a, learning_rate_schedule, make_optimizer
from train.schedule_stream import ScheduleStream
from train.microbatch import add_trees, device_batch, pack_rows


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

    def __init__(self, config: TrainConfig, model=None, tokenizer=None, devices=None, vision=None):
        """devices: what `config.mesh` spans (default: every device of every process); vision: a
        vision-language model's frozen tower (`train.images.VisionInputs`) beside `model`, its
        language model (loaded with it when `model` is None)."""
        heads = [job.name for job in config.jobs if job.head is not None]
        if heads:
            raise ConfigError(f"jobs {heads} have task heads: train them with train.heads (jaxlora-train does)")
        self.config = config
        self.primary = jax.process_index() == 0
        self.devices = jax.devices() if devices is None else list(devices)
        check_mesh(config, model.config if model is not None else base_model_config(config.base_model),
                   len(self.devices), jax.process_count())
        if model is None:
            model, tokenizer, vision = load_training_model(config.base_model, jnp.dtype(config.dtype), config.seed,
                                                           config.tokenizer)
        if vision is not None and config.mesh.size > 1:
            raise ConfigError(f"base_model {config.base_model!r} is a vision-language model: it trains on one device "
                              "(mesh: data/tensor/pipeline 1)")
        self.vision = vision
        self.model, self.tokenizer = _training_model(config, model), tokenizer
        self.jobs = [self._job_state(job) for job in config.jobs]
        modules = [m for m in PROJECTIONS if any(m in job.lora.target_modules for job in config.jobs)]
        self.pool = AdapterPool(model.config, len(self.jobs), max(j.rank for j in self.jobs), modules,
                                jnp.dtype(config.dtype))
        self.executor = self._executor(*self._initial_pool())
        self.loss_acc = np.zeros(len(self.jobs), np.float32)
        if self.primary:
            os.makedirs(config.output_dir, exist_ok=True)
        self.checkpointer = Checkpointer(os.path.join(config.output_dir, "checkpoints"), self.primary)

    def _executor(self, trainable, frozen):
        optimizers, ranks = [job.optimizer for job in self.jobs], [job.rank for job in self.jobs]
        mesh = self.config.mesh
        if mesh.pipeline > 1:
            meshes = build_meshes(self.config, self.devices)
            return PipelineExecutor(self.config, self.model, trainable, frozen, optimizers, ranks, meshes)
        if mesh.size == 1:
            image_token_id = None if self.vision is None else self.vision.image_token_id
            with jax.default_device(self.devices[0]):
                return SpmdExecutor(self.config, self.model, trainable, frozen, optimizers, ranks,
                                    image_token_id=image_token_id)
        spmd_mesh = build_meshes(self.config, self.devices)[0]
        return SpmdExecutor(self.config, self.model, trainable, frozen, optimizers, ranks, spmd_mesh)

    def _job_state(self, job) -> JobState:
        samples = load_job_samples(job, self.tokenizer, self.config.sample_limit, self.config.overlong, self.vision)
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

    def _schedule(self):
        """The microbatches in order: this process's `ScheduleStream`, or with several processes
        process 0's schedule (computed whole, then sent to all), so every process runs the same."""
        lengths = {i: tuple(len(job.samples[s].tokens) for s in job.order) for i, job in enumerate(self.jobs)}
        sizes = {i: job.global_batch_size for i, job in enumerate(self.config.jobs)}
        data = TrainingData.from_lengths(lengths, sizes)
        config = SchedulerConfig(capacity=self.config.capacity, num_stages=self.config.mesh.pipeline,
                                 padding_multiple=1, time_limit_s=self.config.solver_time_limit,
                                 use_milp=self.config.scheduler == "milp")
        path = os.path.join(self.config.output_dir, "schedule.json")
        if jax.process_count() == 1:
            return ScheduleStream(data, config, path)
        microbatches = list(ScheduleStream(data, config, path)) if self.primary else []
        return _SharedSchedule(_broadcast_schedule(microbatches))

    def run(self, resume: bool = False) -> dict[str, list[float]]:
        """Trains every job to the end (from the latest checkpoint with `resume`), exports the
        adapters, returns each job's per-step losses. Each step is what the scheduler core's
        co-scheduling policy picks with no serving load: the next training microbatch."""
        self.start(resume)
        try:
            while TRAINING_ONLY.next_kind(IDLE, self.next_item()) == TRAIN:
                self.train_next()
        except BaseException:
            self._close()
            raise
        return self.finish()

    def start(self, resume: bool = False) -> None:
        """Prepares a run (restores the latest checkpoint with `resume`); `train_next` then runs it
        one step (window) at a time, `finish` ends it."""
        start = self._restore() if resume else 0
        if not resume:
            self.checkpointer.clear()
            if self.primary:
                _remove(os.path.join(self.config.output_dir, "schedule.json"))
        device_kind = self.devices[0].device_kind
        metrics = MetricsLog(self.config, start, self.config.peak_tflops or peak_tflops(device_kind),
                             len(self.devices), writer=self.primary)
        stream = self._schedule()
        sizes = {i: job.global_batch_size for i, job in enumerate(self.config.jobs)}
        groups = step_groups(stream, self.config.mesh.data, sizes, self.config.checkpoint_every, start)
        self._session = _Session(start, start, metrics, self._progress_bars(), stream, self._windows(groups))

    def next_item(self) -> WorkItem | None:
        """The next step's work (a TRAIN item over its samples' tokens), None when the run is done;
        waits for the scheduler to produce it."""
        session = self._session
        if session.pending is None:
            session.pending = next(session.windows, None)
        if session.pending is None:
            return None
        samples = [sample for group in session.pending for sample in group.samples]
        return WorkItem(TRAIN, tuple(sorted({s.adapter_id for s in samples})), sum(s.num_tokens for s in samples))

    def train_next(self) -> bool:
        """Runs the next step (window) and checkpoints on schedule; False when the run is done."""
        if self.next_item() is None:
            return False
        session = self._session
        window, session.pending = session.pending, None
        self._train_window(window, session.metrics, session.bars)
        session.stop = window[-1].stop
        if session.stop % self.config.checkpoint_every == 0 and session.stream.saved.is_set():
            self._save(session.stop)
        return True

    def wait_for_schedule(self) -> None:
        """Until the scheduler has produced the whole schedule (then `next_item` never waits)."""
        self._session.stream.saved.wait()

    def losses(self) -> dict[str, list[float]]:
        """Each job's per-step losses so far in this run."""
        return self._session.metrics.losses()

    def finish(self) -> dict[str, list[float]]:
        """Saves the final checkpoint, exports each job's adapter (PEFT) and returns the losses."""
        session = self._session
        try:
            if session.stop > session.start and session.stream.saved.is_set():
                self._save(session.stop)
        finally:
            self._close()
        self.export()
        return session.metrics.losses()

    def abandon(self) -> None:
        """Ends a run without exporting (its checkpoints stay)."""
        self._close()

    def warmup(self) -> None:
        """Compiles the programs of a step ahead, so that the first real steps do not wait for a
        compile: the grad step for a microbatch's shapes (compiled, not run: it reads no weight,
        so another thread may replace the weights meanwhile, as the server's engine does), the
        gradient sum and each adapter's optimizer update (run on copies of the trainer's state:
        the originals are donated by the real ones). One device only: a mesh's steps compile as
        they run."""
        executor = self.executor
        if not isinstance(executor, SpmdExecutor) or executor.mesh is not None:
            return
        rows = [[] for _ in range(self.config.mesh.data)]
        batch, plan = device_batch(pack_rows(rows, self.config.capacity, len(self.jobs)), len(self.jobs))
        key = None if executor.dropout_rate is None else jax.random.key(0)
        executor.grad_step.compile_ahead(executor.trainable, executor.frozen, batch, plan, executor.dropout_rate, key)
        grads = jax.tree.map(jnp.zeros_like, executor.grads_acc)
        jax.block_until_ready(add_trees(jax.tree.map(jnp.copy, executor.grads_acc), grads))
        for slot, (optimizer, rank) in enumerate(zip(executor.optimizers, executor.ranks)):
            trainable, grads_acc = jax.tree.map(jnp.copy, (executor.trainable, executor.grads_acc))
            jax.block_until_ready(apply_adapter_update(optimizer, trainable, grads_acc, slot, rank,
                                                       executor.opt_states[slot]))

    def _close(self) -> None:
        for bar in self._session.bars:
            bar.close()
        self._session.metrics.close()

    def _windows(self, groups):
        """Steps handed to the executor at once: one (GSPMD), or up to a checkpoint (pipeline)."""
        window: list[StepGroup] = []
        for group in groups:
            window.append(group)
            if self.config.mesh.pipeline == 1 or group.stop % self.config.checkpoint_every == 0:
                yield window
                window = []
        if window:
            yield window

    def _train_window(self, window: list[StepGroup], metrics: MetricsLog, bars) -> None:
        inputs, tokens, flops = [], 0, 0.0
        for group in window:
            arrays, group_flops = self._group_arrays(group)
            inputs.append(None if arrays is None else self._device_batch(arrays))
            tokens += 0 if arrays is None else int(arrays.adapter_tokens.sum())
            flops += group_flops
        started = time.perf_counter()
        losses = self.executor.run(window, inputs, [job.steps_done for job in self.jobs])
        seconds = time.perf_counter() - started
        for group, loss in zip(window, losses):
            self.loss_acc = self.loss_acc + loss
            for slot in group.completed:
                self._log_adapter_step(slot, group.stop - 1, metrics, bars)
        if tokens:
            metrics.log_step(window[-1].stop - 1, seconds, tokens, flops)

    def _device_batch(self, arrays):
        """(batch, plan) of packed arrays; their images (if any) encoded by the frozen tower into
        batch["image_embeds"] [N' * P, d] (one jitted call, N' a power of two)."""
        batch, plan = device_batch(arrays, len(self.jobs))
        if arrays.pixels is not None:
            with jax.default_device(self.devices[0]):
                rows = self.vision.encoder(arrays.pixels)
            batch["image_embeds"] = rows.reshape(-1, rows.shape[-1])
        return batch, plan

    def _group_arrays(self, group: StepGroup):
        """(packed [width, capacity] arrays or None for a step without samples, model FLOPs)."""
        if not group.rows:
            return None, 0.0
        rows, flops = [], 0.0
        for microbatch in group.rows:
            rows.append([self._entry(sample) for sample in microbatch])
            flops += sum(sample_flops(self.model.config, self.config.jobs[s.adapter_id].lora, s.num_tokens)
                         for s in microbatch)
        rows += [[] for _ in range(self.config.mesh.data - len(rows))]
        arrays = pack_rows(rows, self.config.capacity, len(self.jobs))
        for slot, count in enumerate(arrays.adapter_tokens):
            self.jobs[slot].tokens_since_log += int(count)
        return arrays, flops

    def _entry(self, sample: Sample):
        job = self.jobs[sample.adapter_id]
        batch = sample.sample_index // self.config.jobs[sample.adapter_id].global_batch_size
        return sample.adapter_id, job.samples[job.order[sample.sample_index]], job.batch_weights[batch]

    def _log_adapter_step(self, slot: int, microbatch: int, metrics: MetricsLog, bars) -> None:
        job = self.jobs[slot]
        loss = float(self.loss_acc[slot])
        self.loss_acc[slot] = 0.0
        job.steps_done += 1
        rate = float(learning_rate_schedule(self.config.jobs[slot], job.total_steps)(job.steps_done - 1))
        metrics.log_job(slot, job.steps_done, microbatch, loss, rate, job.tokens_since_log)
        job.tokens_since_log = 0
        if bars:
            bars[slot].update(1)
            bars[slot].set_postfix(loss=f"{loss:.3f}", tok_s=f"{metrics.last_throughput:.0f}")

    def _progress_bars(self) -> list:
        if not self.config.progress or not self.primary:
            return []
        return [tqdm(total=job.total_steps, initial=job.steps_done, desc=cfg.name, position=i, leave=True)
                for i, (job, cfg) in enumerate(zip(self.jobs, self.config.jobs))]

    def _state(self, microbatch: int) -> dict:
        return {"microbatch": np.asarray(microbatch, np.int64), **self.executor.state(),
                "loss_acc": self.loss_acc, "steps_done": np.asarray([job.steps_done for job in self.jobs], np.int64)}

    def _save(self, microbatch: int) -> None:
        self.checkpointer.save(microbatch, self._state(microbatch))

    def _restore(self) -> int:
        state = self.checkpointer.restore_latest(self._state(0))
        if state is None:
            return 0
        self.executor.load(state)
        self.loss_acc = np.asarray(state["loss_acc"], np.float32)
        for job, done in zip(self.jobs, np.asarray(state["steps_done"])):
            job.steps_done = int(done)
        return int(state["microbatch"])

    def adapters(self) -> list[LoraAdapter]:
        """Each job's trained adapter (float32, host memory); with several processes, all take part."""
        trainable = self.executor.host_trainable()
        return [slot_adapter(self.model.config, job.name, job.lora, trainable, slot)
                for slot, job in enumerate(self.config.jobs)]

    def export(self) -> None:
        """Writes each job's adapter in PEFT format to `output_dir/<job name>/` (process 0)."""
        adapters = self.adapters()
        if not self.primary:
            return
        for adapter in adapters:
            path = os.path.join(self.config.output_dir, adapter.name)
            if self.vision is None:
                save_peft_adapter(adapter, path, base_model_name=str(self.config.base_model))
            else:  # PEFT's names on the VLM (what `jaxlora.vision.adapters` and PEFT read)
                save_vlm_adapter(adapter, path, self.vision.config, base_model_name=str(self.config.base_model))


def _training_model(config: TrainConfig, model):
    """The model the steps run: on one device, without LoRA dropout and with an XLA LoRA backend,
    its q/k/v and gate/up kernels packed (`jaxlora.models.packed`; a copy unless they already are):
    4 base GEMMs a layer instead of 7, and the very programs of training inside the server, whose
    one copy of the weights is the packed serving model (`serve.finetune`), so that a job gives
    the same adapter there as here. With dropout or a fused backend each projection runs on its
    own (on a packed model: on its own columns, `jaxlora.lora.project`, with the same results), so
    packing buys nothing there. A model already packed is used as it is (the server's: its
    Variables are the engine's)."""
    if "layers.qkv_proj.kernel" in model.weights:
        return model
    if (config.mesh.size > 1 or config.backend.fused
            or any(job.lora.lora_dropout for job in config.jobs)):
        return model
    return pack_projections(model)


@dataclasses.dataclass
class _Session:
    """A run in progress: its first and next microbatch, metrics, progress bars, schedule, the
    steps (windows) still to run and the one taken from them but not run yet."""

    start: int
    stop: int
    metrics: MetricsLog
    bars: list
    stream: object
    windows: object
    pending: list | None = None


class _SharedSchedule:
    """A whole schedule received from process 0 (iterable like a finished `ScheduleStream`)."""

    def __init__(self, microbatches):
        self.microbatches = microbatches
        self.saved = _Done()

    def __iter__(self):
        return iter(self.microbatches)


class _Done:
    @staticmethod
    def is_set() -> bool:
        return True

    @staticmethod
    def wait(timeout=None) -> bool:
        return True


def _broadcast_schedule(microbatches: list) -> list:
    """Process 0's microbatches on every process: rows (microbatch, adapter, sample, tokens)."""
    rows = np.asarray([(i, s.adapter_id, s.sample_index, s.num_tokens) for i, mb in enumerate(microbatches) for s in mb]
                      + [(len(microbatches), -1, -1, -1)], np.int64)  # the last row carries the count
    count = int(multihost_utils.broadcast_one_to_all(np.asarray(len(rows), np.int64)))
    rows = multihost_utils.broadcast_one_to_all(rows if len(rows) == count else np.zeros((count, 4), np.int64))
    rows = np.asarray(rows)
    out: list[list[Sample]] = [[] for _ in range(int(rows[-1, 0]))]
    for index, adapter, sample, tokens in rows[:-1]:
        out[index].append(Sample(int(adapter), int(sample), int(tokens)))
    return [tuple(mb) for mb in out]


def _remove(path: str) -> None:
    if os.path.exists(path):
        os.remove(path)
