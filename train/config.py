"""`jaxlora-train` configuration: a YAML file of shared settings and a list of jobs (one adapter each),
checked key by key with errors that name the file and line."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any

import yaml

from jaxlora.dtypes import DTYPES, checkpoint_dtype, choose_dtype
from jaxlora.lora.adapter_config import AdapterError, LoraConfig
from jaxlora.lora.head import check_labels
from jaxlora.lora import backends
from jaxlora.lora.backends import LoraBackend


class ConfigError(ValueError):
    """A training configuration that cannot be run; the message names file and line."""


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """A job's task head (`jaxlora.lora.head`): the labels its `{"text", "label"}` data uses."""

    labels: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """One fine-tuning job: an adapter trained on one dataset with its own optimizer; with `head`,
    a classification adapter (LoRA and task head trained together, `train.heads`)."""

    name: str
    dataset: str
    lora: LoraConfig
    learning_rate: float = 1e-4
    schedule: str = "constant"  # constant | linear | cosine (decay to 0 over the job's steps)
    warmup_steps: int = 0
    weight_decay: float = 0.0
    global_batch_size: int = 8
    epochs: int | None = 1
    steps: int | None = None  # optimizer steps; overrides epochs when set
    seed: int = 0
    eval_dataset: str | None = None  # prompt/completion JSONL, answers checked exactly (knowledge fusion)
    min_accuracy: float | None = None  # the task's accuracy requirement on eval_dataset (knowledge fusion)
    head: HeadConfig | None = None


@dataclasses.dataclass(frozen=True)
class FusionConfig:
    """`fusion:` turns the run into V-LoRA's accuracy-aware knowledge fusion (`train.fusion`): the
    jobs are tasks packed greedily into as few adapters as their `min_accuracy` allow."""

    order: str = "random"  # random (the paper: a seeded shuffle) | given (the jobs' order)
    seed: int = 0
    policy: str = "next_fit"  # next_fit (the paper: only the newest adapter takes tasks) | first_fit
    max_new_tokens: int | None = None  # per evaluated answer; default: the longest answer's tokens + 2


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """How many devices split each dimension: the batch (`data`), heads/FFN (`tensor`, Megatron +
    S-LoRA) and layers (`pipeline`, the MPMD 1F1B pipeline); the product is the device count.
    `fsdp`: also split the frozen base weights over `data` (each device keeps 1/data of them)."""

    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    fsdp: bool = False

    @property
    def size(self) -> int:
        return self.data * self.tensor * self.pipeline


