"""These tests need several (simulated) devices: the `test_replicas_on_devices.py` beside this
folder runs them in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8; elsewhere
they skip."""

from tests.multidevice import skip_without_eight_devices


def pytest_collection_modifyitems(config, items):
    skip_without_eight_devices(items)
