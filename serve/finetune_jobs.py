"""Fine-tuning jobs inside the server: the job table (persisted as JSON in the data directory) and
the runner that trains them on the engine's own weights, in the steps serving leaves idle.

`JobTable` holds OpenAI's `fine_tuning.job` objects and each job's events, written whole to
`jobs.json` and `jobs/<id>/events.json` at every change (temporary file, renamed), so a restarted
server finds every job as it was. `JobRunner` is the engine's `TrainingSource`: it takes the
oldest queued (or interrupted) job, builds its `train.trainer.Trainer` on a background thread
(tokenizing the file, the schedule, the compile of the grad step), and then hands the engine
one microbatch at a time, which the engine runs when its co-scheduling policy
(`jaxlora.scheduler.core`) picks training. The trainer checkpoints with Orbax every
`checkpoint_every` microbatches; a job interrupted by a restart resumes from its last checkpoint
(same schedule, `schedule.json`), to the same adapter. A finished job's adapter (PEFT) is moved
into the engine's adapter directory under its `fine_tuned_model` name, where the engine serves it
from the next request on."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time

import yaml

from jaxlora.scheduler.core import TRAIN, WorkItem
from serve.files import read_json_table, write_json_atomic
from train.config import JobConfig, TrainConfig

log = logging.getLogger("jaxlora.serve")

ACTIVE = ("validating_files", "queued", "running")
RUNNABLE = ("queued", "running")  # the runner takes these (running: interrupted by a restart)
FINAL = ("succeeded", "failed", "cancelled")
MAX_EVENTS = 1000  # per job (the oldest metrics events are dropped first)


class JobTable:
    """Jobs and their events, persisted in `data_dir` (thread-safe)."""

    def __init__(self, data_dir: str):
        self.data_dir = data_dir
        self.path = os.path.join(data_dir, "jobs.json")
        self._lock = threading.Lock()
        self._jobs: dict[str, dict] = read_json_table(self.path)
        self._events: dict[str, list] = {job_id: self._read_events(job_id) for job_id in self._jobs}
        self._runnable = {job_id for job_id, job in self._jobs.items() if job["status"] in RUNNABLE}

    def job_dir(self, job_id: str) -> str:
        return os.path.join(self.data_dir, "jobs", job_id)

    def _read_events(self, job_id: str) -> list:
        return read_json_table(os.path.join(self.job_dir(job_id), "events.json")).get("data", [])

    def add(self, job: dict) -> None:
        with self._lock:
            os.makedirs(self.job_dir(job["id"]), exist_ok=True)
            self._events[job["id"]] = []
            self._jobs = {**self._jobs, job["id"]: job}
            write_json_atomic(self.path, self._jobs)
            if job["status"] in RUNNABLE:
                self._runnable.add(job["id"])

    def get(self, job_id: str) -> dict | None:
        with self._lock:
            job = self._jobs.get(job_id)
            return None if job is None else dict(job)

    def jobs(self) -> list[dict]:
        """Every job, oldest first."""
        with self._lock:
            return sorted((dict(j) for j in self._jobs.values()), key=lambda j: (j["created_at"], j["id"]))

    def update(self, job_id: str, **fields) -> dict:
        """Sets fields of a job and writes the table; the job as it is now."""
        with self._lock:
            job = {**self._jobs[job_id], **fields}
            self._jobs = {**self._jobs, job_id: job}
            write_json_atomic(self.path, self._jobs)
            if job["status"] not in RUNNABLE:
                self._runnable.discard(job_id)
            return dict(job)

    def next_runnable(self) -> dict | None:
        """The oldest queued or interrupted job, None if there is none (cheap when there is none)."""
        with self._lock:
            if not self._runnable:
                return None
            job_id = min(self._runnable, key=lambda i: (self._jobs[i]["created_at"], i))
            return dict(self._jobs[job_id])

    def cancel(self, job_id: str) -> dict:
        """Marks an active job cancelled (the runner stops it before its next microbatch)."""
        with self._lock:
            job = self._jobs[job_id]
            if job["status"] in ACTIVE:
                job = {**job, "status": "cancelled", "finished_at": int(time.time())}
                self._jobs = {**self._jobs, job_id: job}
                write_json_atomic(self.path, self._jobs)
                self._runnable.discard(job_id)
        self.event(job_id, "Fine-tuning job cancelled")
        return dict(job)

    def status(self, job_id: str) -> str:
        with self._lock:
            return self._jobs[job_id]["status"]

    def event(self, job_id: str, message: str, level: str = "info", data: dict | None = None,
              kind: str = "message") -> None:
        """Appends an event to the job's log (OpenAI's `fine_tuning.job.event`)."""
        with self._lock:
            events = self._events.setdefault(job_id, [])
            number = events[-1]["number"] + 1 if events else 0
            event = {"object": "fine_tuning.job.event", "id": f"ftevent-{job_id}-{number}", "number": number,
                     "created_at": int(time.time()), "level": level, "message": message, "data": data or {},
                     "type": kind}
            events.append(event)
            if len(events) > MAX_EVENTS:
                drop = next((i for i, e in enumerate(events) if e["type"] == "metrics"), 0)
                events.pop(drop)
            os.makedirs(self.job_dir(job_id), exist_ok=True)
            write_json_atomic(os.path.join(self.job_dir(job_id), "events.json"), {"data": events})

    def events(self, job_id: str) -> list[dict]:
        """The job's events, oldest first."""
        with self._lock:
            return [dict(e) for e in self._events.get(job_id, [])]


