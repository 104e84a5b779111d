"""The matmul-only floor of one decode step, and how the layers' weights should reach the GEMMs.

A decode step of a Llama model is, at its core, every layer's seven projections and the LM head
applied to `rows` tokens. `matmul_step_ms` times exactly that (no attention, no norms, one jitted
function) for a model shape, so the serving benchmark can state its engine step against it in the
same run. `--layouts` also times the same GEMMs with the weights held three ways (per-layer
arrays; static slices of stacked [L, ...] arrays in an unrolled loop; `lax.scan` over the stack),
which says whether the serving step may keep the model's stacked weights.

    python3 bench/decode_floor.py --rows 32 64 256 --layouts --out bench/results/decode_floor_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp

from bench.timing import copy_bandwidth, median_call_seconds
from jaxlora.nn.model_config import LlamaConfig
from jaxlora.models.presets import llama8b_config

PROJECTION_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_dims(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}


def random_layers(config: LlamaConfig, dtype=jnp.bfloat16, seed: int = 0) -> list[dict[str, jax.Array]]:
    """One dict of [in, out] kernels per layer (separate arrays)."""
    dims = projection_dims(config)
    key = jax.random.key(seed)
    layers = []
    for layer in range(config.num_layers):
        weights = {}
        for name in PROJECTION_ORDER:
            key, sub = jax.random.split(key)
            weights[name] = (jax.random.normal(sub, dims[name], jnp.float32) * 0.02).astype(dtype)
        layers.append(weights)
    return layers


def layer_gemms(weights: dict, hidden: jax.Array) -> jax.Array:
    """One layer's seven GEMMs in their data order (attention replaced by q itself)."""
    q = hidden @ weights["q_proj"]
    kv = (hidden @ weights["k_proj"]).sum() + (hidden @ weights["v_proj"]).sum()
    hidden = hidden + q @ weights["o_proj"] + kv.astype(hidden.dtype) * 0
    gated = jax.nn.silu(hidden @ weights["gate_proj"]) * (hidden @ weights["up_proj"])
    return hidden + gated @ weights["down_proj"]


@jax.jit
def step_separate(layers, head, hidden):
    for weights in layers:
        hidden = layer_gemms(weights, hidden)
    return hidden @ head


@jax.jit
def step_stacked_unrolled(stacked, head, hidden):
    for layer in range(stacked["q_proj"].shape[0]):
        hidden = layer_gemms({name: w[layer] for name, w in stacked.items()}, hidden)
    return hidden @ head


@jax.jit
def step_stacked_scan(stacked, head, hidden):
    hidden, _ = jax.lax.scan(lambda h, w: (layer_gemms(w, h), None), hidden, stacked)
    return hidden @ head


def weight_bytes(layers, head) -> int:
    return sum(w.nbytes for weights in layers for w in weights.values()) + head.nbytes


def matmul_step_ms(layers, head, rows: int, fn=step_separate) -> float:
    """Milliseconds of one decode step's GEMMs for `rows` tokens (median of back-to-back calls)."""
    hidden = jax.random.normal(jax.random.key(rows), (rows, head.shape[0]), jnp.float32).astype(head.dtype)
    fn(layers, head, hidden).block_until_ready()
    return 1e3 * median_call_seconds(lambda: fn(layers, head, hidden), repeats=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64, 256])
    parser.add_argument("--layers", type=int, default=32, help="decoder layers of the 8B shape (stated)")
    parser.add_argument("--tiny", action="store_true", help="the tiny CPU smoke-test shape")
    parser.add_argument("--layouts", action="store_true", help="also stacked-unrolled and scanned weights")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = llama8b_config(args.layers, args.tiny)
    layers = random_layers(config)
    head = (jax.random.normal(jax.random.key(1), (config.hidden_size, config.vocab_size)) * 0.02).astype(jnp.bfloat16)
    bandwidth = copy_bandwidth(4 << 30) / 1e12  # TB/s, bytes read + written
    nbytes = weight_bytes(layers, head)
    floor_ms = nbytes / (bandwidth * 1e12) * 1e3
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
              "model": "tiny" if args.tiny else "llama-3.1-8b shape", "num_layers": config.num_layers, "weight_bytes": nbytes,
              "copy_tb_s": bandwidth, "weight_read_floor_ms": floor_ms, "rows": {}}
    stacked = None
    if args.layouts:
        stacked = {name: jnp.stack([weights[name] for weights in layers]) for name in PROJECTION_ORDER}
    print(f"{result['device']}  jax {jax.__version__}  {config.num_layers} layers  weights {nbytes / 1e9:.2f} GB  "
          f"copy {bandwidth:.2f} TB/s  floor {floor_ms:.2f} ms")
    for rows in args.rows:
        entry = {"separate_ms": matmul_step_ms(layers, head, rows)}
        if stacked is not None:
            entry["stacked_unrolled_ms"] = matmul_step_ms(stacked, head, rows, step_stacked_unrolled)
            entry["stacked_scan_ms"] = matmul_step_ms(stacked, head, rows, step_stacked_scan)
        result["rows"][rows] = entry
        print(f"rows {rows:4d}: " + "  ".join(f"{k} {v:.2f}" for k, v in entry.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
