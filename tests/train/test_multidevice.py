"""Runs the 8-device training tests (tests/train/multidevice) in a subprocess, since the simulated
device count must be set before jax initialises and would change every other test's devices."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.environ.get("JAXLORA_SKIP_MULTIDEVICE") == "1", reason="JAXLORA_SKIP_MULTIDEVICE=1")
def test_training_on_eight_simulated_devices():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/train/multidevice"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]