REMAT_POLICIES = ("none", "layer", "save_dots")  # what the backward keeps of each decoder layer


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Settings shared by all jobs of one run."""

    jobs: tuple[JobConfig, ...]
    base_model: str = "default"  # or a HF directory, a .gguf file, preset:NAME (random weights)
    tokenizer: str | None = None  # a HF directory or .gguf whose tokenizer reads the datasets; default: base_model's
    output_dir: str = "runs/train"  # relative paths (here and for datasets) start at the YAML file
    dtype: str = "float32"  # a YAML file's default is "auto" (`load_train_config` resolves it)
    capacity: int = 1024  # tokens per microbatch
    max_seq_len: int | None = None  # longest sample; default: capacity
    overlong: str = "truncate"  # truncate | refuse
    mesh: MeshConfig = MeshConfig()
    remat: str = "none"  # none | layer (keep each layer's input, recompute the rest) | save_dots
    scheduler: str = "milp"  # milp | greedy
    solver_time_limit: float = 1.0
    checkpoint_every: int = 50  # microbatches
    lora_backend: str = backends.TRAINING_DEFAULT  # a name of jaxlora.lora.backends; the object: `backend`
    unroll_layers: bool = False  # unrolled layer scan: faster GPU steps, longer compile (README)
    seed: int = 0
    progress: bool = True
    tensorboard: bool = True  # event files in output_dir/tensorboard (tensorboardX)
    peak_tflops: float | None = None  # per device, for MFU; default: a table of known devices
    fusion: FusionConfig | None = None  # set: pack the jobs' tasks into few adapters (`train.fusion_run`)

    @functools.cached_property
    def backend(self) -> LoraBackend:
        """`lora_backend` resolved once (`jaxlora.lora.backends`): the object the trainer passes down."""
        return backends.get(self.lora_backend, trains=True)

    @property
    def sample_limit(self) -> int:
        return min(self.max_seq_len or self.capacity, self.capacity)


_MESH_KEYS = {f.name for f in dataclasses.fields(MeshConfig)}
_JOB_DEFAULTS = {f.name: f.default for f in dataclasses.fields(JobConfig) if f.default is not dataclasses.MISSING}
_TRAIN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING}
_RETIRED = {"pipeline_stages": "replaced by mesh.pipeline (mesh: {pipeline: N})"}
_SECTIONS = ("mesh",)  # mappings an override may create (`mesh.data=4` with no mesh: in the file)
_LORA_KEYS = {"r", "alpha", "dropout", "targets", "use_rslora", "rank_pattern", "alpha_pattern"}
_CHOICES = {"schedule": ("constant", "linear", "cosine"), "overlong": ("truncate", "refuse"),
            "scheduler": ("milp", "greedy"), "dtype": DTYPES, "lora_backend": backends.names(trains=True),
            "remat": REMAT_POLICIES, "order": ("random", "given"), "policy": ("next_fit", "first_fit")}


class _Problems:
    """The errors found in one configuration, collected so that all are reported at once."""

    def __init__(self):
        self.messages: list[str] = []

    def add(self, message: str) -> None:
        self.messages.append(message)

    @contextlib.contextmanager
    def collect(self):
        """Records a ConfigError raised inside the block instead of letting it through."""
        try:
            yield
        except ConfigError as err:
            self.messages.append(str(err))

    def raise_all(self, path: str) -> None:
        """One ConfigError listing every message (a single one as it is)."""
        if len(self.messages) == 1:
            raise ConfigError(self.messages[0])
        if self.messages:
            lines = "\n".join(f"  {message}" for message in self.messages)
            raise ConfigError(f"{path}: {len(self.messages)} errors:\n{lines}")


def load_train_config(path: str, overrides: list[str] = (), check_files: bool = False,
                      resolve_dtype: bool = True) -> TrainConfig:
    """Reads `path` (YAML), applies `key=value` overrides (e.g. `capacity=512`,
    `jobs.0.learning_rate=1e-3`), and checks every key and value; `check_files`: also that each
    job's dataset (and eval_dataset) is a readable file. Every error found is in one ConfigError.
    dtype "auto" (the default) is resolved here (`resolved_dtype`: it asks jax for the platform,
    which starts the backend) unless `resolve_dtype` is False: a multi-process run resolves it
    after `jax.distributed.initialize`, which must come first."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror}") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise ConfigError(f"{where}: malformed YAML: {getattr(err, 'problem', err)}") from None
    lines = _key_lines(root)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}:1: expected a mapping with a 'jobs' list")
    problems = _Problems()
    for override in overrides:
        with problems.collect():
            _apply_override(raw, override)
    raw.setdefault("dtype", "auto")
    config = _build(raw, lines, path, problems, check_files)
    problems.raise_all(path)
    return resolved_dtype(config) if resolve_dtype else config


def resolved_dtype(config: TrainConfig) -> TrainConfig:
    """`config` with dtype "auto" replaced once (`jaxlora.dtypes.choose_dtype`: bfloat16 on a GPU or
    TPU, float32 on a CPU), so every consumer reads a concrete dtype."""
    if config.dtype != "auto":
        return config
    import jax

    base = None if config.base_model.startswith("preset:") else config.base_model
    return dataclasses.replace(config, dtype=choose_dtype("auto", jax.default_backend(), checkpoint_dtype(base))[0])


