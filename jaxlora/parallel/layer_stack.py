"""The decoder layers under `jax.shard_map`: Megatron tensor parallel with S-LoRA adapters, data
parallel, and a GPipe pipeline over `stage`.

Inside the map each tensor shard holds num_heads / tensor heads and intermediate / tensor FFN
columns, so `decoder_layer` runs on a config with local head counts; the row-parallel o_proj and
down_proj outputs are partial sums, and their LoRA deltas (x_shard @ A_rows @ B) are added to
those partial sums before the one all-reduce (`psum` over `tensor`) that Megatron needs anyway.
Column-parallel layers compute x @ A replicated and multiply by their B column block, so they
need no communication. Any LoRA backend runs here, Pallas kernels included (a `pallas_call`
has no SPMD rule, so it cannot run under plain GSPMD). LoRA dropout is not supported here: its
hash is over global (row, column) indices (the GSPMD path in `jaxlora.sharding` supports it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxlora.lora.backends import LoraBackend
from jaxlora.lora.plan import LoraPlan
from jaxlora.nn.model_config import LlamaConfig
from jaxlora.lora.project import layer_lora
from jaxlora.models.llama import LoraInputs, PackedAttention, decoder_layer
from jaxlora.nn.axes import ShardingRules, weight_axes
from jaxlora.sharding import ROW_PARALLEL, pool_specs


def _check_vma(backend: LoraBackend, plans: LoraPlan) -> bool:
    """Custom (Pallas) kernels declare no varying-axes type for their outputs, so a map that runs
    one on `plans` runs unchecked."""
    return not backend.for_plan(plans).custom_kernel


def local_config(config: LlamaConfig, mesh: Mesh) -> LlamaConfig:
    tensor = mesh.shape["tensor"]
    return dataclasses.replace(config, num_heads=config.num_heads // tensor,
                               num_kv_heads=config.num_kv_heads // tensor)


def layer_specs(layer_weights: dict, rules: ShardingRules) -> dict:
    return {name: rules.spec(weight_axes(f"layers.{name}")) for name in layer_weights}


def _bias_once(layer_weights: dict) -> dict:
    """Row-parallel biases kept on tensor shard 0 only, so the all-reduce adds them once."""
    first = jax.lax.axis_index("tensor") == 0
    return {name: jnp.where(first, value, 0) if name.split(".")[0] in ROW_PARALLEL and name.endswith(".bias")
            else value for name, value in layer_weights.items()}


def run_local_layers(config, layer_weights, pool, hidden, positions, mask, plan, first_layer, backend: LoraBackend):
    """This shard's layers (scan), with LoRA from `pool` (or None) on this shard's `plan`, computed
    by `backend`."""
    layer_weights = _bias_once(layer_weights)

    def reduce_partial(partial):
        return jax.lax.psum(partial, "tensor")

    def layer(hidden, per_layer):
        weights, layer_pool, index = per_layer
        lora_context = None if pool is None else layer_lora(LoraInputs(pool, plan), layer_pool, backend, index)
        hidden, _ = decoder_layer(config, weights, hidden, positions, index, PackedAttention(mask), lora_context,
                                  reduce_partial)
        return hidden, None

    num_layers = next(iter(layer_weights.values())).shape[0]
    indices = first_layer + jnp.arange(num_layers)
    hidden, _ = jax.lax.scan(layer, hidden, (layer_weights, pool, indices))
    return hidden


def tensor_parallel_stack(config: LlamaConfig, mesh: Mesh, rules: ShardingRules, backend: LoraBackend):
    """(hidden [B, T, d], positions [B, T], mask [B, T, T], layer weights, pool or None, plans with
    a leading data axis from `local_plans`) -> hidden after all layers; B on `data`."""
    if mesh.shape["stage"] != 1:
        raise ValueError("tensor_parallel_stack runs every layer on each device: use pipeline_stack")
    shard_config = local_config(config, mesh)
    batch_axis = rules.batch

    def body(hidden, positions, mask, layer_weights, pool, plans):
        plan = jax.tree.map(lambda leaf: leaf[0], plans)
        return run_local_layers(shard_config, layer_weights, pool, hidden, positions, mask, plan, 0, backend)

    def stack(hidden, positions, mask, layer_weights, pool, plans: LoraPlan):
        in_specs = (P(batch_axis), P(batch_axis), P(batch_axis), layer_specs(layer_weights, rules),
                    None if pool is None else pool_specs(pool, rules), jax.tree.map(lambda _: P(batch_axis), plans))
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P(batch_axis),
                             check_vma=_check_vma(backend, plans))(
            hidden, positions, mask, layer_weights, pool, plans)

    return stack


def pipeline_stack(config: LlamaConfig, mesh: Mesh, rules: ShardingRules, backend: LoraBackend):
    """GPipe over `stage` (layers split in contiguous groups), with tensor and data parallel inside.

    (hidden [M, B, T, d], positions [M, B, T], mask [M, B, T, T], layer weights, pool or None,
    plans with leaves [M, data, ...]) -> hidden after all layers [M, B, T, d]. At step t stage s
    runs microbatch t - s and passes its output to stage s + 1 with `ppermute`; M + S - 1 steps.
    The backward pass is the transpose of this loop (all forwards, then all backwards)."""
    rules = rules.pipelined()
    num_stages = mesh.shape["stage"]
    shard_config = local_config(config, mesh)
    batch_axis = rules.batch
    to_next = [(stage, (stage + 1) % num_stages) for stage in range(num_stages)]

    def body(hidden_mb, positions_mb, mask_mb, layer_weights, pool, plans):
        stage = jax.lax.axis_index("stage")
        num_microbatches = hidden_mb.shape[0]
        layers_here = next(iter(layer_weights.values())).shape[0]

        def step(carry, t):
            received, outputs = carry
            micro = jnp.clip(t - stage, 0, num_microbatches - 1)
            inputs = jnp.where(stage == 0, hidden_mb[jnp.clip(t, 0, num_microbatches - 1)], received)
            plan = jax.tree.map(lambda leaf: leaf[micro, 0], plans)
            out = run_local_layers(shard_config, layer_weights, pool, inputs, positions_mb[micro], mask_mb[micro],
                                   plan, stage * layers_here, backend)
            finished = t - (num_stages - 1)
            record = (stage == num_stages - 1) & (finished >= 0)
            outputs = jnp.where(record, outputs.at[jnp.clip(finished, 0, num_microbatches - 1)].set(out), outputs)
            return (jax.lax.ppermute(out, "stage", to_next), outputs), None

        start = jax.lax.pcast(jnp.zeros_like(hidden_mb), "stage", to="varying")
        (_, outputs), _ = jax.lax.scan(step, (start[0], start), jnp.arange(num_microbatches + num_stages - 1))
        return outputs[None]

    def stack(hidden, positions, mask, layer_weights, pool, plans: LoraPlan):
        micro = P(None, batch_axis)
        in_specs = (micro, micro, micro, layer_specs(layer_weights, rules),
                    None if pool is None else pool_specs(pool, rules), jax.tree.map(lambda _: micro, plans))
        per_stage = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P("stage", None, batch_axis),
                                  check_vma=_check_vma(backend, plans))(
            hidden, positions, mask, layer_weights, pool, plans)
        return per_stage[-1]

    return stack
