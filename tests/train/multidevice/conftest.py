"""These tests need 8 (simulated) devices: `tests/train/test_multidevice.py` runs them in a
subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8; elsewhere they skip."""

import jax
import pytest


def pytest_collection_modifyitems(config, items):
    if jax.device_count() >= 8:
        return
    skip = pytest.mark.skip(reason="needs 8 devices (run via tests/train/test_multidevice.py)")
    for item in items:
        if "/multidevice/" in str(item.fspath):
            item.add_marker(skip)
