"""Two processes on this machine (jax.distributed on CPU, coordinator on 127.0.0.1, 4 devices each)
run the sharded training steps and agree with one device."""

import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxlora.buckets import bucket
from jaxlora.lora.plan import build_plan
from jaxlora.lora.trainable import split_pool
from jaxlora.parallel.step import make_grad_step
from tests.jaxlora.parallel.fixtures import NUM_SLOTS, packed_batch, random_pool, tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(os.environ.get("JAXLORA_SKIP_MULTIDEVICE") == "1", reason="JAXLORA_SKIP_MULTIDEVICE=1")
def test_two_processes_match_one_device(tmp_path):
    out, port = tmp_path / "results.npz", _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    workers = [subprocess.Popen([sys.executable, str(ROOT / "tests/jaxlora/parallel/two_process_worker.py"),
                                 str(pid), str(port), str(out)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for pid in (0, 1)]
    try:
        logs = [worker.communicate(timeout=600)[0] for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    assert all(worker.returncode == 0 for worker in workers), "\n".join(log[-3000:] for log in logs)

    batch, token_slot = packed_batch(adapters=(0, 1, 2, 3, -1))
    trainable, frozen = split_pool(random_pool())
    plan = build_plan(token_slot, bucket(NUM_SLOTS + 1, 4))
    loss, grads = make_grad_step(tiny_model(), NUM_SLOTS, "gather")(trainable, frozen, batch, plan, None, None)
    expected = {"loss": np.asarray(loss)}
    expected.update({jax.tree_util.keystr(path): np.asarray(leaf)
                     for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]})
    results = np.load(out)
    for name in ("gspmd", "shard_map"):
        for key, want in expected.items():
            np.testing.assert_allclose(results[f"{name}/{key}"], want, rtol=5e-5, atol=5e-5 * np.abs(want).max(),
                                       err_msg=f"{name} {key}")