def _key_lines(node, prefix: tuple = ()) -> dict[tuple, int]:
    """Line number (1-based) of every mapping key and list item, by path."""
    lines = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = prefix + (key_node.value,)
            lines[path] = key_node.start_mark.line + 1
            lines.update(_key_lines(value_node, path))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[prefix + (index,)] = item.start_mark.line + 1
            lines.update(_key_lines(item, prefix + (index,)))
    return lines


def _where(path: str, lines: dict, keys: tuple) -> str:
    """`file:line` of the key at `keys`, else of its nearest enclosing key (one set by an override
    is not in the file), else line 1."""
    found = (lines[tuple(keys[:n])] for n in range(len(keys), 0, -1) if tuple(keys[:n]) in lines)
    return f"{path}:{next(found, 1)}"


def _apply_override(raw: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected key=value")
    key, value = override.split("=", 1)
    parts = [int(p) if p.isdigit() else p for p in key.split(".")]
    target = raw
    for part in parts[:-1]:
        if target is raw and part in _SECTIONS and part not in raw:
            raw[part] = {}
        try:
            target = target[part]
        except (KeyError, IndexError, TypeError):
            raise ConfigError(f"override {override!r}: no such key {key!r}") from None
    target[parts[-1]] = yaml.safe_load(value)


def _reject_unknown_keys(raw: dict, known, where, problems: _Problems, kind: str = "") -> dict:
    """A problem for every key of `raw` not in `known`, at `where(key)` (its file:line), naming the
    known keys; `kind` names the section ("job", "mesh", ...). Returns `raw`'s known keys."""
    label = f"{kind} key" if kind else "key"
    for key in raw:
        if key not in known:
            problems.add(f"{where(key)}: unknown {label} {key!r} (known: {', '.join(sorted(known))})")
    return {key: value for key, value in raw.items() if key in known}


def _build(raw: dict, lines: dict, path: str, problems: _Problems, check_files: bool) -> TrainConfig | None:
    """The TrainConfig of `raw` (None where it cannot be built); every error goes to `problems`."""
    def where(*keys) -> str:
        return _where(path, lines, keys)

    for key in raw:
        if key in _RETIRED:
            problems.add(f"{where(key)}: {key!r} is {_RETIRED[key]}")
    settings = _reject_unknown_keys({k: v for k, v in raw.items() if k not in _RETIRED},
                                    {f.name for f in dataclasses.fields(TrainConfig)}, where, problems)
    jobs = _build_jobs(settings.pop("jobs", None), where, os.path.dirname(path), problems, check_files)
    _check_choices(settings, where, problems)
    with problems.collect():
        settings["mesh"] = MeshConfig()
        settings["mesh"] = _build_mesh(raw.get("mesh") or {}, where, problems)
    if "fusion" in settings:
        settings["fusion"] = None
        with problems.collect():
            settings["fusion"] = _build_fusion(raw["fusion"], jobs, where, problems)
    if settings.get("tokenizer") is not None and not os.path.isabs(str(settings["tokenizer"])) \
            and settings["tokenizer"] != "default":
        settings["tokenizer"] = os.path.join(os.path.dirname(path), str(settings["tokenizer"]))
    output_dir = str(settings.get("output_dir", TrainConfig.output_dir))
    settings["output_dir"] = output_dir if os.path.isabs(output_dir) else os.path.join(os.path.dirname(path), output_dir)
    _check_positive({**_TRAIN_DEFAULTS, **settings}, where, problems)
    return None if problems.messages else TrainConfig(jobs=tuple(jobs), **settings)


def _build_jobs(jobs_raw, where, base_dir: str, problems: _Problems, check_files: bool) -> list[JobConfig | None]:
    """Each job of the `jobs:` list (None for one with errors), and duplicate names refused."""
    if not isinstance(jobs_raw, list) or not jobs_raw:
        problems.add(f"{where('jobs')}: 'jobs' must be a non-empty list")
        return []
    jobs = [_build_job(job, lambda *k, i=i: where("jobs", i, *k), base_dir, problems, check_files)
            for i, job in enumerate(jobs_raw)]
    names = [job.name if job else None for job in jobs]
    for index, name in enumerate(names):
        if name is not None and names.index(name) != index:
            problems.add(f"{where('jobs', index, 'name')}: duplicate job name {name!r}")
    return jobs


def _build_job(job: Any, where, base_dir: str, problems: _Problems, check_files: bool) -> JobConfig | None:
    """One job's JobConfig, or None (its errors in `problems`); `check_files`: its datasets are
    readable files."""
    if not isinstance(job, dict):
        problems.add(f"{where()}: each job must be a mapping")
        return None
    before = len(problems.messages)
    values = _reject_unknown_keys(job, {f.name for f in dataclasses.fields(JobConfig)}, where, problems, "job")
    for required in ("name", "dataset"):
        if not job.get(required):
            problems.add(f"{where()}: job needs a {required!r}")
    _check_choices(job, where, problems)
    if job.get("steps") is not None and job.get("epochs") is not None:
        problems.add(f"{where('steps')}: give 'steps' or 'epochs', not both (steps={job['steps']!r}, "
                     f"epochs={job['epochs']!r}; an override can drop one: jobs.N.epochs=null)")
    if values.get("steps") is not None:
        values["epochs"] = None
    _check_job_values({**_JOB_DEFAULTS, **values}, where, problems)
    with problems.collect():
        values["lora"] = _build_lora(job.get("lora") or {}, where)
    if job.get("head") is not None:
        with problems.collect():
            values["head"] = _build_head(job["head"], where)
    for key in ("dataset", "eval_dataset"):
        if job.get(key):
            values[key] = os.path.join(base_dir, str(job[key]))  # join keeps absolute paths
            if check_files:
                _check_file(values[key], f"{where(key)}: {key}", problems)
    return None if len(problems.messages) > before else JobConfig(**values)


def _build_mesh(raw, where, problems: _Problems) -> MeshConfig:
    """The `mesh:` mapping; a bad one raises ConfigError (its key errors are all in `problems`)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where('mesh')}: 'mesh' must be a mapping like {{data: 4, tensor: 2}}")
    before = len(problems.messages)
    raw = _reject_unknown_keys(raw, _MESH_KEYS, lambda key: where("mesh", key), problems, "mesh")
    for key, value in raw.items():
        if key == "fsdp":
            if not isinstance(value, bool):
                problems.add(f"{where('mesh', key)}: mesh.fsdp must be true or false")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.add(f"{where('mesh', key)}: mesh.{key} must be a positive integer, not {value!r}")
    return MeshConfig(**raw) if len(problems.messages) == before else MeshConfig()


def _build_fusion(raw, jobs: list[JobConfig | None], where, problems: _Problems) -> FusionConfig:
    """The `fusion:` mapping (empty: the defaults); every job then needs eval_dataset and min_accuracy."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{where('fusion')}: 'fusion' must be a mapping like {{order: random, seed: 0}}")
    raw = _reject_unknown_keys(raw, {f.name for f in dataclasses.fields(FusionConfig)},
                               lambda key: where("fusion", key), problems, "fusion")
    _check_choices(raw, lambda *k: where("fusion", *k), problems)
    tokens = raw.get("max_new_tokens")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        problems.add(f"{where('fusion', 'max_new_tokens')}: max_new_tokens must be a positive integer")
    for index, job in enumerate(jobs):
        if job is not None and (job.eval_dataset is None or job.min_accuracy is None):
            problems.add(f"{where('jobs', index)}: job {job.name!r} needs 'eval_dataset' and 'min_accuracy' "
                         "(fusion: packs tasks by their accuracy requirements)")
    return FusionConfig(**raw)


