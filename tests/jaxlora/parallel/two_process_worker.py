"""One of two processes of a CPU "multi-host" run: `python two_process_worker.py PROCESS_ID PORT OUT`.

Each process has 4 CPU devices; `jax.distributed.initialize` joins them into 8 global devices.
A (data 2, tensor 4) mesh runs the GSPMD and the shard_map training steps on the fixtures' batch;
process 0 writes the per-slot losses and adapter gradients to OUT (npz) for the test to compare."""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def main(process_id: int, port: int, out_path: str) -> None:
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               local_device_ids=list(range(4)))
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxlora import sharding
    from jaxlora.buckets import bucket
    from jaxlora.lora.plan import build_plan
    from jaxlora.lora.trainable import split_pool
    from jaxlora.parallel.plans import local_plans
    from jaxlora.parallel.grad_step import make_grad_step
    from tests.jaxlora.parallel.fixtures import NUM_SLOTS, packed_batch, random_pool, tiny_model

    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = sharding.make_mesh(data=2, tensor=4)  # data across the processes, tensor inside each
    batch, token_slot = packed_batch(adapters=(0, 1, 2, 3, -1))
    trainable, frozen = split_pool(random_pool())
    num_segments = bucket(NUM_SLOTS + 1, 4)
    model = sharding.shard_model(tiny_model(), mesh)
    pool_t, pool_f = sharding.shard_pool(trainable, mesh), sharding.shard_pool(frozen, mesh)
    gspmd = make_grad_step(model, NUM_SLOTS)(
        pool_t, pool_f, sharding.shard_batch(batch, mesh),
        sharding.shard_plan(build_plan(token_slot, num_segments), mesh), None, None)
    plans = jax.tree.map(lambda leaf: sharding.put(leaf, mesh, P("data")), local_plans(token_slot, 2, num_segments))
    manual = make_grad_step(model, NUM_SLOTS, mesh=mesh)(
        pool_t, pool_f, sharding.shard_batch(batch, mesh), plans)
    gather = jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, P()))
    results = {}
    for name, (loss, grads) in {"gspmd": gspmd, "shard_map": manual}.items():
        loss, grads = gather((loss, grads))
        results[f"{name}/loss"] = np.asarray(loss.addressable_data(0))
        for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
            results[f"{name}/{jax.tree_util.keystr(path)}"] = np.asarray(leaf.addressable_data(0))
    if process_id == 0:
        np.savez(out_path, **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
