"""Logical axis names of the model's weights and of the adapter pool's arrays, and the
`ShardingRules` table that maps them onto mesh axes (MaxText / jax-llm-examples style).

Only names live here (no mesh, no devices), so the adapter pool can place its arrays by the same
table as the model; `jaxlora.sharding` builds the mesh and places arrays with these specs."""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

# (input axis, output axis) of each projection's kernel [in, out].
PROJECTION_AXES = {
    "q_proj": ("embed", "q_heads"),
    "k_proj": ("embed", "kv_heads"),
    "v_proj": ("embed", "kv_heads"),
    "o_proj": ("q_heads", "embed"),
    "gate_proj": ("embed", "mlp"),
    "up_proj": ("embed", "mlp"),
    "down_proj": ("mlp", "embed"),
}


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis (None: replicated). `pipelined()` puts the layer axis on `stage`."""

    batch: str | None = "data"
    length: str | None = None
    layers: str | None = None
    embed: str | None = None
    q_heads: str | None = "tensor"
    kv_heads: str | None = "tensor"
    mlp: str | None = "tensor"
    vocab: str | None = "tensor"
    slots: str | None = None
    rank: str | None = None

    def spec(self, logical_axes: tuple[str | None, ...]) -> P:
        return P(*(None if axis is None else getattr(self, axis) for axis in logical_axes))

    def pipelined(self) -> "ShardingRules":
        return dataclasses.replace(self, layers="stage")


def weight_axes(name: str) -> tuple[str, ...]:
    """Logical axes of the model weight `name` (a key of `Llama.weights`)."""
    if name == "embed_tokens":
        return ("vocab", "embed")
    if name == "lm_head":
        return ("embed", "vocab")
    if name == "norm":
        return ("embed",)
    module, _, kind = name.removeprefix("layers.").partition(".")
    if module in ("q_norm", "k_norm"):  # per-head norms [L, head_dim] (Qwen3): replicated
        return ("layers", None)
    if not kind:  # a per-layer norm
        return ("layers", "embed")
    fan_in, fan_out = PROJECTION_AXES[module]
    return ("layers", fan_in, fan_out) if kind == "kernel" else ("layers", fan_out)


def pool_axes(module: str, key: str) -> tuple[str, ...]:
    """Logical axes of a pool array (S-LoRA: A shares the kernel's input axis, B its output axis)."""
    fan_in, fan_out = PROJECTION_AXES[module]
    return {"a": ("layers", "slots", fan_in, "rank"), "b": ("layers", "slots", "rank", fan_out),
            "scale": ("layers", "slots"), "rank": ("layers", "slots")}[key]


def slot_axes(module: str, key: str) -> tuple[str, ...]:
    """Logical axes of one slot's values (a pool array's axes without the slot axis)."""
    return tuple(axis for axis in pool_axes(module, key) if axis != "slots")