def _build_lora(raw: dict, where) -> LoraConfig:
    """A job's `lora:` mapping; ConfigError listing every unknown key, or LoraConfig's refusal."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where('lora')}: 'lora' must be a mapping like {{r: 8, alpha: 16}}")
    problems = _Problems()
    raw = _reject_unknown_keys(raw, _LORA_KEYS, lambda key: where("lora", key), problems, "lora")
    if problems.messages:
        raise ConfigError("; ".join(problems.messages))
    try:
        rank = int(raw.get("r", 8))
        return LoraConfig(
            r=rank, lora_alpha=float(raw.get("alpha", 2 * rank)), lora_dropout=float(raw.get("dropout", 0.0)),
            target_modules=tuple(raw.get("targets", ("q_proj", "k_proj", "v_proj", "o_proj"))),
            use_rslora=bool(raw.get("use_rslora", False)), rank_pattern=dict(raw.get("rank_pattern") or {}),
            alpha_pattern=dict(raw.get("alpha_pattern") or {}),
        )
    except (AdapterError, TypeError, ValueError) as err:
        raise ConfigError(f"{where('lora')}: {err}") from None


def _build_head(raw, where) -> HeadConfig:
    if not isinstance(raw, dict) or set(raw) != {"labels"}:
        raise ConfigError(f"{where('head')}: 'head' must be a mapping with one key, labels: [...]")
    try:
        return HeadConfig(check_labels(raw["labels"], "head"))
    except AdapterError as err:
        raise ConfigError(f"{where('head', 'labels')}: {err}") from None


def lora_config(raw: dict, where: str) -> LoraConfig:
    """A job's `lora:` mapping as a LoraConfig (defaults as in a job file); ConfigError naming `where`."""
    return _build_lora(raw, lambda *keys: where)


