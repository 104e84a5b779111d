"""Dispatch: pick reference / GPU (Triton) / TPU (Mosaic) kernels, fit tiles, pad, route.

`impl`: None (auto: "gpu" on a GPU backend, "tpu" on TPU, "reference" elsewhere), "reference",
"gpu" or "tpu". A kernel style that does not match the backend (e.g. "gpu" or "tpu" on CPU)
runs with `interpret=True` (the TPU style with the TPU interpreter when available).
`tiles`: an explicit TileConfig; default: `tiles.get_tile_config` for this device.
`routing`: a TileRouting from `make_routing(seg_starts, round_up(T, block_rows), block_rows)`
to share across calls; default: built here (under jit, XLA merges the identical builds).
"""

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import bgmv_gpu, reference, sgmv_gpu, sgmv_tpu
from pallas_kernels.layout import fit_tiles, pad_to
from pallas_kernels.routing import TileRouting, make_routing
from pallas_kernels.tiles import TileConfig, get_tile_config

IMPLS = (None, "reference", "gpu", "tpu")


def resolve_impl(impl: str | None):
    """(style, interpret) for an impl name; interpret is False, True or TPU InterpretParams."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    backend = jax.default_backend()
    if impl is None:
        impl = backend if backend in ("gpu", "tpu") else "reference"
    if impl == "reference" or impl == backend:
        return impl, False
    if impl == "tpu" and hasattr(pltpu, "InterpretParams"):
        return impl, pltpu.InterpretParams()
    return impl, True


def choose_tiles(op: str, style: str, num_rows: int, in_dim: int, out_dim: int,
                 rank_dim: int, tiles: TileConfig | None = None) -> TileConfig:
    """The (legal) tile config for an op call: explicit `tiles` or the device lookup."""
    if tiles is None:
        kind = jax.devices()[0].device_kind
        tiles = get_tile_config(kind, op, num_rows, in_dim, out_dim, style)
    return fit_tiles(tiles, style, num_rows, in_dim, out_dim, rank_dim)


def _metadata(seg_starts, seg_slot, seg_rank, num_rows: int, r_max: int):
    starts = jnp.clip(seg_starts.astype(jnp.int32), 0, num_rows)
    ranks = jnp.clip(seg_rank.astype(jnp.int32), 0, r_max)
    return starts, seg_slot.astype(jnp.int32), ranks


def _routing(routing: TileRouting | None, starts, padded_rows: int, block_rows: int):
    if routing is None:
        return make_routing(starts, padded_rows, block_rows)
    if routing.num_tiles * block_rows != padded_rows:
        raise ValueError(
            f"routing has {routing.num_tiles} tiles; this call needs {padded_rows // block_rows}"
            f" tiles of {block_rows} rows"
        )
    return routing


def sgmv_shrink(x, lora_a, seg_starts, seg_slot, seg_rank, *, impl=None, tiles=None,
                routing=None):
    """v[seg] = x[seg] @ A[slot][:, :rank] (zero beyond rank; zero rows for slot -1/padding).

    x [T, k], lora_a [slots, k, r_max], seg_starts int32 [S+1], seg_slot/seg_rank int32 [S]
    -> v [T, r_max] (x.dtype).
    """
    style, interpret = resolve_impl(impl)
    if style == "reference":
        return reference.sgmv_shrink_ref(x, lora_a, seg_starts, seg_slot, seg_rank)
    (num_rows, k), r_max = x.shape, lora_a.shape[-1]
    cfg = choose_tiles("sgmv_shrink", style, num_rows, k, r_max, r_max, tiles)
    starts, slots, ranks = _metadata(seg_starts, seg_slot, seg_rank, num_rows, r_max)
    x_p = pad_to(x, (cfg.block_rows, cfg.block_k))
    a_p = pad_to(lora_a, (None, cfg.block_k, cfg.rank_chunk))
    route = _routing(routing, starts, x_p.shape[0], cfg.block_rows)
    kernel = sgmv_gpu.sgmv_shrink_gpu if style == "gpu" else sgmv_tpu.sgmv_shrink_tpu
    v = kernel(x_p, a_p, starts, slots, ranks, route, cfg, interpret)
    return v[:num_rows, :r_max]


def sgmv_expand(y, v, lora_b, seg_starts, seg_slot, seg_rank, seg_scale, *, impl=None,
                tiles=None, routing=None):
    """y[seg] += scale * v[seg, :rank] @ B[slot][:rank] (in place when no padding is needed).

    y [T, n], v [T, r_max], lora_b [slots, r_max, n], seg_scale float32 [S] -> [T, n]
    (y.dtype); rows of slot -1 segments and padding rows are returned unchanged.
    """
    style, interpret = resolve_impl(impl)
    if style == "reference":
        return reference.sgmv_expand_ref(y, v, lora_b, seg_starts, seg_slot, seg_rank, seg_scale)
    (num_rows, n), r_max = y.shape, lora_b.shape[1]
    cfg = choose_tiles("sgmv_expand", style, num_rows, r_max, n, r_max, tiles)
    starts, slots, ranks = _metadata(seg_starts, seg_slot, seg_rank, num_rows, r_max)
    y_p = pad_to(y, (cfg.block_rows, cfg.block_n))
    v_p = pad_to(v, (cfg.block_rows, cfg.rank_chunk))
    b_p = pad_to(lora_b, (None, cfg.rank_chunk, cfg.block_n))
    route = _routing(routing, starts, y_p.shape[0], cfg.block_rows)
    kernel = sgmv_gpu.sgmv_expand_gpu if style == "gpu" else sgmv_tpu.sgmv_expand_tpu
    out = kernel(y_p, v_p, b_p, starts, slots, ranks, seg_scale.astype(jnp.float32), route, cfg,
                 interpret)
    return out[:num_rows, :n]


def _unit_segments(row_slot):
    return jnp.arange(row_slot.shape[0] + 1, dtype=jnp.int32)


def bgmv_shrink(x, lora_a, row_slot, row_rank, *, impl=None, tiles=None):
    """Decode shrink: v[b] = x[b] @ A[slot[b]][:, :rank[b]] (zero row for slot -1).

    x [B, k], lora_a [slots, k, r_max], row_slot/row_rank int32 [B] -> v [B, r_max].
    """
    style, interpret = resolve_impl(impl)
    if style == "reference":
        return reference.bgmv_shrink_ref(x, lora_a, row_slot, row_rank)
    if style == "tpu":
        return sgmv_shrink(x, lora_a, _unit_segments(row_slot), row_slot, row_rank, impl=impl,
                           tiles=tiles or _bgmv_tpu_tiles("bgmv_shrink", x.shape[0], x.shape[1],
                                                          lora_a.shape[-1]))
    (batch, k), r_max = x.shape, lora_a.shape[-1]
    cfg = choose_tiles("bgmv_shrink", style, batch, k, r_max, r_max, tiles)
    _, slots, ranks = _metadata(_unit_segments(row_slot), row_slot, row_rank, batch, r_max)
    x_p = pad_to(x, (None, cfg.block_k))
    a_p = pad_to(lora_a, (None, cfg.block_k, cfg.rank_chunk))
    return bgmv_gpu.bgmv_shrink_gpu(x_p, a_p, slots, ranks, cfg, interpret)[:, :r_max]


def bgmv_expand(y, v, lora_b, row_slot, row_rank, row_scale, *, impl=None, tiles=None):
    """Decode expand: y[b] += scale[b] * v[b, :rank] @ B[slot[b]][:rank]; slot -1 untouched.

    y [B, n], v [B, r_max], lora_b [slots, r_max, n], row_slot/row_rank int32 [B],
    row_scale float32 [B] -> [B, n] (y.dtype).
    """
    style, interpret = resolve_impl(impl)
    if style == "reference":
        return reference.bgmv_expand_ref(y, v, lora_b, row_slot, row_rank, row_scale)
    if style == "tpu":
        cfg = tiles or _bgmv_tpu_tiles("bgmv_expand", y.shape[0], v.shape[1], y.shape[1])
        return sgmv_expand(y, v, lora_b, _unit_segments(row_slot), row_slot, row_rank,
                           row_scale, impl=impl, tiles=cfg)
    (batch, n), r_max = y.shape, lora_b.shape[1]
    cfg = choose_tiles("bgmv_expand", style, batch, r_max, n, r_max, tiles)
    _, slots, ranks = _metadata(_unit_segments(row_slot), row_slot, row_rank, batch, r_max)
    y_p = pad_to(y, (None, cfg.block_n))
    v_p = pad_to(v, (None, cfg.rank_chunk))
    b_p = pad_to(lora_b, (None, cfg.rank_chunk, cfg.block_n))
    out = bgmv_gpu.bgmv_expand_gpu(y_p, v_p, b_p, slots, ranks, row_scale.astype(jnp.float32),
                                   cfg, interpret)
    return out[:, :n]


def _bgmv_tpu_tiles(op: str, batch: int, in_dim: int, out_dim: int) -> TileConfig:
    return get_tile_config(jax.devices()[0].device_kind, op, batch, in_dim, out_dim, "tpu")


def segment_outer(lhs, rhs, seg_starts, seg_slot, seg_rank, *, rank_axis: int, impl=None,
                  tiles=None, routing=None):
    """Per-segment transposed product (the A/B gradients): out[s] = lhs[seg]^T @ rhs[seg].

    lhs [T, p], rhs [T, q] -> [S, p, q] float32; zero for slot -1 / empty segments and at
    indices >= rank along `rank_axis` (0: p, 1: q).
    """
    style, interpret = resolve_impl(impl)
    if style == "reference":
        return reference.segment_outer_ref(lhs, rhs, seg_starts, seg_slot, seg_rank, rank_axis)
    (num_rows, p), q = lhs.shape, rhs.shape[1]
    r_max = (p, q)[rank_axis]
    cfg = choose_tiles("segment_outer", style, num_rows, p, q, r_max, tiles)
    starts, slots, ranks = _metadata(seg_starts, seg_slot, seg_rank, num_rows, r_max)
    lhs_p = pad_to(lhs, (cfg.block_rows, cfg.block_k))
    rhs_p = pad_to(rhs, (cfg.block_rows, cfg.block_n))
    if style == "gpu":
        out = sgmv_gpu.segment_outer_gpu(lhs_p, rhs_p, starts, slots, ranks, rank_axis, cfg,
                                         interpret)
    else:
        route = _routing(routing, starts, lhs_p.shape[0], cfg.block_rows)
        out = sgmv_tpu.segment_outer_tpu(lhs_p, rhs_p, starts, slots, ranks, rank_axis, route,
                                         cfg, interpret)
    return out[:, :p, :q]
