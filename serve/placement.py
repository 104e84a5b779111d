"""Where the serving engine's weights and KV pages live: the model it serves (packed projections and the
adapter window's columns, or a tensor-parallel copy) and its zeroed KV page pool.

Tensor parallel: `Engine(..., mesh=jaxlora.sharding.make_mesh(tensor=N, devices=...))` places a
copy of the weights Megatron-style (`jaxlora.sharding.shard_model`; the caller's model is not
moved), the adapter pool S-LoRA-style (`AdapterPool(mesh=...)`: slot loads keep the placement),
and the KV pages split by KV heads; the step's token, plan and sampling arrays are host arrays
that jit replicates. The same jitted step then runs under GSPMD, XLA inserting the all-reduces of
o_proj/down_proj and the gathers over the vocabulary. A `pallas_call` has no SPMD partitioning
rule, so with tensor > 1 only the LoRA backends GSPMD can partition (plain XLA ops; the
registry's `partitionable`, `jaxlora.lora.backends`) are accepted (`check_mesh`).
"""

from __future__ import annotations

import enum
import functools

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxlora import sharding
from jaxlora.lora import backends
from jaxlora.lora.backends import LoraBackend
from jaxlora.lora.compressed import SharedBasisSet
from jaxlora.nn.model_config import PROJECTIONS
from jaxlora.models.llama import Llama
from jaxlora.models.packed import AdapterWindow, add_adapter_window, pack_projections, window_layout
from jaxlora.models.paged import PagedKVCache
from jaxlora.weights.fill import remake_zeros

from serve.engine_config import EngineConfig


class Handover(enum.Enum):
    """What an `Engine` may do with the model it is given (decided by its caller, once).

    KEEP: the caller's model stays usable (tests and benchmarks build several engines on one model).
    ZEROS: the caller drops it and every weight is a zero placeholder to be written later
      (`serve.warm_start`): once the engine's layout is final, the given arrays it replaced (the
      packed kernels the adapter window widens, the stacks split layers copy: 9-14 GB of an 8B
      model otherwise held by the caller) are deleted and the engine's own are made again side by
      side, before the KV pages are sized from the free memory, so that the holes the copies left
      do not split the free memory the KV pool's few large arrays need. (A loaded model's arrays
      cannot be remade as zeros: its holes would stay, so its caller keeps it.)"""

    KEEP = "keep"
    ZEROS = "zeros"


def hand_over(given: Llama, served: Llama, handover: Handover) -> None:
    """Applies `handover` (see `Handover`) once `served`, the engine's model made from `given`, is
    final: with ZEROS, deletes `given`'s arrays that `served` does not hold and remakes `served`'s
    weights as zeros after deleting them all."""
    if handover is Handover.KEEP:
        return
    kept = {id(array) for array in jax.tree.leaves(nnx.state(served))}
    for array in jax.tree.leaves(nnx.state(given)):
        if isinstance(array, jax.Array) and id(array) not in kept and not array.is_deleted():
            array.delete()
    remake_zeros(served.weights)


def check_mesh(mesh: Mesh, model_config, lora_backend: LoraBackend | str) -> None:
    """ValueError unless the engine can serve on `mesh`: a `tensor` axis and no other axis > 1, a
    LoRA backend GSPMD can partition when tensor > 1, and heads, KV heads, FFN width and vocabulary
    that split evenly over `tensor`."""
    shape = dict(mesh.shape)
    if "tensor" not in shape or any(size > 1 for axis, size in shape.items() if axis != "tensor"):
        raise ValueError(f"the engine shards over a mesh's `tensor` axis only (jaxlora.sharding.make_mesh("
                         f"tensor=N)); got mesh axes {shape}")
    if shape["tensor"] > 1:
        backends.get(lora_backend, serves=True, partitionable=True)
    sharding.check_divisible(model_config, mesh)


def serving_model(model: Llama, config: EngineConfig, mesh: Mesh | None,
                  compressed: SharedBasisSet | None) -> tuple[Llama, AdapterWindow | None, int]:
    """(the model the engine serves, its adapter window's layout or None, the window's slots): with a
    `mesh`, a copy placed over it (new Variables over the same arrays, then placed: the caller's
    model keeps its weights); else `model` with q/k/v and gate/up packed into one kernel each (4
    GEMMs a layer instead of 7) and, when `config.adapter_window` asks and no compressed
    collection is served, the window's columns added (`jaxlora.models.packed`)."""
    if mesh is not None:
        check_mesh(mesh, model.config, config.backend)
        model = sharding.shard_model(nnx.clone(model), mesh)
    else:
        model = pack_projections(model)
    layout = None
    window = min(config.adapter_window or 0, config.max_adapters_on_device)
    if window and mesh is None and compressed is None:
        layout = window_layout(model.config, window, config.max_lora_rank, config.lora_target_modules or PROJECTIONS)
        add_adapter_window(model, layout)
    return model, layout, window


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _placed_zeros_cache(config, num_pages, page_size, dtype, placement):
    return jax.lax.with_sharding_constraint(PagedKVCache.zeros(config, num_pages, page_size, dtype), placement)


def new_kv_cache(model_config, num_pages: int, page_size: int, dtype, mesh: Mesh | None) -> PagedKVCache:
    """Zeroed KV pages [L, num_pages, page_size, Hkv, Dh] (keys and values); with a mesh, made in
    place split by KV heads."""
    sizes = (model_config, num_pages, page_size, dtype)
    if mesh is None:
        return PagedKVCache.zeros(*sizes)
    return _placed_zeros_cache(*sizes, NamedSharding(mesh, sharding.ShardingRules().spec(sharding.KV_CACHE_AXES)))


def abstract_state(state):
    """`state` (a pytree of arrays, e.g. the engine's nnx weights) as `jax.ShapeDtypeStruct`s that
    lower to the same programs: a committed array's with its sharding, an uncommitted one's
    without (a sharding there would make the program's argument committed: another program)."""
    def abstract(array):
        committed = getattr(array, "_committed", True)
        return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=array.sharding if committed else None)

    return jax.tree.map(abstract, state)
