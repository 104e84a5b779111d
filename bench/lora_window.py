"""Design probe: LoRA shrink folded into the base GEMMs (an "adapter window" of A columns appended
to packed weights) vs the base step, on the matmuls of one decode step.

The serving step's LoRA cost on a decode step is launch latency, not bytes (bench/NOTES_serve.md:
8 BGMV launches a layer, +1.9 ms on a 5.7 ms step at 32 rows, 2.8x the adapter-bytes floor). This
probe times the alternative before building it: each layer's projections packed by input
(qkv, o, gate_up, down: 4 GEMMs instead of 7), each packed kernel followed by the A columns of a
window of W adapter slots ([k, n + G*W*r]: the shrink of every window adapter comes out of the base
GEMM), then one expand GEMM per group of the masked shrink (each row keeps its own slot's r
columns, scaled) against the group's block-diagonal B [G*W*r, n], added to the base output.

Variants (one jitted function each, 32 unrolled layers + LM head, bf16, no attention):
  separate    7 GEMMs a layer (bench/decode_floor.py's matmul-only step)
  packed      4 packed GEMMs a layer, no LoRA (W = 0)
  window_W    packed + the window of W slots (rows spread over the W slots)

    python3 bench/lora_window.py --rows 32 64 2048 --windows 1 8 16 64 --out bench/results/lora_window_h200.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json

import jax
import jax.numpy as jnp
import numpy as np

from bench.decode_floor import layer_gemms, projection_dims, random_layers, step_separate
from bench.timing import median_call_seconds
from jaxlora.nn.model_config import LlamaConfig
from jaxlora.models.presets import llama8b_config

GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}


def packed_layer(weights: dict, dims: dict, window: int, rank: int, key) -> dict:
    """One layer packed by group: "<group>" [k, n_group + G*W*r] (base kernels side by side, then
    each projection's window A), "<group>.b" [G*W*r, n_group] block-diagonal window B."""
    packed = {}
    for group, names in GROUPS.items():
        k = dims[names[0]][0]
        outs = [dims[name][1] for name in names]
        columns = [weights[name] for name in names]
        if window:
            key, ka, kb = jax.random.split(key, 3)
            a = jax.random.normal(ka, (k, len(names) * window * rank), jnp.float32) / np.sqrt(k)
            columns.append(a.astype(jnp.bfloat16))
            b = np.zeros((len(names) * window * rank, sum(outs)), np.float32)
            offset = 0
            for g, n in enumerate(outs):
                rows = slice(g * window * rank, (g + 1) * window * rank)
                b[rows, offset:offset + n] = np.asarray(jax.random.normal(jax.random.fold_in(kb, g), (window * rank, n))) * 0.01
                offset += n
            packed[f"{group}.b"] = jnp.asarray(b, jnp.bfloat16)
        packed[group] = jnp.concatenate(columns, axis=1)
    return packed


def window_mask(rows: int, window: int, rank: int, groups: int) -> jax.Array:
    """[rows, G*W*r] float32: row t keeps its slot's r columns (slot t % W) of each projection, scaled."""
    slot = np.arange(rows) % max(window, 1)
    per_projection = (np.arange(window * rank)[None, :] // rank == slot[:, None]) * 2.0
    return jnp.asarray(np.tile(per_projection, (1, groups)), jnp.float32)


def project_group(hidden, packed: dict, group: str, n: int, masks: dict):
    """hidden @ packed kernel; with a window, + the masked shrink @ block-diagonal B. [T, n] f32."""
    out = jnp.dot(hidden, packed[group], preferred_element_type=jnp.float32)
    y = out[:, :n]
    if f"{group}.b" in packed:
        shrink = (out[:, n:] * masks[group]).astype(jnp.bfloat16)
        y = y + jnp.dot(shrink, packed[f"{group}.b"], preferred_element_type=jnp.float32)
    return y


def packed_layer_gemms(packed: dict, hidden, dims: dict, masks: dict):
    """`layer_gemms` with packed weights (and the window's LoRA)."""
    n_q, n_kv = dims["q_proj"][1], dims["k_proj"][1]
    qkv = project_group(hidden, packed, "qkv", n_q + 2 * n_kv, masks)
    q, kv = qkv[:, :n_q], qkv[:, n_q:].sum()
    hidden = hidden + (project_group(q.astype(hidden.dtype), packed, "o", dims["o_proj"][1], masks)
                       + kv * 0).astype(hidden.dtype)
    f = dims["gate_proj"][1]
    gate_up = project_group(hidden, packed, "gate_up", 2 * f, masks)
    gated = (jax.nn.silu(gate_up[:, :f]) * gate_up[:, f:]).astype(hidden.dtype)
    return hidden + project_group(gated, packed, "down", dims["down_proj"][1], masks).astype(hidden.dtype)


def packed_step(layers, head, hidden, masks, dims):
    for packed in layers:
        hidden = packed_layer_gemms(packed, hidden, dims, masks)
    return hidden @ head


def packed_matmul_step_ms(separate: list[dict], head, rows: int, config: LlamaConfig) -> float:
    """Milliseconds of one decode step's GEMMs with packed projections (4 a layer, no window):
    the matmul-only step of the serving engine's own weight layout."""
    dims = projection_dims(config)
    layers = [packed_layer(w, dims, 0, 0, jax.random.key(i)) for i, w in enumerate(separate)]
    hidden = (jax.random.normal(jax.random.key(rows), (rows, config.hidden_size)) * 0.5).astype(jnp.bfloat16)
    step = jax.jit(packed_step, static_argnums=4)
    fn = lambda: step(layers, head, hidden, {}, _Dims(dims))
    fn().block_until_ready()
    return 1e3 * median_call_seconds(fn, repeats=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64, 2048])
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 8, 16, 64])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config: LlamaConfig = llama8b_config(args.layers, args.tiny)
    dims = projection_dims(config)
    separate = random_layers(config)
    head = (jax.random.normal(jax.random.key(1), (config.hidden_size, config.vocab_size)) * 0.02).astype(jnp.bfloat16)
    step = jax.jit(packed_step, static_argnums=4)
    hashable_dims = tuple(sorted(dims.items()))
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
               "model": "tiny" if args.tiny else "llama-3.1-8b shape", "num_layers": config.num_layers,
               "rank": args.rank, "rows": {}}
    print(f"{results['device']}  jax {jax.__version__}  {config.num_layers} layers  rank {args.rank}")
    for window in [0, *args.windows]:
        layers = [packed_layer(w, dims, window, args.rank, jax.random.key(100 + i)) for i, w in enumerate(separate)]
        if window == 0:
            check_packed_equals_separate(layers, separate, head, dims, config)
        for rows in args.rows:
            hidden = (jax.random.normal(jax.random.key(rows), (rows, config.hidden_size)) * 0.5).astype(jnp.bfloat16)
            masks = {g: window_mask(rows, window, args.rank, len(names)) for g, names in GROUPS.items()} if window else {}
            fn = lambda: step(layers, head, hidden, masks, _Dims(dims))
            fn().block_until_ready()
            entry = results["rows"].setdefault(rows, {})
            if window == 0:
                entry["separate_ms"] = 1e3 * median_call_seconds(lambda: step_separate(separate, head, hidden), repeats=10)
            entry["packed_ms" if window == 0 else f"window_{window}_ms"] = 1e3 * median_call_seconds(fn, repeats=10)
        del layers
    for rows, entry in results["rows"].items():
        print(f"rows {rows:5d}: " + "  ".join(f"{k} {v:.2f}" for k, v in entry.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


class _Dims(dict):
    """A hashable dims dict (a static argument of the jitted step)."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))


def check_packed_equals_separate(layers, separate, head, dims, config) -> None:
    """The packed step (no window) computes the separate step's output (bf16 relative error), on
    the first two layers (random weights overflow bf16 over 32)."""
    layers, separate = layers[:2], separate[:2]
    hidden = (jax.random.normal(jax.random.key(7), (8, config.hidden_size)) * 0.5).astype(jnp.bfloat16)
    want = step_separate(separate, head, hidden).astype(jnp.float32)
    got = jax.jit(packed_step, static_argnums=4)(layers, head, hidden, {}, _Dims(dims)).astype(jnp.float32)
    error = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    assert error < 2e-2, f"packed step differs from the separate step: relative error {error:.3g}"


if __name__ == "__main__":
    main()
