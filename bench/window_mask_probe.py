"""Probe (issue 34 item 3): the adapter window's per-row mask of the shrink columns, in the forms
XLA may fuse into the expand GEMM, on a chain of decoder-layer projections of the 8B shape with
the window's columns (q/k/v packed, o, gate/up packed and batched, down; `add_adapter_window`'s
layout), in one run.

    PYTHONPATH=. python bench/window_mask_probe.py [--layers 16] [--rows 32 64] [--out FILE]
    PYTHONPATH=. python bench/window_mask_probe.py --tiny      # CPU smoke test (small)

A window decode step profiled on an H200 (bench/results/serve_profile_window_h200.json) runs 128
expand GEMMs and 128 `select` fusions more than base + window: the mask `where(own, shrink, 0)` is
a kernel of its own per group and layer. Variants:
  base      the packed GEMMs without the window's columns;
  columns   the kernels with the window's columns, sliced off (a step without a window plan);
  where     the select and XLA's expand GEMM (`window_expand_reference`, the engine before
            2026-11-29 and on other platforms);
  mul_layer the same mask as a multiply by `own.astype(dtype)`, built in each layer;
  mul_step  a float mask per group width built once at the top of the step and multiplied in;
  kernel    `pallas_kernels.window_expand` (select, expand and add in one Pallas kernel, in place).
Layouts (`--layouts`): `split`, one array per layer's weight; `stacked`, [L, ...] stacks read by
an unrolled layer scan (the engine's default: each layer's weights a static slice of the stack).
Prints ms per layer (host timing of back-to-back calls and the profiler's device time), kernels
per layer by kind (from the profiler), each variant's extra over `columns`, and its largest
difference from `where` (0: the same bf16 values).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import jax
import jax.numpy as jnp
import numpy as np

from bench.timing import kernel_category, kernel_times, median_call_seconds
from jaxlora.lora.plan import build_window_plan
import pallas_kernels.window_expand as window_expand_module
from jaxlora.lora.project import StackedWeight, _window_output
from pallas_kernels.window_expand import base_width, window_expand_reference

_F32, _BF16 = jnp.float32, jnp.bfloat16
VARIANTS = ("base", "columns", "where", "mul_layer", "mul_step", "kernel")
# kernel tiles swept besides the default: (name, BLOCK_N, NUM_WARPS) of pallas_kernels.window_expand
KERNEL_TILES = {"kernel_n64": (64, 4), "kernel_w2": (128, 2), "kernel_n64_w2": (64, 2)}
R, W = 16, 8


def shapes(tiny: bool) -> dict:
    if tiny:
        return {"hidden": 64, "qkv": (64, 32, 32), "inter": 128}
    return {"hidden": 4096, "qkv": (4096, 1024, 1024), "inter": 14336}


def make_layer(s: dict, key) -> dict:
    """One layer's window weights as `add_adapter_window` lays them out, random (no zero blocks
    filled in besides the block-diagonal's)."""
    h, (q, k, v), i = s["hidden"], s["qkv"], s["inter"]
    keys = iter(jax.random.split(key, 16))
    normal = lambda shape, scale: (jax.random.normal(next(keys), shape, _F32) * scale).astype(_BF16)
    wr = W * R
    qkv_b = jnp.zeros((3 * wr, q + k + v), _BF16)
    for p, (start, width) in enumerate(((0, q), (q, k), (q + k, v))):
        qkv_b = qkv_b.at[p * wr:(p + 1) * wr, start:start + width].set(normal((wr, width), 0.1))
    return {"qkv_proj.kernel": normal((h, q + k + v + 3 * wr), h ** -0.5), "qkv_proj.window_b": qkv_b,
            "o_proj.kernel": normal((q, h + wr), h ** -0.5), "o_proj.window_b": normal((wr, h), 0.1),
            "gate_up_proj.kernel": normal((h, 2 * i + 2 * wr), h ** -0.5),
            "gate_up_proj.window_b": normal((2, wr, i), 0.1),
            "down_proj.kernel": normal((i, h + wr), i ** -0.5), "down_proj.window_b": normal((wr, h), 0.1)}


