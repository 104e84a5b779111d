"""The OpenAI fine-tuning API of `jaxlora-serve --data-dir DIR`: adapters trained inside the running
server, on its one copy of the base weights, in the steps serving leaves idle.

Routes (same authentication as the rest of the API):
  POST /v1/files (multipart: `file`, `purpose`="fine-tune"), GET /v1/files, GET /v1/files/{id};
  POST /v1/fine_tuning/jobs, GET /v1/fine_tuning/jobs, GET /v1/fine_tuning/jobs/{id},
  GET /v1/fine_tuning/jobs/{id}/events, POST /v1/fine_tuning/jobs/{id}/cancel.

A job (`POST /v1/fine_tuning/jobs`): `model` the served base model's name, `training_file` an
uploaded file's id, `hyperparameters` (or `method: {type: supervised, supervised:
{hyperparameters}}`) with `n_epochs` (1..max_epochs; "auto": 3), `batch_size` (1..the file's
records, at most max_batch_size; "auto": min(8, records)) and `learning_rate_multiplier` (times
`base_learning_rate`; "auto": 1), `seed`, `suffix`, `metadata`; and our extension field `lora`
(with the openai client: `extra_body={"lora": {...}}`): `r` (1..the server's max LoRA rank, so the
adapter is servable), `alpha` (default 2r), `dropout` (default 0), `targets` (PEFT module names
among those the server's adapters may target, `EngineConfig.lora_target_modules`; default
q/k/v/o_proj), `use_rslora`. Any other field, a validation file or integrations are
refused (400).

The job trains as `jaxlora-train DATA/jobs/<id>/jobs.yaml` would (the same `Trainer`, the same
programs, the same adapter: see `serve.finetune_jobs`), and its adapter is served as
`fine_tuned_model` (`ft-<model>[-<suffix>]-<job id>`) from the engine's adapter directory.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import time
import uuid
from typing import Literal

from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt
from starlette.concurrency import run_in_threadpool

from jaxlora.nn.model_config import PROJECTIONS
from jaxlora.scheduler.core import CoSchedulePolicy
from serve.engine import Engine
from serve.files import FileError, FileStore
from serve.finetune_jobs import FINAL, JobRunner, JobTable, TrainingSettings
from serve.protocol import ApiError
from train.config import ConfigError, lora_config

AUTO_EPOCHS, AUTO_BATCH, MAX_LIST = 3, 8, 100
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
SUFFIX = re.compile(r"[A-Za-z0-9_-]{1,40}")


@dataclasses.dataclass(frozen=True)
class FinetuneSettings:
    """Where files, jobs and checkpoints live, the bounds of what a client may ask, and how
    training shares the engine: `train_below` running requests or fewer (and none waiting) let a
    training microbatch run between serving steps (0: only when serving is idle), within
    `tpot_target_s` per output token when given (`jaxlora.scheduler.core.CoSchedulePolicy`)."""

    data_dir: str
    max_file_bytes: int = 16 << 20
    max_epochs: int = 50
    max_batch_size: int = 256
    max_active_jobs: int = 64
    base_learning_rate: float = 1e-3
    train_below: int = 0
    tpot_target_s: float | None = None
    training: TrainingSettings = TrainingSettings()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Hyperparameters(_Strict):
    n_epochs: StrictInt | Literal["auto"] | None = None
    batch_size: StrictInt | Literal["auto"] | None = None
    learning_rate_multiplier: StrictFloat | StrictInt | Literal["auto"] | None = None


class SupervisedMethod(_Strict):
    hyperparameters: Hyperparameters | None = None


class Method(_Strict):
    type: Literal["supervised"]
    supervised: SupervisedMethod | None = None


class LoraRequest(_Strict):
    """Our extension field: the adapter's LoRA settings."""

    r: StrictInt = 8
    alpha: StrictFloat | StrictInt | None = None
    targets: list[str] | None = Field(default=None, max_length=len(PROJECTIONS))
    use_rslora: StrictBool = False
    dropout: StrictFloat | StrictInt = 0


