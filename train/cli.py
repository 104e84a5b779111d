"""`jaxlora-train JOBS.yaml [key=value ...] [--resume]`: trains several LoRA adapters together.

With a `fusion:` section the jobs are tasks with accuracy requirements, packed into as few adapters
as the requirements allow (V-LoRA's knowledge fusion, `train.fusion_run`); exit status 1 when a
task misses its requirement. Jobs with a `head:` (classification adapters, `train.heads`) train
after the others, one by one.

Several hosts: run the same command on every host, one process each, with `--distributed` (the
coordinator, process count and id come from the environment: SLURM, Open MPI, a TPU slice, or
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) or the flags below."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from jaxlora.lora.adapter_config import AdapterError
from jaxlora.weights import WeightsError
from train.config import ConfigError, load_train_config, resolved_dtype


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxlora-train", description=__doc__)
    parser.add_argument("config", help="YAML file: base_model, output_dir, jobs: [...]")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. capacity=512 jobs.0.learning_rate=1e-3")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    hosts = parser.add_argument_group("several hosts (jax.distributed)")
    hosts.add_argument("--distributed", action="store_true",
                       help="join a multi-process run (settings from the environment or the flags below)")
    hosts.add_argument("--coordinator", default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
                       help="host:port of process 0 (default: $JAX_COORDINATOR_ADDRESS)")
    hosts.add_argument("--num-processes", type=int, default=_env_int("JAX_NUM_PROCESSES"),
                       help="default: $JAX_NUM_PROCESSES")
    hosts.add_argument("--process-id", type=int, default=_env_int("JAX_PROCESS_ID"), help="default: $JAX_PROCESS_ID")
    return parser


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def _join_processes(args) -> None:
    """`jax.distributed.initialize` before anything touches a device; given values, else detected."""
    if not (args.distributed or args.num_processes or args.process_id is not None):
        return
    import jax

    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id)


def _train(config, resume: bool) -> tuple[bool, dict[str, list[float]]]:
    """Trains the LM jobs together (`train.trainer`), then each head job (`train.heads`); returns
    (whether this is process 0, each job's losses)."""
    import jax  # here: only once the config is known to be good

    from train.base_model import load_base_model
    from train.heads import train_head_jobs
    from train.trainer import Trainer

    heads = [job for job in config.jobs if job.head is not None]
    if heads and (resume or jax.process_count() > 1):
        raise ConfigError(f"head jobs ({', '.join(job.name for job in heads)}) train in one process and are not "
                          "checkpointed: run them without --resume / --distributed")
    print(f"weights in {config.dtype} (the config's dtype; auto: bfloat16 on a GPU or TPU, float32 on a CPU)",
          file=sys.stderr)
    model = tokenizer = None
    if heads:
        model, tokenizer = load_base_model(config.base_model, jax.numpy.dtype(config.dtype), config.seed,
                                           config.tokenizer)
    losses, primary = {}, True
    lm_jobs = tuple(job for job in config.jobs if job.head is None)
    if lm_jobs:
        trainer = Trainer(dataclasses.replace(config, jobs=lm_jobs), model, tokenizer)
        losses, primary = trainer.run(resume=resume), trainer.primary
    losses.update(train_head_jobs(config, heads, model, tokenizer))
    return primary, losses


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_train_config(args.config, args.overrides, check_files=True, resolve_dtype=False)
        _join_processes(args)  # before anything starts jax's backend (resolving dtype "auto" does)
        config = resolved_dtype(config)
        if config.fusion is not None:
            return _fuse(config, args.resume)
        primary, losses = _train(config, args.resume)
    except (ConfigError, WeightsError, AdapterError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not primary:
        return 0
    for name, values in losses.items():
        last = f"{values[-1]:.4f}" if values else "n/a"
        print(f"{name}: {len(values)} steps, final loss {last}, adapter in {config.output_dir}/{name}")
    return 0


def _fuse(config, resume: bool) -> int:
    """Runs knowledge fusion and prints its table; 1 when a requirement is not met."""
    if resume:
        raise ConfigError("--resume does not apply to knowledge fusion (it retrains candidate adapters)")
    heads = [job.name for job in config.jobs if job.head is not None]
    if heads:
        raise ConfigError(f"knowledge fusion packs generation tasks; jobs {heads} have task heads (train them "
                          "without a fusion: section)")
    from train.fusion import format_table, format_trial
    from train.fusion_run import REPORT_FILE, run_fusion

    report = run_fusion(config, on_trial=lambda trial: print(format_trial(trial), flush=True))
    print(format_table(report))
    print(f"adapters in {config.output_dir}/adapter_<i>, report in {config.output_dir}/{REPORT_FILE} "
          f"({report['wall_s']:.0f} s)")
    return 0 if report["all_met"] else 1