def _masks(plan) -> dict:
    """{P: float mask [T, P*W*r]} for the group widths of a layer, built once."""
    columns = plan.column_window
    out = {}
    for p in (1, 2, 3):
        tiled = jnp.tile(columns, p)
        own = (tiled[None, :] == plan.token_window[:, None]) | (tiled[None, :] == plan.token_extra[:, None])
        out[p] = own.astype(_BF16)
    return out


def _masked_output(x, weights, name, mask_fn):
    """`_window_output` with the select replaced by shrink * mask_fn(P)."""
    window_b = weights[f"{name}.window_b"]
    p = window_b.shape[0] if window_b.ndim == 3 else window_b.shape[0] // (W * R)
    width = window_b.shape[-1] * (window_b.shape[0] if window_b.ndim == 3 else 1)
    y = jnp.dot(x, weights[f"{name}.kernel"], preferred_element_type=x.dtype)
    base, shrink = y[..., :width], y[..., width:]
    shrink = (shrink * mask_fn(p)).astype(window_b.dtype)
    if window_b.ndim == 2:
        return base, jnp.dot(shrink, window_b, preferred_element_type=x.dtype)
    per_projection = jnp.moveaxis(shrink.reshape(*shrink.shape[:-1], *window_b.shape[:2]), -2, 0)
    return base, jnp.matmul(per_projection, window_b, preferred_element_type=x.dtype)


def _group(variant, x, weights, name, plan, masks, widths=None):
    """(base output, delta or None) of one packed group (widths: its packed projections')."""
    if variant == "base":
        return jnp.dot(x, weights[f"{name}.kernel"][:, :base_width(weights[f"{name}.window_b"].shape)], preferred_element_type=x.dtype), None
    if variant == "columns":
        y = jnp.dot(x, weights[f"{name}.kernel"], preferred_element_type=x.dtype)
        return y[..., :base_width(weights[f"{name}.window_b"].shape)], None
    if variant.startswith("kernel"):  # the engine's path (a StackedWeight in the stacked layout)
        return _window_output(x, weights, name, plan, widths), None
    if variant == "where":
        y = jnp.dot(x, weights[f"{name}.kernel"], preferred_element_type=x.dtype)
        return window_expand_reference(y, weights[f"{name}.window_b"], plan.token_window, plan.token_extra,
                                       plan.column_window), None
    if variant == "mul_layer":
        return _masked_output(x, weights, name, lambda p: _masks(plan)[p])
    return _masked_output(x, weights, name, lambda p: masks[p])


def _add(base, delta):
    if delta is None:
        return base
    if delta.ndim > base.ndim:  # batched: [P, T, n_p] side by side
        return base + jnp.concatenate(list(delta), axis=-1)
    return base + delta


