"""Probe (issue 34 item 3): a decode projection group's base GEMM and its rows' LoRA in ONE Pallas
(Triton) kernel, against XLA's GEMM followed by the engine's two BGMV kernels, at the 8B shapes.

    PYTHONPATH=. python bench/fused_decode_probe.py [--rows 32 64] [--out FILE]
    PYTHONPATH=. python bench/fused_decode_probe.py --tiny      # CPU smoke test (interpret, small)

The kernel (`fused_gemm_lora`): programs take tickets from an atomic counter as they start and
play one of three roles by ticket. The first rows x parts compute the LoRA shrink of one row's K
part for every projection of the group (v parts in a float32 workspace, then a done-count); the
next are the GEMM's (column block, K split) programs, float32 partials of x @ W; the last are the
expand's (16 rows, column block) programs, which wait for the shrink's count (by then long
reached) and write those rows' v @ B[their adapters] into a float32 delta. XLA's one fusion sums
the K splits and the delta and rounds once. So a group's LoRA launches nothing of its own and its
A/B bytes are read beside W's. (The first build added the expand in the GEMM programs' epilogue:
slower, bench/NOTES_serve.md.) Rows on distinct adapters of a stacked 64-slot pool (r = 16).

Prints per group and row count: XLA GEMM alone, XLA GEMM + in-line BGMV (today), the fused
kernel, us per layer, the fused kernel's error against the in-line result, and its LoRA extra
against the bytes floor (the rows' A and B at the copy bandwidth measured in the same run).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

import pallas_kernels as pk
from bench.timing import copy_bandwidth, median_call_seconds

_F32, _BF16 = jnp.float32, jnp.bfloat16
R = 16
# group: (k, projection widths, GEMM config (block_n, block_k, split_k, num_warps, num_stages), shrink parts)
GROUPS = {"qkv": (4096, (4096, 1024, 1024), (128, 128, 2, 8, 4), 8),
          "o": (4096, (4096,), (128, 64, 4, 4, 6), 8),
          "gate_up": (4096, (14336, 14336), (256, 64, 2, 8, 4), 8),
          "down": (14336, (4096,), (128, 128, 4, 4, 4), 16)}
TINY_GROUPS = {"qkv": (64, (64, 32, 32), (32, 32, 2, 4, 2), 2), "o": (64, (64,), (32, 32, 1, 4, 2), 2)}
SHRINK_BK = 128
ROW_CHUNK = 16  # rows an expand program covers
EXPAND_BN = 64  # columns of B an expand program holds at once (registers, no shared memory)


def _fused_kernel(slot_ref, offset_ref, *refs, groups: int, block_starts: tuple, bn: int, bk: int, split: int,
                  parts: int, shrink_bk: int, rows: int, spin: bool):
    rank_refs, scale_refs = refs[:groups], refs[groups:2 * groups]
    x_ref, w_ref = refs[2 * groups], refs[2 * groups + 1]
    a_refs, b_refs = refs[2 * groups + 2:3 * groups + 2], refs[3 * groups + 2:4 * groups + 2]
    out_ref, delta_ref, v_ref, count_ref = refs[4 * groups + 3:]
    k = x_ref.shape[1]
    n_blocks = block_starts[-1]
    n_shrink, n_gemm = rows * parts, n_blocks * split
    ticket = plt.atomic_add(count_ref, (jnp.int32(0),), jnp.int32(1))

    def entry_of(row):
        slot = slot_ref[row]
        return jnp.maximum(slot, 0) + offset_ref[0], slot >= 0

    @pl.when(ticket < n_shrink)
    def _():
        row, part = ticket // parts, ticket % parts
        entry, active = entry_of(row)
        k_part = k // parts

        def body(i, accs):
            k0 = pl.multiple_of(part * k_part + i * shrink_bk, shrink_bk)
            x_blk = x_ref[row, pl.ds(k0, shrink_bk)].astype(_F32)
            return tuple(acc + jnp.sum(x_blk[:, None] * a[entry, pl.ds(k0, shrink_bk), :].astype(_F32), axis=0)
                         for acc, a in zip(accs, a_refs))

        zeros = tuple(jnp.zeros((R,), _F32) for _ in range(groups))
        accs = lax.fori_loop(jnp.int32(0), jnp.where(active, jnp.int32(k_part // shrink_bk), jnp.int32(0)), body, zeros)
        ranks = lax.broadcasted_iota(jnp.int32, (R,), 0)
        for g in range(groups):
            v_ref[part, row, pl.ds(g * R, R)] = jnp.where(ranks < rank_refs[g][entry], accs[g], 0.0)
        plt.atomic_add(count_ref, (jnp.int32(1),), jnp.int32(1))  # release: this part is written

    @pl.when((ticket >= n_shrink) & (ticket < n_shrink + n_gemm))
    def _():  # the GEMM's (column block, K split) programs: float32 partials, nothing else
        t = ticket - n_shrink
        block, s = t // split, t % split
        k_split = k // split
        col0 = pl.multiple_of(block * bn, bn)

        def body(i, acc):
            k0 = pl.multiple_of(s * k_split + i * bk, bk)
            return acc + jnp.dot(x_ref[:, pl.ds(k0, bk)], w_ref[pl.ds(k0, bk), pl.ds(col0, bn)],
                                 preferred_element_type=_F32)

        out_ref[s, :, pl.ds(col0, bn)] = lax.fori_loop(0, k_split // bk, body, jnp.zeros((rows, bn), _F32))

    @pl.when(ticket >= n_shrink + n_gemm)
    def _():  # the expand's (ROW_CHUNK rows, column block) programs: their rows' LoRA into `delta`
        t = ticket - n_shrink - n_gemm
        chunk, block = t // n_blocks, t % n_blocks
        if spin:  # acquire: every shrink part written (interpret mode runs programs in order)
            lax.while_loop(lambda seen: seen < n_shrink,
                           lambda _: plt.atomic_add(count_ref, (jnp.int32(1),), jnp.int32(0)), jnp.int32(0))
        row0 = pl.multiple_of(chunk * ROW_CHUNK, ROW_CHUNK)
        slots = slot_ref[pl.ds(row0, ROW_CHUNK)]
        entries = jnp.maximum(slots, 0) + offset_ref[0]
        col0 = pl.multiple_of(block * bn, bn)

        def expand(g):
            g_col0 = (block - block_starts[g]) * bn
            v = jnp.sum(v_ref[:, pl.ds(row0, ROW_CHUNK), pl.ds(g * R, R)], axis=0)  # [chunk, R]
            v = v * jnp.where(slots >= 0, scale_refs[g][entries], 0.0)[:, None]
            sub_bn = min(EXPAND_BN, bn)
            for sub in range(bn // sub_bn):  # [chunk, R, sub_bn] of the rows' B at a time
                b = b_refs[g][entries, :, pl.ds(g_col0 + sub * sub_bn, sub_bn)].astype(_F32)
                delta_ref[pl.ds(row0, ROW_CHUNK), pl.ds(col0 + sub * sub_bn, sub_bn)] = jnp.sum(
                    v[:, :, None] * b, axis=1)

        for g in range(groups):
            pl.when((block >= block_starts[g]) & (block < block_starts[g + 1]))(functools.partial(expand, g))


def fused_gemm_lora(x, w, widths, lora_as, lora_bs, slot, offset, ranks, scales, config, parts: int,
                    interpret: bool):
    """x [M, k] @ w [k, sum(widths)] plus each row's LoRA of every projection (rows with slot -1:
    none), in one launch -> [M, n] in x's dtype (split-K partials summed by XLA when split > 1)."""
    bn, bk, split, warps, stages = config
    (rows, k), n, groups = x.shape, w.shape[1], len(widths)
    shrink_bk = min(SHRINK_BK, k // parts)
    if any(width % bn for width in widths) or k % (split * bk) or k % (parts * shrink_bk) or rows % ROW_CHUNK \
            or bn % min(EXPAND_BN, bn):
        raise ValueError(f"shapes {k} x {widths} do not fit config {config} / {parts} shrink parts")
    block_starts = [0]
    for width in widths:
        block_starts.append(block_starts[-1] + width // bn)
    kernel = functools.partial(_fused_kernel, groups=groups, block_starts=tuple(block_starts), bn=bn, bk=bk,
                               split=split, parts=parts, shrink_bk=shrink_bk, rows=rows, spin=not interpret)
    out, delta, _, _ = pl.pallas_call(
        kernel,
        name="fused_gemm_lora",
        out_shape=(jax.ShapeDtypeStruct((split, rows, n), _F32), jax.ShapeDtypeStruct((rows, n), _F32),
                   jax.ShapeDtypeStruct((parts, rows, groups * R), _F32),
                   jax.ShapeDtypeStruct((2,), jnp.int32)),
        grid=(rows * parts + (n // bn) * split + (rows // ROW_CHUNK) * (n // bn),),
        input_output_aliases={4 * groups + 4: 3},
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
    )(slot, jnp.reshape(offset, (1,)).astype(jnp.int32), *ranks, *scales, x, w, *lora_as, *lora_bs,
      jnp.zeros((2,), jnp.int32))
    return (out.sum(0) + delta).astype(x.dtype)  # one XLA fusion: the K splits and the LoRA, one rounding


def make_group(key, k, widths, layers, slots):
    keys = iter(jax.random.split(key, 4 + 2 * len(widths) * layers))
    normal = lambda shape, scale: (jax.random.normal(next(keys), shape, _F32) * scale).astype(_BF16)
    ws = [normal((k, sum(widths)), k ** -0.5) for _ in range(layers)]
    pool = [{"a": normal((layers * slots, k, R), k ** -0.5), "b": normal((layers * slots, R, n), 0.5),
             "rank": jnp.full((layers * slots,), R, jnp.int32), "scale": jnp.full((layers * slots,), 2.0, _F32)}
            for n in widths]
    return ws, pool


def variant_fn(variant, widths, slots, config, parts, interpret):
    """The jitted sum over layers of one projection group's output (x, ws, pool, slot) -> [M, n]."""
    def project(x, w, pool, slot, offset):
        if variant == "fused":
            return fused_gemm_lora(x, w, widths, [p["a"] for p in pool], [p["b"] for p in pool], slot, offset,
                                   [p["rank"] for p in pool], [p["scale"] for p in pool], config, parts, interpret)
        y = jnp.dot(x, w, preferred_element_type=_F32).astype(_BF16)
        if variant == "xla":
            return y
        if len(widths) == 1:
            p = pool[0]
            return pk.bgmv_lora_stacked(y, x, p["a"], p["b"], slot, p["rank"], p["scale"], offset, impl="gpu")
        return pk.bgmv_lora_packed(y, widths, x, [p["a"] for p in pool], [p["b"] for p in pool], slot,
                                   [p["rank"] for p in pool], [p["scale"] for p in pool], offset, impl="gpu")

    def run(x, ws, pool, slot):
        total = jnp.zeros((x.shape[0], sum(widths)), _F32)
        for layer, w in enumerate(ws):
            total = total + project(x, w, pool, slot, jnp.int32(layer * slots)).astype(_F32)
        return total
    return jax.jit(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--groups", nargs="+", default=None, choices=list(GROUPS))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    groups = TINY_GROUPS if args.tiny else {g: GROUPS[g] for g in (args.groups or GROUPS)}
    if args.tiny:
        args.rows, args.layers, args.slots, args.repeats = [16], 2, 4, 2
    interpret = jax.default_backend() != "gpu"
    bandwidth = None if args.tiny else copy_bandwidth()
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "copy_bandwidth_tb_s": None if bandwidth is None else bandwidth / 1e12, "layers": args.layers,
              "slots": args.slots, "rank": R, "cases": []}
    for name, (k, widths, config, parts) in groups.items():
        ws, pool = make_group(jax.random.PRNGKey(len(name)), k, widths, args.layers, args.slots)
        for rows in args.rows:
            x = jax.random.normal(jax.random.PRNGKey(rows), (rows, k), _F32).astype(_BF16)
            slot = jnp.arange(rows, dtype=jnp.int32) % args.slots
            slot = slot.at[rows - 1].set(-1)  # one base-model row
            case = {"group": name, "rows": rows, "config": config, "parts": parts}
            outs = {}
            for variant in ("xla", "inline", "fused"):
                try:
                    fn = variant_fn(variant, widths, args.slots, config, parts, interpret)
                    outs[variant] = np.asarray(fn(x, ws, pool, slot))
                    case[f"{variant}_us"] = median_call_seconds(lambda: fn(x, ws, pool, slot), args.repeats) \
                        * 1e6 / args.layers
                except Exception as error:  # recorded; the other variants still run
                    case[f"{variant}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
            if "fused" in outs and "inline" in outs:
                ref = outs["inline"] - outs["xla"]
                case["fused_lora_rel_err"] = float(np.linalg.norm(outs["fused"] - outs["inline"]) / np.linalg.norm(ref))
            adapters = min(rows - 1, args.slots)
            a_b_bytes = adapters * 2 * R * (len(widths) * k + sum(widths))  # each row's A and B, bf16
            case["floor_us"] = a_b_bytes / bandwidth * 1e6 if bandwidth else None
            for variant in ("inline", "fused"):
                if f"{variant}_us" in case and "xla_us" in case:
                    case[f"{variant}_extra_us"] = case[f"{variant}_us"] - case["xla_us"]
            result["cases"].append(case)
            print(json.dumps(case), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
