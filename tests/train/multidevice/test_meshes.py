"""`jaxlora-train`'s loop on meshes of 8 simulated devices (data 8 with the frozen base split
FSDP-style, data x tensor, two pipelines) equals one device on the tiny 3-adapter job file (float32): the same per-job losses at every optimizer step (relative error <= 1e-5) and
the same trained adapters (relative norm error <= 1e-4: AdamW divides by sqrt(v), which turns the
f32 reordering of sums across data shards into slightly larger weight differences). A checkpoint
written on one mesh resumes on another with the same losses thereafter."""

from __future__ import annotations

import functools
import os
import shutil

import jax
import numpy as np
import pytest

from tests.train.tiny_jobs import write_tiny_jobs
from train.config import load_train_config
from train.trainer import Trainer

MESHES = {"data8_fsdp": ["mesh.data=8", "mesh.fsdp=true"], "data4_tensor2": ["mesh.data=4", "mesh.tensor=2"],
          "pipe2_data2_tensor2": ["mesh.pipeline=2", "mesh.data=2", "mesh.tensor=2"],
          "pipe4_data2": ["mesh.pipeline=4", "mesh.data=2"]}
LOSS_RTOL, WEIGHT_RTOL = 1e-5, 1e-4


@functools.lru_cache(maxsize=None)
def _job_dir() -> str:
    import tempfile

    return write_tiny_jobs(tempfile.mkdtemp(prefix="mesh_jobs_"))


def _config(name: str, overrides=(), **extra):
    overrides = [f"output_dir={os.path.join(os.path.dirname(_job_dir()), name)}", *overrides]
    overrides += [f"{key}={value}" for key, value in extra.items()]
    return load_train_config(_job_dir(), overrides)


@functools.lru_cache(maxsize=None)
def trained(name: str):
    """(per-job losses, adapters) of a full run on mesh `name` ("one": one device)."""
    config = _config(name, MESHES.get(name, ()))
    devices = jax.devices()[:1] if name == "one" else None
    trainer = Trainer(config, devices=devices)
    losses = trainer.run()
    return losses, trainer.adapters(), config.output_dir


def _relative(actual, expected) -> float:
    actual, expected = np.ravel(actual), np.ravel(expected)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def assert_same_training(losses, adapters, expected_losses, expected_adapters):
    assert losses.keys() == expected_losses.keys()
    for job, values in expected_losses.items():
        assert len(losses[job]) == len(values) > 0
        np.testing.assert_allclose(losses[job], values, rtol=LOSS_RTOL, err_msg=job)
    for got, want in zip(adapters, expected_adapters, strict=True):
        for module, weights in want.modules.items():
            assert np.abs(weights.b).max() > 0  # it trained
            assert _relative(got.modules[module].a, weights.a) <= WEIGHT_RTOL, (got.name, module)
            assert _relative(got.modules[module].b, weights.b) <= WEIGHT_RTOL, (got.name, module)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_mesh_equals_one_device(mesh):
    losses, adapters, _ = trained(mesh)
    expected_losses, expected_adapters, _ = trained("one")
    assert_same_training(losses, adapters, expected_losses, expected_adapters)


@pytest.mark.parametrize("written, resumed", [("data4_tensor2", "pipe4_data2"), ("pipe2_data2_tensor2", "data8_fsdp")])
def test_checkpoint_resumes_on_another_mesh(written, resumed):
    _, _, source = trained(written)
    out = os.path.join(os.path.dirname(source), f"{written}_to_{resumed}")
    shutil.copytree(source, out)
    checkpoints = os.path.join(out, "checkpoints")
    steps = sorted(int(p) for p in os.listdir(checkpoints) if p.isdigit())
    assert len(steps) == 2, steps  # the final checkpoint and the one before: drop the final one
    shutil.rmtree(os.path.join(checkpoints, str(steps[-1])))
    trainer = Trainer(_config(os.path.basename(out), MESHES[resumed]))
    losses = trainer.run(resume=True)
    expected_losses, expected_adapters, _ = trained("one")
    assert_same_training(losses, trainer.adapters(), expected_losses, expected_adapters)


def test_fsdp_splits_the_frozen_base_over_data():
    from jax.sharding import PartitionSpec as P

    trainer = Trainer(_config("fsdp_layout", MESHES["data8_fsdp"]))
    weights = trainer.model.weights
    assert weights["layers.q_proj.kernel"][...].sharding.spec == P(None, "data", "tensor")
    assert weights["layers.down_proj.kernel"][...].sharding.spec == P(None, "tensor", "data")
    local = weights["layers.up_proj.kernel"][...].addressable_shards[0].data.shape
    assert local[1] == trainer.model.config.hidden_size // 8
    assert trainer.executor.trainable["q_proj"]["a"].sharding.is_fully_replicated  # adapters: S-LoRA layout only
