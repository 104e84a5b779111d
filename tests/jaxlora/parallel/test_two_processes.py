"""Two processes on this machine (jax.distributed on CPU, coordinator on 127.0.0.1, 4 devices each)
run the sharded training steps and agree with one device."""

import os
import sys

import jax
import numpy as np

from jaxlora.buckets import bucket
from jaxlora.lora.plan import build_plan
from jaxlora.lora.trainable import split_pool
from jaxlora.parallel.grad_step import make_grad_step
from tests.jaxlora.parallel.fixtures import NUM_SLOTS, packed_batch, random_pool, tiny_model
from tests.multidevice import ROOT, SKIP, free_port, run_processes


@SKIP
def test_two_processes_match_one_device(tmp_path):
    out, port = tmp_path / "results.npz", free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    worker = str(ROOT / "tests/jaxlora/parallel/two_process_worker.py")
    run_processes([[sys.executable, worker, str(pid), str(port), str(out)] for pid in (0, 1)], env)

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
