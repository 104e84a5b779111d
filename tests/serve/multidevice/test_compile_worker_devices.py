"""The compile worker's arguments on a mesh (8 simulated devices): a NamedSharding reaches the child
as device ids, axes and partition spec, and is rebuilt over the same devices."""

import pickle

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from serve.compile_worker import abstract, concrete


def test_named_shardings_are_rebuilt_over_the_same_devices():
    devices = np.array(jax.devices()[:8])[::-1].reshape(2, 4)  # an order of its own
    mesh = Mesh(devices, ("data", "model"))
    sharded = jax.device_put(np.zeros((4, 8), np.float32), NamedSharding(mesh, PartitionSpec(None, "model")))
    spec = jax.ShapeDtypeStruct((6, 8), np.float32, sharding=NamedSharding(mesh, PartitionSpec("data")))
    rebuilt = concrete(pickle.loads(pickle.dumps(abstract((sharded, spec)))))
    assert rebuilt[0].sharding == sharded.sharding and rebuilt[0].shape == (4, 8)
    assert rebuilt[1].sharding == spec.sharding
    assert [d.id for d in rebuilt[0].sharding.mesh.devices.flat] == [d.id for d in devices.flat]
