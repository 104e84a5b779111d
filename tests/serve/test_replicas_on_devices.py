"""Runs the replica tests on simulated devices (tests/serve/multidevice) in a subprocess."""

from tests.multidevice import SKIP, run_on_eight_devices


@SKIP
def test_replicas_on_simulated_devices():
    run_on_eight_devices("tests/serve/multidevice", timeout=600)