class JobRequest(_Strict):
    model: str = Field(max_length=256)
    training_file: str = Field(max_length=64)
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    suffix: str | None = Field(default=None, max_length=64)
    seed: StrictInt | None = None
    validation_file: str | None = Field(default=None, max_length=64)
    integrations: list | None = Field(default=None, max_length=0)
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    lora: LoraRequest | None = None


def adapter_name(model: str, suffix: str | None, job_id: str) -> str:
    """The fine-tuned model's name: an adapter folder name (`serve.adapter_store.NAME`)."""
    base = re.sub(r"[^A-Za-z0-9._-]", "-", model)[:64]
    return "-".join(["ft", base] + ([suffix] if suffix else []) + [job_id.removeprefix("ftjob-")])


class FinetuneService:
    """Files, jobs and the runner of one server; installs the runner as the engine's training."""

    def __init__(self, settings: FinetuneSettings, engine, tokenizer, model_name: str):
        check_engine(engine)
        self.settings, self.engine, self.model_name = settings, engine, model_name
        self.files = FileStore(settings.data_dir, settings.max_file_bytes)
        self.table = JobTable(settings.data_dir)
        self.runner = JobRunner(self.table, self.files, engine, tokenizer, settings.training)
        engine.co_policy = CoSchedulePolicy(settings.train_below, settings.tpot_target_s)
        engine.training = self.runner

    def create_job(self, body: JobRequest) -> dict:
        """A new queued job (OpenAI's job object); ApiError 400/429 for a request it refuses."""
        file = self._check_request(body)
        hyper = self._hyperparameters(body, file["records"])
        lora = self._lora(body.lora or LoraRequest())
        job_id = f"ftjob-{uuid.uuid4().hex[:24]}"
        seed = secrets.randbelow(2**31) if body.seed is None else body.seed
        job = {"object": "fine_tuning.job", "id": job_id, "model": body.model, "created_at": int(time.time()),
               "finished_at": None, "fine_tuned_model": None, "organization_id": "jaxlora", "result_files": [],
               "status": "queued", "validation_file": None, "training_file": body.training_file,
               "hyperparameters": hyper, "trained_tokens": None, "error": None, "seed": seed,
               "estimated_finish": None, "integrations": [], "metadata": body.metadata,
               "method": {"type": "supervised", "supervised": {"hyperparameters": hyper}},
               "user_provided_suffix": body.suffix, "lora": lora,
               "learning_rate": self.settings.base_learning_rate * hyper["learning_rate_multiplier"],
               "adapter_name": adapter_name(body.model, body.suffix, job_id)}
        self.table.add(job)
        self.table.event(job_id, f"Created fine-tuning job: {job_id}")
        return public_job(job)

    def _check_request(self, body: JobRequest) -> dict:
        """The training file's object once the request's model, file and plain fields are checked."""
        file = self.files.get(body.training_file)
        if body.model != self.model_name:
            raise ApiError(400, f"model {body.model!r}: this server fine-tunes its base model {self.model_name!r} "
                                "only", "model")
        if file is None:
            raise ApiError(400, f"training_file {body.training_file!r}: no such file (upload it with POST /v1/files)",
                           "training_file")
        if body.validation_file is not None:
            raise ApiError(400, "validation_file is not supported by this server (not built)", "validation_file")
        if body.suffix is not None and not SUFFIX.fullmatch(body.suffix):
            raise ApiError(400, "suffix: 1 to 40 letters, digits, '_' or '-'", "suffix")
        if body.seed is not None and not 0 <= body.seed < 2**31:
            raise ApiError(400, f"seed must be in [0, 2^31), got {body.seed}", "seed")
        if any(len(k) > 64 or len(v) > 512 for k, v in (body.metadata or {}).items()):
            raise ApiError(400, "metadata: keys of at most 64 and values of at most 512 characters", "metadata")
        active = sum(1 for job in self.table.jobs() if job["status"] not in FINAL)
        if active >= self.settings.max_active_jobs:
            raise ApiError(429, f"{active} fine-tuning jobs are queued or running; try again later")
        return file

    def _hyperparameters(self, body: JobRequest, records: int) -> dict:
        """n_epochs, batch_size, learning_rate_multiplier with "auto"/missing resolved; ApiError 400."""
        given = body.hyperparameters
        from_method = body.method and body.method.supervised and body.method.supervised.hyperparameters
        if given is not None and from_method is not None:
            raise ApiError(400, "give hyperparameters or method.supervised.hyperparameters, not both", "hyperparameters")
        given = given or from_method or Hyperparameters()
        epochs = AUTO_EPOCHS if given.n_epochs in (None, "auto") else given.n_epochs
        batch = min(AUTO_BATCH, records) if given.batch_size in (None, "auto") else given.batch_size
        rate = 1.0 if given.learning_rate_multiplier in (None, "auto") else float(given.learning_rate_multiplier)
        largest = min(self.settings.max_batch_size, records)
        if not 1 <= epochs <= self.settings.max_epochs:
            raise ApiError(400, f"n_epochs must be in [1, {self.settings.max_epochs}], got {epochs}", "n_epochs")
        if not 1 <= batch <= largest:
            raise ApiError(400, f"batch_size must be in [1, {largest}] (the training file has {records} records; "
                                f"this server's largest batch is {self.settings.max_batch_size}), got {batch}",
                           "batch_size")
        if not 0 < rate <= 100:
            raise ApiError(400, f"learning_rate_multiplier must be in (0, 100], got {rate}", "learning_rate_multiplier")
        return {"n_epochs": epochs, "batch_size": batch, "learning_rate_multiplier": rate}

    def _lora(self, lora: LoraRequest) -> dict:
        """The extension's LoRA settings, complete and checked; ApiError 400."""
        largest = self.engine.config.max_lora_rank
        if not 1 <= lora.r <= largest:
            raise ApiError(400, f"lora.r must be in [1, {largest}] (this server's largest servable rank), "
                                f"got {lora.r}", "lora.r")
        if not 0 <= lora.dropout < 1:
            raise ApiError(400, f"lora.dropout must be in [0, 1), got {lora.dropout}", "lora.dropout")
        servable = self.engine.config.lora_target_modules or PROJECTIONS  # what the device pool holds
        targets = lora.targets or [m for m in DEFAULT_TARGETS if m in servable] or list(servable)
        unknown = sorted(set(targets) - set(servable))
        if unknown or len(set(targets)) != len(targets):
            raise ApiError(400, f"lora.targets: distinct names among {', '.join(servable)} (what this server's "
                                "adapters may target)" + (f"; not: {', '.join(unknown)}" if unknown else ""),
                           "lora.targets")
        raw = {"r": lora.r, "alpha": float(2 * lora.r if lora.alpha is None else lora.alpha),
               "dropout": float(lora.dropout),
               "targets": targets, "use_rslora": lora.use_rslora}
        try:
            lora_config(raw, "lora")
        except ConfigError as err:
            raise ApiError(400, str(err), "lora") from None
        return raw

    def job(self, job_id: str) -> dict:
        job = self.table.get(job_id)
        if job is None:
            raise ApiError(404, f"no fine-tuning job {job_id!r}", "fine_tuning_job_id", "not_found_error")
        return job

    def cancel(self, job_id: str) -> dict:
        job = self.job(job_id)
        if job["status"] in FINAL:
            raise ApiError(400, f"the job has already {job['status']}", "fine_tuning_job_id")
        return public_job(self.table.cancel(job_id))


