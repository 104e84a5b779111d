"""Device mesh and the placement of a Llama, its adapter pool, batches and plans on it.

One `jax.sharding.Mesh` with the axes `data` (batch), `stage` (pipeline: groups of layers) and
`tensor` (Megatron tensor parallel). Every weight and pool array has logical axis names
(`jaxlora.nn.axes`: `weight_axes`, `pool_axes`); a `ShardingRules` table maps them to mesh
axes (MaxText / jax-llm-examples style), so one table decides the layout of everything.

Tensor parallel: column-parallel q, k, v, gate, up (kernel output dim on `tensor`), row-parallel
o, down (kernel input dim on `tensor`). The LoRA pool follows S-LoRA by reusing the kernel's
axes: A [k, r] takes the kernel's input axis and B [r, n] its output axis, so column-parallel
layers split B by output columns (x @ A is computed replicated) and row-parallel layers split A
by input rows (the partial x @ A @ B is summed with the base layer's partial sums).

Inputs placed here make `jaxlora.parallel.grad_step.make_grad_step` (mesh=None) the GSPMD path: jit
with sharded inputs, XLA inserts the collectives. Custom kernels (a `pallas_call` has no SPMD
rule) run under `jax.shard_map` (the same factory with a mesh).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxlora.lora.plan import LoraPlan
from jaxlora.nn.axes import ShardingRules, pool_axes, weight_axes
from jaxlora.nn.model_config import LlamaConfig
from jaxlora.models.llama import Llama

MESH_AXES = ("data", "stage", "tensor")
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def make_mesh(data: int = 1, stage: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A (data, stage, tensor) mesh over `devices` (default: all, over every process)."""
    devices = jax.devices() if devices is None else devices
    size = data * stage * tensor
    if size != len(devices):
        raise ValueError(f"mesh {data}x{stage}x{tensor} needs {size} devices, have {len(devices)}")
    grid = np.asarray(devices, dtype=object).reshape(data, stage, tensor)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def check_divisible(config: LlamaConfig, mesh: Mesh) -> None:
    """Raises ValueError unless heads, KV heads, FFN width and layers split evenly on the mesh."""
    tensor, stage = mesh.shape["tensor"], mesh.shape["stage"]
    sizes = {"num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads,
             "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
    for name, size in sizes.items():
        if size % tensor:
            raise ValueError(f"{name}={size} does not split over tensor={tensor}")
    if config.num_layers % stage:
        raise ValueError(f"num_layers={config.num_layers} does not split over stage={stage}")


# The paged KV cache k, v [layers, pages, page_size, kv_heads, head_dim]: split by KV heads, so
# each tensor shard keeps the keys/values of the heads its column-parallel k/v projections compute.
KV_CACHE_AXES = ("layers", None, None, "kv_heads", None)


def weight_specs(model: Llama, rules: ShardingRules) -> dict[str, P]:
    return {name: rules.spec(weight_axes(name)) for name in model.weights}


def pool_specs(pool_arrays: dict, rules: ShardingRules) -> dict:
    return {m: {k: rules.spec(pool_axes(m, k)) for k in arrays} for m, arrays in pool_arrays.items()}


def put(value, mesh: Mesh, spec: P) -> jax.Array:
    """`value` as a global array with `spec` on `mesh`; every process passes the same value."""
    sharding = NamedSharding(mesh, spec)
    if isinstance(value, jax.Array) and value.is_fully_addressable and jax.process_count() == 1:
        return jax.device_put(value, sharding)  # device to device, no host round trip
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_model(model: Llama, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> Llama:
    """Moves every weight of `model` (in place) to its sharding on `mesh`; returns the model."""
    check_divisible(model.config, mesh)
    for name, spec in weight_specs(model, rules).items():
        model.weights[name].set_value(put(model.weights[name][...], mesh, spec))
    return model


def shard_pool(pool_arrays: dict, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> dict:
    """An adapter pool's arrays ({module: {a, b, scale, rank}} or a subset) placed on `mesh`."""
    specs = pool_specs(pool_arrays, rules)
    return {m: {k: put(v, mesh, specs[m][k]) for k, v in arrays.items()} for m, arrays in pool_arrays.items()}


def shard_batch(batch: dict, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> dict:
    """[B, T] batch arrays with B on the data axis."""
    return {key: put(value, mesh, rules.spec(("batch", "length"))) for key, value in batch.items()}


def shard_plan(plan: LoraPlan, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> LoraPlan:
    """A global plan: token_slot split like the flattened batch, the grouping arrays replicated."""
    return LoraPlan(put(plan.token_slot, mesh, rules.spec(("batch",))),
                    *(put(value, mesh, P()) for value in plan[1:]))


def replicate(value, mesh: Mesh) -> jax.Array:
    return put(value, mesh, P())