@dataclasses.dataclass(frozen=True)
class TrainingSettings:
    """How the server trains a job: the microbatch capacity (tokens), checkpoints every so many
    microbatches, the base model as `jaxlora-train` names it (written in each job's jobs.yaml),
    the data type of the served weights."""

    capacity: int = 512
    checkpoint_every: int = 8
    base_model: str = "default"
    dtype: str = "float32"


def train_config(job: dict, dataset: str, output_dir: str, settings: TrainingSettings) -> TrainConfig:
    """The `jaxlora-train` configuration of a job (one adapter): what the server trains, and what
    `jaxlora-train jobs/<id>/jobs.yaml` trains offline to the same adapter."""
    from train.config import lora_config

    hyper, lora = job["hyperparameters"], job["lora"]
    config = JobConfig(job["adapter_name"], dataset, lora_config(lora, "lora"),
                       learning_rate=job["learning_rate"], global_batch_size=hyper["batch_size"],
                       epochs=hyper["n_epochs"], seed=job["seed"])
    return TrainConfig(jobs=(config,), base_model=settings.base_model, output_dir=output_dir, dtype=settings.dtype,
                       capacity=settings.capacity, checkpoint_every=settings.checkpoint_every, scheduler="greedy",
                       seed=job["seed"], progress=False, tensorboard=False)