def _check_choices(values: dict, where, problems: _Problems) -> None:
    """A problem for each key of `values` whose value is not one of its choices."""
    for key, choices in _CHOICES.items():
        if key in values and values[key] not in choices:
            problems.add(f"{where(key)}: {key}={values[key]!r} is not one of {', '.join(choices)}")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_positive(settings: dict, where, problems: _Problems) -> None:
    """The run's counts and peak_tflops are positive (`settings`: its values over the defaults)."""
    for key in ("capacity", "checkpoint_every"):
        if not _positive_int(settings[key]):
            problems.add(f"{where(key)}: {key} must be a positive integer")
    peak = settings["peak_tflops"]
    if peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float)) or peak <= 0):
        problems.add(f"{where('peak_tflops')}: peak_tflops must be a positive number (TFLOP/s per device)")


def _check_job_values(job: dict, where, problems: _Problems) -> None:
    """A job's batch size, length (epochs or steps), learning rate and min_accuracy are in range
    (`job`: its values over the defaults)."""
    if not _positive_int(job["global_batch_size"]):
        problems.add(f"{where('global_batch_size')}: global_batch_size must be >= 1")
    if not _positive_int(job["steps"] if job["steps"] is not None else job["epochs"]):
        problems.add(f"{where()}: give a positive 'epochs' or 'steps'")
    rate = job["learning_rate"]
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate <= 0:
        problems.add(f"{where('learning_rate')}: learning_rate must be a number > 0, not "
                     f"{rate!r} (YAML reads 2e-3 as text: write 2.0e-3)")
    accuracy = job["min_accuracy"]
    if accuracy is not None and (isinstance(accuracy, bool) or not isinstance(accuracy, (int, float))
                                 or not 0 <= accuracy <= 1):
        problems.add(f"{where('min_accuracy')}: min_accuracy must be a number in [0, 1]")


def _check_file(path: str, label: str, problems: _Problems) -> None:
    """A problem unless `path` is a readable file (datasets are checked before a model is loaded)."""
    reason = "a directory" if os.path.isdir(path) else "no such file" if not os.path.isfile(path) \
        else None if os.access(path, os.R_OK) else "not readable"
    if reason:
        problems.add(f"{label} {path}: cannot read dataset: {reason}")
