"""The mesh facts of the LoRA backend registry (`jaxlora.lora.backends`, the other facts are in
tests/jaxlora/lora/test_backends.py): a backend declared GSPMD-partitionable gives the one-device
delta under a 2-device mesh with the pool placed S-LoRA-style; every other backend is refused by
the engine's `check_mesh` with tensor > 1."""

import jax
import numpy as np
import pytest

from jaxlora import sharding
from jaxlora.lora import backends
from jaxlora.lora.plan import build_plan
from serve.engine import check_mesh
from tests.jaxlora.hf_checkpoints import relative_error
from tests.jaxlora.parallel.fixtures import CONFIG, random_pool

# Column-parallel (B split by output columns) and row-parallel (A split by input rows) projections.
MODULES = ("q_proj", "o_proj", "down_proj")


def _mesh(tensor=2):
    return sharding.make_mesh(tensor=tensor, devices=jax.devices()[:tensor])


@pytest.mark.parametrize("name", backends.names(partitionable=True))
def test_partitionable_backend_runs_under_a_gspmd_mesh(name):
    backend, mesh = backends.get(name), _mesh()
    check_mesh(mesh, CONFIG, name)  # the engine accepts it
    pool = {module: random_pool()[module] for module in MODULES}
    placed = sharding.shard_pool(pool, mesh)
    token_slot = np.random.default_rng(0).integers(-1, 4, 24).astype(np.int32)
    plan = build_plan(token_slot)
    delta = jax.jit(lambda x, module_pool: backend.delta(x, {key: v[0] for key, v in module_pool.items()}, plan))
    for module in MODULES:
        x = np.random.default_rng(1).normal(size=(token_slot.size, pool[module]["a"].shape[2])).astype(np.float32)
        got = delta(x, placed[module])
        assert got.sharding.num_devices == 2, module
        assert relative_error(got, delta(x, pool[module])) <= 1e-5, module


@pytest.mark.parametrize("name", backends.names(partitionable=False))
def test_other_backends_are_refused_tensor_parallel(name):
    with pytest.raises(ValueError, match=", ".join(backends.names(serves=True, partitionable=True))):
        check_mesh(_mesh(), CONFIG, name)
    check_mesh(_mesh(tensor=1), CONFIG, name)  # one device: any backend
