"""`--replicas`, `--grow-kv` and `jaxlora-router`'s options: errors name the option."""

import jax
import pytest

from serve import router
from serve.cli import build_parser, replica_devices


def test_replicas_option_errors():
    args = build_parser().parse_args([])
    assert args.replicas == 1 and not args.grow_kv and replica_devices(1, 1) is None
    assert build_parser().parse_args(["--replicas", "2", "--grow-kv"]).grow_kv
    too_many = jax.device_count() + 1
    with pytest.raises(SystemExit, match=f"--replicas {too_many} needs {too_many} devices"):
        replica_devices(too_many, 1)
    with pytest.raises(SystemExit, match="--replicas must be >= 1"):
        replica_devices(0, 1)
    with pytest.raises(SystemExit, match="--replicas and --tensor-parallel cannot be combined"):
        replica_devices(2, 2)


def test_router_options():
    args = router.build_parser().parse_args(["--backend", "http://127.0.0.1:9", "--backend", "http://127.0.0.1:10/"])
    assert args.host == "127.0.0.1" and args.backend == ["http://127.0.0.1:9", "http://127.0.0.1:10/"]
    assert [b.url for b in router.Router(args.backend).backends] == ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    with pytest.raises(SystemExit):
        router.build_parser().parse_args([])  # --backend is required
    with pytest.raises(SystemExit, match="--queue-timeout must be > 0"):
        router.main(["--backend", "http://127.0.0.1:9", "--queue-timeout", "0"])
    with pytest.raises(ValueError, match="at least one backend"):
        router.Router([])