def write_jobs_yaml(config: TrainConfig, path: str) -> None:
    """`config` as a jaxlora-train job file (written whole: a temporary file renamed)."""
    job = config.jobs[0]
    lora = job.lora
    raw = {"base_model": config.base_model, "output_dir": config.output_dir, "dtype": config.dtype,
           "capacity": config.capacity, "checkpoint_every": config.checkpoint_every, "scheduler": config.scheduler,
           "seed": config.seed, "progress": False, "tensorboard": False,
           "jobs": [{"name": job.name, "dataset": job.dataset, "learning_rate": job.learning_rate,
                     "global_batch_size": job.global_batch_size, "epochs": job.epochs, "seed": job.seed,
                     "lora": {"r": lora.r, "alpha": lora.lora_alpha, "dropout": lora.lora_dropout,
                              "targets": list(lora.target_modules), "use_rslora": lora.use_rslora}}]}
    temporary = f"{path}.tmp"
    with open(temporary, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    os.replace(temporary, path)


class _Active:
    """The job being trained: its trainer once built (on the preparing thread), or its error."""

    def __init__(self, job_id: str):
        self.job_id = job_id
        self.trainer = None
        self.error: str | None = None
        self.ready = threading.Event()
        self.steps_logged = 0


class JobRunner:
    """The engine's `TrainingSource`: one job at a time, oldest first (see the module doc)."""

    def __init__(self, table: JobTable, files, engine, tokenizer, settings: TrainingSettings):
        self.table, self.files, self.engine, self.tokenizer = table, files, engine, tokenizer
        self.settings = settings
        self.active: _Active | None = None

    # ---- TrainingSource (engine thread) ------------------------------------------------------
    def next_item(self) -> WorkItem | None:
        """The active job's next microbatch; a 0-token item to end it (finished, failed or
        cancelled); None while no job is ready."""
        active = self._current()
        if active is None or not active.ready.is_set():
            return None
        ending = WorkItem(TRAIN, active.job_id, 0)
        if active.error is not None or self.table.status(active.job_id) != "running":
            return ending
        try:
            return active.trainer.next_item() or ending
        except Exception as err:  # the scheduler failed
            active.error = f"{type(err).__name__}: {err}"
            return ending

    def run_next(self) -> None:
        active = self.active
        try:
            if active.error is not None:
                self._fail(active, active.error)
            elif self.table.status(active.job_id) != "running":
                self._drop(active)
            elif active.trainer.next_item() is None:
                self._succeed(active)
            else:
                tokens = active.trainer.next_item().tokens
                active.trainer.train_next()
                self._log_progress(active, tokens)
        except Exception as err:  # a failed job must not stop serving
            log.exception("fine-tuning job %s failed", active.job_id)
            self._fail(active, f"{type(err).__name__}: {err}")

    # ---- picking and preparing a job -----------------------------------------------------------
    def _current(self) -> _Active | None:
        if self.active is None:
            job = self.table.next_runnable()
            if job is not None:
                self.active = _Active(job["id"])
                threading.Thread(target=self._prepare, args=(self.active,), name="jaxlora-finetune-prepare",
                                 daemon=True).start()
        return self.active

    def _prepare(self, active: _Active) -> None:
        """Builds the job's trainer (resuming from its checkpoint if it has one) and compiles it."""
        from train.trainer import Trainer

        job_id = active.job_id
        try:
            job = self.table.get(job_id)
            if job["status"] not in ACTIVE:  # cancelled meanwhile: nothing to build
                active.ready.set()
                return
            run_dir = os.path.join(self.table.job_dir(job_id), "run")
            config = train_config(job, self.files.path(job["training_file"]), run_dir, self.settings)
            write_jobs_yaml(config, os.path.join(self.table.job_dir(job_id), "jobs.yaml"))
            resume = job["status"] == "running"  # interrupted: resume from the latest checkpoint
            trainer = Trainer(config, model=self.engine.model_view(), tokenizer=self.tokenizer)
            trainer.start(resume=resume)
            active.trainer = trainer  # (not used before `ready`; closed by `_fail` if what follows fails)
            trainer.wait_for_schedule()
            trainer.warmup()
            active.steps_logged = len(trainer.losses().get(config.jobs[0].name, []))
            total = trainer.jobs[0].total_steps
            if self.table.status(job_id) in ACTIVE:
                self.table.update(job_id, status="running")
                done = trainer.jobs[0].steps_done
                self.table.event(job_id, f"Fine-tuning job resumed at step {done}/{total}" if resume else
                                 f"Fine-tuning job started: {total} steps")
        except Exception as err:
            log.exception("preparing fine-tuning job %s failed", job_id)
            active.error = f"{type(err).__name__}: {err}"
        active.ready.set()

    # ---- progress and endings -------------------------------------------------------------------
    def _log_progress(self, active: _Active, tokens: int) -> None:
        trainer = active.trainer
        name = trainer.config.jobs[0].name
        losses = trainer.losses().get(name, [])
        job = self.table.get(active.job_id)
        self.table.update(active.job_id, trained_tokens=(job.get("trained_tokens") or 0) + tokens)
        total = trainer.jobs[0].total_steps
        for step in range(active.steps_logged, len(losses)):
            self.table.event(active.job_id, f"Step {step + 1}/{total}: training loss={losses[step]:.4f}",
                             data={"step": step + 1, "total_steps": total, "train_loss": losses[step]}, kind="metrics")
        active.steps_logged = len(losses)

    def _succeed(self, active: _Active) -> None:
        trainer = active.trainer
        trainer.finish()
        name = trainer.config.jobs[0].name
        target = publish_adapter(os.path.join(trainer.config.output_dir, name), self.engine.config.adapter_dir, name)
        self.table.update(active.job_id, status="succeeded", fine_tuned_model=name, finished_at=int(time.time()))
        self.table.event(active.job_id, f"New fine-tuned model created: {name}", data={"path": target})
        self.table.event(active.job_id, "The job has successfully completed")
        self.active = None

    def _fail(self, active: _Active, message: str) -> None:
        if active.trainer is not None:
            active.trainer.abandon()
        if self.table.status(active.job_id) in ACTIVE:
            self.table.update(active.job_id, status="failed", finished_at=int(time.time()),
                              error={"code": "training_failed", "message": message, "param": None})
            self.table.event(active.job_id, f"Fine-tuning job failed: {message}", level="error")
        self.active = None

    def _drop(self, active: _Active) -> None:
        """A cancelled job: its trainer (if built) is closed, its checkpoints are kept."""
        if active.trainer is not None:
            active.trainer.abandon()
        self.active = None


def publish_adapter(source: str, adapter_dir: str, name: str) -> str:
    """Copies the PEFT folder `source` to `adapter_dir/name` whole (a hidden temporary folder,
    renamed; the adapter store refuses names starting with '.'); its path."""
    target = os.path.join(adapter_dir, name)
    temporary = os.path.join(adapter_dir, f".{name}.tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    shutil.copytree(source, temporary)
    if os.path.exists(target):
        shutil.rmtree(target)
    os.replace(temporary, target)
    return target
