"""Multi-adapter training: together equals alone; killed-and-resumed equals uninterrupted."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from train.config import load_train_config
from train.trainer import Trainer

JOBS = """\
base_model: {model}
output_dir: {out}
capacity: {capacity}
checkpoint_every: {every}
solver_time_limit: 0.2
progress: false
jobs:
  - name: last_word
    dataset: {data[last_word]}
    lora: {{r: 4, alpha: 8, targets: [q_proj, v_proj]}}
    learning_rate: 3.0e-3
    global_batch_size: 4
    steps: {steps}
    seed: 1
  - name: repeat_twice
    dataset: {data[repeat_twice]}
    lora: {{r: 8, alpha: 8, targets: [q_proj, k_proj, down_proj], use_rslora: true}}
    learning_rate: 1.0e-3
    schedule: cosine
    global_batch_size: 5
    steps: {steps}
    seed: 2
  - name: count_words
    dataset: {data[count_words]}
    lora: {{r: 16, alpha: 16, targets: [v_proj, o_proj, gate_proj, up_proj]}}
    learning_rate: 2.0e-3
    schedule: linear
    warmup_steps: 1
    global_batch_size: 3
    steps: {steps}
    seed: 3
"""


def _config(tmp_path, tiny_model_dir, datasets, name, capacity=128, every=3, steps=4, jobs=None):
    path = tmp_path / f"{name}.yaml"
    path.write_text(JOBS.format(model=tiny_model_dir, out=tmp_path / name, capacity=capacity, every=every,
                                steps=steps, data=datasets))
    config = load_train_config(str(path))
    if jobs is not None:
        import dataclasses
        config = dataclasses.replace(config, jobs=tuple(config.jobs[i] for i in jobs))
    return config, str(path)


def test_together_equals_alone(tmp_path, tiny_model_dir, datasets):
    config, _ = _config(tmp_path, tiny_model_dir, datasets, "together")
    together = Trainer(config)
    together.run()
    for index, adapter in enumerate(together.adapters()):
        alone_config, _ = _config(tmp_path, tiny_model_dir, datasets, f"alone{index}", jobs=[index])
        alone = Trainer(alone_config)
        alone.run()
        (expected,) = alone.adapters()
        for module, weights in expected.modules.items():
            trained = adapter.modules[module]
            assert np.abs(weights.b).max() > 0  # it did train
            np.testing.assert_allclose(trained.a, weights.a, rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(trained.b, weights.b, rtol=1e-4, atol=1e-6)


def _metrics(out_dir, job):
    with open(os.path.join(out_dir, job, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _train_cli(config_path, *extra):
    return [sys.executable, "-m", "train", config_path, *extra]


def test_sigkill_and_resume_gives_the_same_losses(tmp_path, tiny_model_dir, datasets):
    steps = 12
    _, reference_path = _config(tmp_path, tiny_model_dir, datasets, "reference", steps=steps, every=2)
    subprocess.run(_train_cli(reference_path), check=True, capture_output=True, timeout=600)
    _, killed_path = _config(tmp_path, tiny_model_dir, datasets, "killed", steps=steps, every=2)
    checkpoints = tmp_path / "killed" / "checkpoints"
    process = subprocess.Popen(_train_cli(killed_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        if checkpoints.exists() and any(p.name.isdigit() and int(p.name) >= 4 for p in checkpoints.iterdir()):
            break
        time.sleep(0.05)
    assert process.poll() is None, "training finished before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = len(_metrics(tmp_path / "killed", "last_word"))
    subprocess.run(_train_cli(killed_path, "--resume"), check=True, capture_output=True, timeout=600)
    for job in ("last_word", "repeat_twice", "count_words"):
        expected = [m["loss"] for m in _metrics(tmp_path / "reference", job)]
        resumed = [m["loss"] for m in _metrics(tmp_path / "killed", job)]
        assert len(expected) == steps
        assert resumed == expected, f"{job}: killed after {killed_at} steps"