def check_engine(engine) -> None:
    """ValueError unless fine-tuning can run on `engine` (one engine on one device, unmerged
    serving, an adapter directory to publish the adapters in)."""
    if not isinstance(engine, Engine) or engine.mesh is not None:
        raise ValueError("fine-tuning runs on one engine on one device (not with --replicas or --tensor-parallel)")
    if engine.modes is not None:
        raise ValueError("fine-tuning needs --inference-mode unmerged (merged modes change the base weights)")
    if engine.config.adapter_dir is None:
        raise ValueError("fine-tuning needs --adapter-dir: finished jobs' adapters are served from there")
    if engine.config.split_layers:
        raise ValueError("fine-tuning trains on the stacked layers: not with --split-layers")


def public_job(job: dict) -> dict:
    """OpenAI's fine_tuning.job object (with our `lora` and `learning_rate` fields)."""
    return {key: value for key, value in job.items() if key != "adapter_name"}


def page(items: list[dict], after: str | None, limit: int) -> dict:
    """OpenAI's list page: the items after the one whose id is `after` (newest first), `limit` of them."""
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    return {"object": "list", "data": items[:limit], "has_more": len(items) > limit}


def _list_args(request: Request) -> tuple[str | None, int]:
    """`after` and `limit` (1..100, default 20) of a list request; any other parameter: ApiError 400."""
    params = request.query_params
    unknown = sorted(set(params) - {"after", "limit"})
    if unknown:
        raise ApiError(400, f"unsupported query parameter(s): {', '.join(unknown)}", unknown[0])
    limit = params.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_LIST:
        raise ApiError(400, f"limit must be an integer in [1, {MAX_LIST}]", "limit")
    return params.get("after"), int(limit)


