"""`jaxlora-serve` command-line options reach the engine configuration."""

import pytest

from serve.cli import SERVING_BACKENDS, build_parser


def test_lora_backend_option():
    args = build_parser().parse_args(["--lora-backend", "pallas"])
    assert args.lora_backend == "pallas" and "pallas" in SERVING_BACKENDS
    assert build_parser().parse_args([]).lora_backend == "gather"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--lora-backend", "fused"])
