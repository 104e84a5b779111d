"""The job file's `mesh:` checked against the model, the devices and the other settings before
anything is compiled (each error names the setting), and the device mesh it describes:

  * pipeline 1: one (data, 1, tensor) mesh over all devices (of all processes); the grad step runs
    under GSPMD (`jaxlora.sharding` places weights, adapters and batch rows);
  * pipeline S > 1: S stages of the MPMD 1F1B pipeline (`jaxlora.parallel.mpmd`), each a
    (data, 1, tensor) sub-mesh of consecutive devices running its layers under GSPMD.

`fsdp: true` also splits the frozen base weights' model dimension (`embed`) over `data`."""

from __future__ import annotations

from jaxlora.lora import backends
from jaxlora.nn.model_config import LlamaConfig
from train.config import ConfigError, TrainConfig


def check_mesh(config: TrainConfig, model: LlamaConfig, device_count: int, process_count: int = 1) -> None:
    """Raises ConfigError naming the setting when `config.mesh` cannot run `model` here."""
    mesh = config.mesh
    shape = f"mesh.data={mesh.data} x mesh.tensor={mesh.tensor} x mesh.pipeline={mesh.pipeline}"
    if mesh.size != device_count:
        raise ConfigError(f"{shape} = {mesh.size} devices, but {device_count} are available "
                          f"(over {process_count} process{'es' if process_count > 1 else ''})")
    for name in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
        if getattr(model, name) % mesh.tensor:
            raise ConfigError(f"mesh.tensor={mesh.tensor} does not divide the model's {name}={getattr(model, name)}")
    if mesh.pipeline > model.num_layers:
        raise ConfigError(f"mesh.pipeline={mesh.pipeline} is more stages than the model's {model.num_layers} layers")
    if mesh.fsdp and model.hidden_size % mesh.data:
        raise ConfigError(f"mesh.fsdp: mesh.data={mesh.data} does not divide the model's hidden_size={model.hidden_size}")
    if mesh.data * mesh.tensor > 1 and not config.backend.partitionable:
        raise ConfigError(f"lora_backend={config.lora_backend!r} cannot run with mesh.data={mesh.data}, "
                          f"mesh.tensor={mesh.tensor}: its kernels (a pallas_call) have no GSPMD partitioning rule; "
                          f"use one of {', '.join(backends.names(trains=True, partitionable=True))}")
    if mesh.pipeline > 1:
        _check_pipeline(config, process_count)


def _check_pipeline(config: TrainConfig, process_count: int) -> None:
    pipeline = config.mesh.pipeline
    if process_count > 1:
        raise ConfigError(f"mesh.pipeline={pipeline}: the MPMD pipeline drives its stages from one process; "
                          "across hosts use mesh.data (and mesh.tensor inside a host)")
    if config.remat == "save_dots":
        raise ConfigError(f"remat='save_dots' with mesh.pipeline={pipeline}: pipeline stages always recompute "
                          "each layer in the backward (remat: layer)")
    for index, job in enumerate(config.jobs):
        if job.lora.lora_dropout > 0:
            raise ConfigError(f"jobs.{index}.lora.dropout={job.lora.lora_dropout} with mesh.pipeline={pipeline}: "
                              "the pipeline stages have no LoRA dropout (set dropout: 0 or mesh.pipeline: 1)")


def data_width(config: TrainConfig) -> int:
    """Microbatches (packed rows) per training step: one per data shard."""
    return config.mesh.data


def build_meshes(config: TrainConfig, devices) -> list:
    """One (data, 1, tensor) `Mesh` per pipeline stage, over consecutive runs of `devices`
    (`jax.devices()` order, so a stage's devices and its `tensor` groups stay on one host)."""
    import numpy as np

    from jaxlora import sharding

    mesh = config.mesh
    grid = np.asarray(devices, dtype=object).reshape(mesh.pipeline, mesh.data * mesh.tensor)
    return [sharding.make_mesh(data=mesh.data, tensor=mesh.tensor, devices=list(stage)) for stage in grid]
