"""`jaxlora-train` as two processes joined by jax.distributed (CPU, 4 devices each, mesh data 4 x
tensor 2 over all 8) gives the same per-job losses and adapters as one process on one device."""

import json
import os
import sys

from jaxlora.lora.peft_io import load_peft_adapter
from tests.multidevice import ROOT, SKIP, free_port, run_processes
from tests.train.multidevice.test_meshes import assert_same_training
from tests.train.tiny_jobs import write_tiny_jobs
from train.config import load_train_config
from train.trainer import Trainer

def _job_losses(out_dir, job: str) -> list[float]:
    with open(os.path.join(out_dir, job, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


@SKIP
def test_two_processes_equal_one(tmp_path):
    jobs = write_tiny_jobs(str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "JAX_LOCAL_DEVICE_IDS": "0,1,2,3",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    command = [sys.executable, "-m", "train", jobs, "output_dir=two", "mesh.data=4", "mesh.tensor=2",
               "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
    run_processes([command + ["--process-id", str(pid)] for pid in (0, 1)], env)

    reference = Trainer(load_train_config(jobs, ["output_dir=one"]))
    expected = reference.run()
    out = tmp_path / "two"
    losses = {job: _job_losses(out, job) for job in expected}
    adapters = [load_peft_adapter(str(out / a.name), reference.model.config) for a in reference.adapters()]
    assert_same_training(losses, adapters, expected, reference.adapters())
