"""Probe (issue 34 item 3): the decode step's BGMV LoRA on a second CUDA stream beside the base
GEMMs, against the same kernels in line (the engine's decode path today) and the base layers
alone, on a chain of decoder-layer projections of the 8B shape (q/k/v packed, o, gate/up packed,
down; rows on distinct adapters of a stacked 64-slot pool), in one run.

    PYTHONPATH=. python bench/lora_stream_probe.py [--layers 8] [--rows 32 64] [--out FILE]
    PYTHONPATH=. python bench/lora_stream_probe.py --tiny      # CPU smoke test (interpret, small)

Variants per row count: `base` (the GEMMs and the elementwise glue only), `inline` (the LoRA
kernels after each GEMM, in place on its output: `pallas_kernels.bgmv_lora_packed` /
`bgmv_lora_stacked`), `stream` (the same kernels into a float32 zero delta on a second CUDA
stream, `side_stream`, added to the GEMM's output by the glue that follows), `xla` (no kernel of
its own: the shrink as a multiply-and-reduce over each row's gathered A, the expand as R
multiply-adds of each row's gathered B rows, elementwise, so that XLA can fuse it into the glue
that consumes the GEMM's output; the question is whether XLA's fusions take the LoRA with fewer
launches than the kernel pair: `--profile` counts kernels a call).
Prints ms per layer, each variant's extra over base against the bytes floor (each row's A and B
read once at the measured copy bandwidth), the stream variant's error against inline, and
whether XLA put the side-stream calls on their own stream (`call-start` in the compiled HLO).
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

import pallas_kernels as pk
from bench.timing import copy_bandwidth, median_call_seconds
from jaxlora.lora import ops

_F32, _BF16 = jnp.float32, jnp.bfloat16
VARIANTS = ("inline", "stream", "xla")
SIDE_STREAM = "gpu_stream:1"
R = 16


def shapes(tiny: bool) -> dict:
    """hidden, (q, k, v) widths, intermediate of the model."""
    if tiny:
        return {"hidden": 64, "qkv": (64, 32, 32), "inter": 128}
    return {"hidden": 4096, "qkv": (4096, 1024, 1024), "inter": 14336}


def projections(s: dict) -> dict:
    """name: (in width, out width) of each LoRA target."""
    h, (q, k, v), i = s["hidden"], s["qkv"], s["inter"]
    return {"q": (h, q), "k": (h, k), "v": (h, v), "o": (q, h), "gate": (h, i), "up": (h, i), "down": (i, h)}


def make_state(s: dict, layers: int, slots: int, key) -> dict:
    """Random weights per layer and a stacked pool [layers * slots, ...] per projection."""
    keys = iter(jax.random.split(key, 64))
    normal = lambda shape, scale: (jax.random.normal(next(keys), shape, _F32) * scale).astype(_BF16)
    h, i, qkv = s["hidden"], s["inter"], sum(s["qkv"])
    weights = [{"qkv": normal((h, qkv), h ** -0.5), "o": normal((s["qkv"][0], h), h ** -0.5),
                "gate_up": normal((h, 2 * i), h ** -0.5), "down": normal((i, h), i ** -0.5)} for _ in range(layers)]
    pool = {}
    for name, (n_in, n_out) in projections(s).items():
        pool[name] = {"a": normal((layers * slots, n_in, R), n_in ** -0.5), "b": normal((layers * slots, R, n_out), 0.5),
                      "rank": jnp.full((layers * slots,), R, jnp.int32),
                      "scale": jnp.full((layers * slots,), 2.0, _F32)}
    return {"weights": weights, "pool": pool}


def _compute_on():
    """jax's function form of compute_on: `compute_on2` on jax 0.11 (where `compute_on` is a context
    manager), `compute_on` from 0.12 on (the same signature); None where neither exists."""
    import inspect

    from jax.experimental import compute_on as module

    function = getattr(module, "compute_on2", None) or module.compute_on
    return function if "out_memory_spaces" in inspect.signature(function).parameters else None


def side_stream_available() -> bool:
    return jax.default_backend() == "gpu" and _compute_on() is not None


def side_stream(fn):
    """`fn` on CUDA stream 1 of the XLA program (`_xla_stream_annotation`), beside the main stream's
    independent ops; off a GPU `fn` itself."""
    if not side_stream_available():
        return fn
    return _compute_on()(fn, compute_type=SIDE_STREAM, out_memory_spaces=jax.memory.Space.Device)


def _lora(y, x, pool, names, widths, slot, offset, impl):
    """y plus the LoRA of x for `names` (packed side by side in y when several), in place."""
    entries = [pool[n] for n in names]
    if len(names) == 1:
        e = entries[0]
        return pk.bgmv_lora_stacked(y, x, e["a"], e["b"], slot, e["rank"], e["scale"], offset, impl=impl)
    return pk.bgmv_lora_packed(y, widths, x, [e["a"] for e in entries], [e["b"] for e in entries], slot,
                               [e["rank"] for e in entries], [e["scale"] for e in entries], offset, impl=impl)


def _lora_reference(y, x, pool, names, slot, offset):
    """y plus the LoRA of x for `names` in plain jnp (each row's A and B gathered, float32)."""
    deltas = []
    for name in names:
        entry = pool[name]
        index = slot + offset
        v = jnp.einsum("bk,bkr->br", x.astype(_F32), entry["a"][index].astype(_F32))
        deltas.append(jnp.einsum("br,brn->bn", v, entry["b"][index].astype(_F32)) * entry["scale"][index][:, None])
    return (y.astype(_F32) + jnp.concatenate(deltas, axis=-1)).astype(_BF16)


def _lora_xla(y, x, pool, names, slot, offset):
    """y plus the LoRA of x for `names` in elementwise form (module doc, `xla`): the engine's
    `ops.elementwise_deltas` over the flattened stacks (each row's entry slot + offset), added in
    float32, one rounding."""
    deltas = ops.elementwise_deltas(x, [pool[n] for n in names], slot + offset)
    return (y.astype(_F32) + jnp.concatenate(deltas, axis=-1)).astype(_BF16)


def project(variant: str, x, w, pool, names, widths, slot, offset, impl):
    """x @ w in bf16 plus the LoRA of `names` per `variant`."""
    y = jnp.dot(x, w, preferred_element_type=_F32).astype(_BF16)
    if variant == "base":
        return y
    if variant == "reference":
        return _lora_reference(y, x, pool, names, slot, offset)
    if variant == "inline":
        return _lora(y, x, pool, names, widths, slot, offset, impl)
    if variant == "xla":
        return _lora_xla(y, x, pool, names, slot, offset)
    delta_fn = side_stream(
        lambda x, pool, slot, offset: _lora(jnp.zeros((x.shape[0], sum(widths)), _F32), x, pool, names, widths, slot,
                                            offset, impl))
    delta = delta_fn(x, {n: pool[n] for n in names}, slot, offset)
    return (y.astype(_F32) + delta).astype(_BF16)


def _norm(x):
    x32 = x.astype(_F32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(_BF16)


def chain(variant: str, s: dict, slots: int, impl):
    """The layers' projections with minimal glue: x [B, hidden] -> x."""
    q, k, v = s["qkv"]
    i = s["inter"]

    def run(x, state, slot):
        for layer, w in enumerate(state["weights"]):
            offset = jnp.int32(layer * slots)
            h = _norm(x)
            y = project(variant, h, w["qkv"], state["pool"], ("q", "k", "v"), (q, k, v), slot, offset, impl)
            attn = (y[:, :q].astype(_F32) * jax.nn.sigmoid(jnp.mean(y[:, q:].astype(_F32), -1, keepdims=True)))
            o = project(variant, attn.astype(_BF16), w["o"], state["pool"], ("o",), (s["hidden"],), slot, offset, impl)
            x = x + o
            h = _norm(x)
            gu = project(variant, h, w["gate_up"], state["pool"], ("gate", "up"), (i, i), slot, offset, impl)
            act = (jax.nn.silu(gu[:, :i].astype(_F32)) * gu[:, i:].astype(_F32)).astype(_BF16)
            x = x + project(variant, act, w["down"], state["pool"], ("down",), (s["hidden"],), slot, offset, impl)
        return x

    return run


def overlap_stats(log_dir: str, calls: int) -> dict:
    """Per call, from a profiler trace of `calls` calls: kernel time summed, the time some kernel
    ran (union of the kernels' intervals), their difference (time two streams ran at once) and the
    GPU streams that ran kernels."""
    import glob
    import gzip

    paths = sorted(glob.glob(f"{log_dir}/**/*.trace.json.gz", recursive=True))
    events = json.load(gzip.open(paths[-1]))["traceEvents"] if paths else []
    pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and "/device:GPU" in str(e.get("args", {}).get("name", ""))}
    spans = sorted((e["ts"], e["ts"] + e["dur"], e.get("tid")) for e in events
                   if e.get("ph") == "X" and e.get("pid") in pids and "dur" in e)
    union, end = 0.0, None
    for start, stop, _ in spans:
        if end is None or start > end:
            union, end = union + stop - start, stop
        elif stop > end:
            union, end = union + stop - end, stop
    total = sum(stop - start for start, stop, _ in spans)
    return {"kernel_ms": total / calls / 1e3, "busy_ms": union / calls / 1e3,
            "concurrent_ms": (total - union) / calls / 1e3, "streams": len({tid for *_, tid in spans}),
            "kernels_per_call": len(spans) / calls}


def adapter_bytes(s: dict) -> int:
    """Bytes of one adapter's A and B in one layer (bf16)."""
    return sum(2 * R * (n_in + n_out) for n_in, n_out in projections(s).values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                        help="LoRA variants besides base and reference")
    parser.add_argument("--profile", action="store_true", help="kernel overlap of inline and stream from a trace")
    parser.add_argument("--hlo-dir", default=None, help="write the stream variant's compiled HLO there")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.slots, args.rows, args.repeats = 2, 4, [3], 2
    s = shapes(args.tiny)
    impl = "gpu"  # interpret mode off a GPU
    state = make_state(s, args.layers, args.slots, jax.random.PRNGKey(0))
    bandwidth = None if args.tiny else copy_bandwidth()
    options = {"xla_gpu_experimental_stream_annotation": True} if side_stream_available() else None
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "layers": args.layers, "slots": args.slots, "rank": R, "side_stream": side_stream_available(),
              "copy_bandwidth_tb_s": None if bandwidth is None else bandwidth / 1e12, "cases": []}
    for rows in args.rows:
        x = jax.random.normal(jax.random.PRNGKey(rows), (rows, s["hidden"]), _F32).astype(_BF16)
        slot = jnp.arange(rows, dtype=jnp.int32) % args.slots  # distinct adapters (up to the pool's size)
        case = {"rows": rows, "distinct_adapters": min(rows, args.slots)}
        outs = {}
        for variant in ("base", "reference", *args.variants):
            lowered = jax.jit(chain(variant, s, args.slots, impl)).lower(x, state, slot)
            compiled = lowered.compile(options) if options else lowered.compile()
            text = compiled.as_text() or ""
            if args.hlo_dir and variant == "stream":
                with open(os.path.join(args.hlo_dir, f"lora_stream_probe_{rows}.hlo.txt"), "w") as f:
                    f.write(text)
            outs[variant] = np.asarray(compiled(x, state, slot).astype(_F32))
            seconds = median_call_seconds(lambda: compiled(x, state, slot), args.repeats)
            case[variant] = {"ms_per_layer": seconds * 1e3 / args.layers, "call_starts": text.count("call-start(")}
            if args.profile and variant in ("base", *VARIANTS):
                log_dir = f"/tmp/lora_stream_probe_{rows}_{variant}"
                with jax.profiler.trace(log_dir):
                    for _ in range(3):
                        out = compiled(x, state, slot)
                    jax.block_until_ready(out)
                case[variant]["trace"] = overlap_stats(log_dir, 3)
        ref = outs["reference"]
        for variant in args.variants:  # against the plain-jnp LoRA (float32 products, one rounding a layer)
            case[variant]["rel_err_vs_reference"] = float(np.linalg.norm(outs[variant] - ref) / np.linalg.norm(ref))
        floor_ms = case["distinct_adapters"] * adapter_bytes(s) / bandwidth * 1e3 if bandwidth else None
        case["floor_ms_per_layer"] = floor_ms
        for variant in args.variants:
            extra = case[variant]["ms_per_layer"] - case["base"]["ms_per_layer"]
            case[variant]["extra_ms_per_layer"] = extra
            case[variant]["extra_over_floor"] = extra / floor_ms if floor_ms else None
        result["cases"].append(case)
        print(json.dumps(case), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
