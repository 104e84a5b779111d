"""Runs the 8-device training tests (tests/train/multidevice) in a subprocess."""

from tests.multidevice import SKIP, run_on_eight_devices


@SKIP
def test_training_on_eight_simulated_devices():
    run_on_eight_devices("tests/train/multidevice")