def _norm(x):
    x32 = x.astype(_F32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(_BF16)


def chain(variant: str, s: dict):
    """x [T, hidden] -> x through the layers `layers`: a list of per-layer dicts (split) or one
    dict of [L, ...] stacks (an unrolled scan, as the engine's paged forward)."""
    q, i = s["qkv"][0], s["inter"]

    def one(x, w, plan, masks):
        y = _add(*_group(variant, _norm(x), w, "qkv_proj", plan, masks, s["qkv"]))
        attn = y[:, :q].astype(_F32) * jax.nn.sigmoid(jnp.mean(y[:, q:].astype(_F32), -1, keepdims=True))
        x = x + _add(*_group(variant, attn.astype(_BF16), w, "o_proj", plan, masks))
        gu = _add(*_group(variant, _norm(x), w, "gate_up_proj", plan, masks))
        act = (jax.nn.silu(gu[:, :i].astype(_F32)) * gu[:, i:].astype(_F32)).astype(_BF16)
        return x + _add(*_group(variant, act, w, "down_proj", plan, masks))

    def run(x, layers, plan):
        masks = _masks(plan) if variant == "mul_step" else None
        if isinstance(layers, dict):  # as jaxlora.models.paged: the kernel gets the B stacks whole
            count = next(iter(layers.values())).shape[0]
            whole = {k: v for k, v in layers.items() if k.endswith(".window_b") and variant.startswith("kernel")}
            scanned = {k: v for k, v in layers.items() if k not in whole}

            def body(h, per_layer):
                w, index = per_layer
                w = {**w, **{k: StackedWeight(v, index) for k, v in whole.items()}}
                return one(h, w, plan, masks), None

            x, _ = jax.lax.scan(body, x, (scanned, jnp.arange(count)), unroll=count)
            return x
        for w in layers:
            x = one(x, w, plan, masks)
        return x

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dump-hlo", default=None, help="write each variant's compiled HLO into this folder")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS + tuple(KERNEL_TILES))
    parser.add_argument("--layouts", nargs="+", default=["split", "stacked"], choices=["split", "stacked"])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.rows, args.repeats = 2, [5], 2
    s = shapes(args.tiny)
    split = [make_layer(s, jax.random.PRNGKey(layer)) for layer in range(args.layers)]
    stacked = {key: jnp.stack([w[key] for w in split]) for key in split[0]}
    gpu = jax.default_backend() == "gpu"
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "layers": args.layers, "window": W, "rank": R, "cases": []}
    variants = [v for v in VARIANTS + tuple(KERNEL_TILES) if v in args.variants or v in ("columns", "where")]
    for layout, rows in [(layout, rows) for layout in args.layouts for rows in args.rows]:
        layers = split if layout == "split" else stacked
        x = jax.random.normal(jax.random.PRNGKey(rows), (rows, s["hidden"]), _F32).astype(_BF16)
        token_window = np.arange(rows) % (W + 1) - 1  # every window slot and base rows (-1)
        plan = jax.tree.map(jnp.asarray, build_window_plan(token_window, W, R))
        case = {"layout": layout, "rows": rows}
        outs = {}
        for variant in variants:
            block_n, warps = KERNEL_TILES.get(variant, (128, 4))
            window_expand_module.BLOCK_N, window_expand_module.NUM_WARPS = block_n, warps
            try:
                compiled = jax.jit(chain(variant, s)).lower(x, layers, plan).compile()
            except Exception as error:  # a tile the device cannot run: recorded, the others go on
                case[variant] = {"error": str(error)[:300]}
                print(variant, "failed:", str(error)[:300], flush=True)
                continue
            outs[variant] = np.asarray(compiled(x, layers, plan).astype(_F32))
            if args.dump_hlo:
                os.makedirs(args.dump_hlo, exist_ok=True)
                with open(os.path.join(args.dump_hlo, f"{layout}_{rows}_{variant}.hlo.txt"), "w") as f:
                    f.write(compiled.as_text() or "")
            seconds = median_call_seconds(lambda: compiled(x, layers, plan), args.repeats)
            entry = {"ms_per_layer": seconds * 1e3 / args.layers}
            if gpu:
                prof = kernel_times(lambda: compiled(x, layers, plan), 5, f"/tmp/window_mask_probe/{layout}_{rows}_{variant}")
                entry["device_ms_per_layer"] = prof["device_ms"] / args.layers
                counts: dict[str, float] = {}
                for kernel in prof["kernels"]:
                    kind = kernel_category(kernel["name"])
                    counts[kind] = counts.get(kind, 0.0) + kernel["calls"] / args.layers
                entry["kernels_per_layer"] = counts
                entry["top_kernels"] = prof["kernels"][:12]
            case[variant] = entry
        for variant in variants:
            if variant in ("base", "columns") or "error" in case.get(variant, {}):
                continue
            key = "device_ms_per_layer" if gpu else "ms_per_layer"
            case[variant]["extra_over_columns_us"] = (case[variant][key] - case["columns"][key]) * 1e3
            case[variant]["max_abs_diff_vs_where"] = float(np.abs(outs[variant] - outs["where"]).max())
        result["cases"].append(case)
        print(json.dumps({k: v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if kk != "top_kernels"}
                          for k, v in case.items()}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
