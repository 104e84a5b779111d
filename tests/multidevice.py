"""Helpers of the tests that need several (simulated) devices or processes: the 8-device tests run
in a subprocess (the simulated device count must be set before jax initialises, and would change
every other test's devices), and skip when collected anywhere else."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKIP = pytest.mark.skipif(os.environ.get("JAXLORA_SKIP_MULTIDEVICE") == "1", reason="JAXLORA_SKIP_MULTIDEVICE=1")


def run_on_eight_devices(test_dir: str, timeout: int = 1200) -> None:
    """Runs pytest on `test_dir` (relative to the repository) with 8 simulated CPU devices."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_dir],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]


def skip_without_eight_devices(items) -> None:
    """For a multidevice/ conftest: skips its tests unless 8 devices are there."""
    if jax.device_count() >= 8:
        return
    skip = pytest.mark.skip(reason="needs 8 devices (run through the test_multidevice.py beside the folder)")
    for item in items:
        if "/multidevice/" in str(item.fspath):
            item.add_marker(skip)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_processes(commands: list[list[str]], env: dict, timeout: int = 600) -> None:
    """Starts every command at once in the repository and asserts that all exit with 0."""
    workers = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True) for command in commands]
    try:
        logs = [worker.communicate(timeout=timeout)[0] for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    assert all(worker.returncode == 0 for worker in workers), "\n".join(log[-3000:] for log in logs)
