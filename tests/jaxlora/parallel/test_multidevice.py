"""Runs the 8-device tests (tests/jaxlora/parallel/multidevice) in a subprocess."""

from tests.multidevice import SKIP, run_on_eight_devices


@SKIP
def test_eight_simulated_devices():
    run_on_eight_devices("tests/jaxlora/parallel/multidevice", timeout=900)