def add_finetune_routes(app: FastAPI, service: FinetuneService) -> None:
    """Mounts the files and fine-tuning routes (the module doc) on `app`."""

    @app.post("/v1/files")
    async def upload(request: Request):
        try:
            form = await request.form(max_files=1, max_fields=2)
        except HTTPException as err:  # malformed multipart, too many parts
            raise ApiError(400, f"bad multipart form data: {err.detail}", "file") from None
        unknown = sorted(set(form) - {"file", "purpose"})
        if unknown:
            raise ApiError(400, f"unsupported form field(s): {', '.join(unknown)}", unknown[0])
        upload, purpose = form.get("file"), form.get("purpose")
        if upload is None or isinstance(upload, str) or not isinstance(purpose, str):
            raise ApiError(400, "send multipart form data with a `file` and a `purpose`", "file")
        data = await upload.read(service.settings.max_file_bytes + 1)
        try:
            return await run_in_threadpool(service.files.add, data, upload.filename or "", purpose)
        except FileError as err:
            raise ApiError(400, str(err), "file") from None

    @app.get("/v1/files")
    async def list_files(request: Request):
        after, limit = _list_args(request)
        return page(service.files.list(), after, limit)

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str):
        file = service.files.get(file_id)
        if file is None:
            raise ApiError(404, f"no file {file_id!r}", "file_id", "not_found_error")
        return file

    @app.post("/v1/fine_tuning/jobs")
    async def create_job(body: JobRequest):
        return await run_in_threadpool(service.create_job, body)

    @app.get("/v1/fine_tuning/jobs")
    async def list_jobs(request: Request):
        after, limit = _list_args(request)
        return page([public_job(job) for job in reversed(service.table.jobs())], after, limit)

    @app.get("/v1/fine_tuning/jobs/{job_id}")
    async def get_job(job_id: str):
        return public_job(service.job(job_id))

    @app.get("/v1/fine_tuning/jobs/{job_id}/events")
    async def job_events(job_id: str, request: Request):
        after, limit = _list_args(request)
        service.job(job_id)
        events = [{k: v for k, v in e.items() if k != "number"} for e in reversed(service.table.events(job_id))]
        return page(events, after, limit)

    @app.post("/v1/fine_tuning/jobs/{job_id}/cancel")
    async def cancel_job(job_id: str):
        return await run_in_threadpool(service.cancel, job_id)
