"""Dispatch: pick reference / GPU (Triton) / TPU (Mosaic) kernels, fit tiles, pad, route.

`impl`: None (auto: "gpu" on a GPU backend, "tpu" on TPU, "reference" elsewhere), "reference",
"gpu" or "tpu". A kernel style that does not match the backend (e.g. "gpu" or "tpu" on CPU)
runs with `interpret=True` (the TPU style with the TPU interpreter when available).
`tiles`: an explicit TileConfig; default: `tiles.get_tile_config` for this device.
`routing`: a TileRouting from `make_routing(seg_starts, round_up(T, block_rows), block_rows)`
to share across calls; default: built here (under jit, XLA merges the identical builds).

Stacked pools (`sgmv_lora_stacked`, `bgmv_lora_stacked`): A/B hold P = layers x slots entries
and a call uses entries slot + slot_offset with per-entry rank/scale tables, so a layer scan
passes the whole stack (no per-layer slice copied for the kernels) and no per-call lookups run.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import bgmv_gpu, reference, sgmv_gpu, sgmv_tpu
from pallas_kernels.tile_fit import fit_shrink_smem, fit_tiles, pad_axis, pad_to, round_up
from pallas_kernels.routing import TileRouting, make_routing
from pallas_kernels.tiles import TileConfig, get_tile_config, smem_limit

IMPLS = (None, "reference", "gpu", "tpu")


def kernel_style(impl: str | None = None, off_accelerator: str | None = "gpu") -> str | None:
    """The kernel style a call runs: `impl` when given, else the device's ("gpu" on a GPU backend,
    "tpu" on TPU) and `off_accelerator` elsewhere ("gpu": the GPU kernels in interpret mode, as the
    model's LoRA and attention kernels run on a CPU; "reference": the pure-jnp ops; None: none)."""
    if impl is not None:
        return impl
    backend = jax.default_backend()
    return backend if backend in ("gpu", "tpu") else off_accelerator


def resolve_impl(impl: str | None):
    """(style, interpret) for an impl name; interpret is False, True or TPU InterpretParams."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    backend = jax.default_backend()
    impl = kernel_style(impl, off_accelerator="reference")
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


def _gpu_sgmv_shrink_partials(x, lora_a, seg_starts, seg_slot, seg_rank, cfg, interpret,
                              routing, slot_offset=None):
    """[k_splits, T_pad, r_pad] f32 partial sums of the GPU shrink (metadata clipped in-kernel)."""
    itemsize = max(x.dtype.itemsize, lora_a.dtype.itemsize)
    rank_pad = round_up(lora_a.shape[-1], cfg.rank_chunk)
    cfg = fit_shrink_smem(cfg, rank_pad, itemsize, smem_limit(jax.devices()[0].device_kind))
    x_p = pad_to(x, (cfg.block_rows, cfg.block_k))
    a_p = pad_to(lora_a, (None, cfg.block_k, cfg.rank_chunk))
    route = _routing(routing, seg_starts, x_p.shape[0], cfg.block_rows)
    return sgmv_gpu.sgmv_shrink_gpu(x_p, a_p, seg_starts.astype(jnp.int32),
                                    seg_slot.astype(jnp.int32), seg_rank.astype(jnp.int32),
                                    route, cfg, interpret, slot_offset)


def _gpu_sgmv_expand(y, v, lora_b, seg_starts, seg_slot, seg_rank, seg_scale, cfg, interpret,
                     routing, slot_offset=None):
    """GPU expand; v is [T, r] or split-K partials [parts, T', r'] (rows/ranks padded or cut)."""
    (num_rows, n), r_max = y.shape, lora_b.shape[1]
    y_p = pad_to(y, (cfg.block_rows, cfg.block_n))
    b_p = pad_to(lora_b, (None, cfg.rank_chunk, cfg.block_n))
    if v.ndim == 2:
        v = v[None]
    v = _fit_axis(_fit_axis(v, 1, y_p.shape[0]), 2, b_p.shape[1])
    route = _routing(routing, seg_starts, y_p.shape[0], cfg.block_rows)
    out = sgmv_gpu.sgmv_expand_gpu(y_p, v, b_p, seg_starts.astype(jnp.int32),
                                   seg_slot.astype(jnp.int32), seg_rank.astype(jnp.int32),
                                   seg_scale.astype(jnp.float32), route, cfg, interpret,
                                   slot_offset)
    return out[:num_rows, :n]


def _fit_axis(array, axis: int, size: int):
    """Zero-pad or cut `axis` to `size` (no copy when it already has that size)."""
    if array.shape[axis] == size:
        return array
    if array.shape[axis] > size:
        return jax.lax.slice_in_dim(array, 0, size, axis=axis)
    return pad_axis(array, axis, size)


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
    if style == "gpu":
        partials = _gpu_sgmv_shrink_partials(x, lora_a, seg_starts, seg_slot, seg_rank, cfg,
                                             interpret, routing)
        return partials.sum(axis=0)[:num_rows, :r_max].astype(x.dtype)
    starts, slots, ranks = _metadata(seg_starts, seg_slot, seg_rank, num_rows, r_max)
    x_p = pad_to(x, (cfg.block_rows, cfg.block_k))
    a_p = pad_to(lora_a, (None, cfg.block_k, cfg.rank_chunk))
    route = _routing(routing, starts, x_p.shape[0], cfg.block_rows)
    v = sgmv_tpu.sgmv_shrink_tpu(x_p, a_p, starts, slots, ranks, route, cfg, interpret)
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
    if style == "gpu":
        return _gpu_sgmv_expand(y, v, lora_b, seg_starts, seg_slot, seg_rank, seg_scale, cfg,
                                interpret, routing)
    starts, slots, ranks = _metadata(seg_starts, seg_slot, seg_rank, num_rows, r_max)
    y_p = pad_to(y, (cfg.block_rows, cfg.block_n))
    v_p = pad_to(v, (cfg.block_rows, cfg.rank_chunk))
    b_p = pad_to(lora_b, (None, cfg.rank_chunk, cfg.block_n))
    route = _routing(routing, starts, y_p.shape[0], cfg.block_rows)
    out = sgmv_tpu.sgmv_expand_tpu(y_p, v_p, b_p, starts, slots, ranks,
                                   seg_scale.astype(jnp.float32), route, cfg, interpret)
    return out[:num_rows, :n]


def sgmv_lora_tiles(num_rows: int, in_dim: int, out_dim: int, r_max: int, *, impl=None,
                    tiles=None) -> tuple[TileConfig, TileConfig]:
    """(shrink, expand) tile configs `sgmv_lora` uses for these shapes (`tiles`: an explicit
    (shrink, expand) pair or None for the device lookup)."""
    style, _ = resolve_impl(impl)
    style = "gpu" if style == "reference" else style
    shrink_tiles, expand_tiles = tiles if tiles is not None else (None, None)
    return (choose_tiles("sgmv_shrink", style, num_rows, in_dim, r_max, r_max, shrink_tiles),
            choose_tiles("sgmv_expand", style, num_rows, r_max, out_dim, r_max, expand_tiles))


def sgmv_lora_routing(seg_starts, num_rows: int, in_dim: int, out_dim: int, r_max: int, *,
                      impl=None, tiles=None) -> tuple[TileRouting, TileRouting]:
    """The (shrink, expand) routing pair for `sgmv_lora`: build it once per batch and pass it
    to every layer's call (saves the per-call routing ops)."""
    shrink_cfg, expand_cfg = sgmv_lora_tiles(num_rows, in_dim, out_dim, r_max, impl=impl,
                                             tiles=tiles)
    return tuple(make_routing(seg_starts, round_up(num_rows, cfg.block_rows), cfg.block_rows)
                 for cfg in (shrink_cfg, expand_cfg))


def sgmv_lora(y, x, lora_a, lora_b, seg_starts, seg_slot, seg_rank, seg_scale, *, impl=None,
              tiles=None, routing=None):
    """y[seg] += scale * (x[seg] @ A[slot][:, :rank]) @ B[slot][:rank]: shrink then expand.

    On GPU the shrink's split-K partial sums go straight into the expand (two kernel launches,
    no reduction pass, v kept in f32 until it is rounded to B's dtype for the expand's dot) and
    y is updated in place. y [T, n], x [T, k], lora_a [slots, k, r_max], lora_b [slots, r_max,
    n], segment metadata as in `sgmv_shrink`/`sgmv_expand` -> [T, n] (y.dtype).
    `tiles`: a (shrink, expand) TileConfig pair; `routing`: a pair from `sgmv_lora_routing`.
    """
    style, interpret = resolve_impl(impl)
    if style != "gpu":
        shrink_tiles, expand_tiles = tiles if tiles is not None else (None, None)
        route_s, route_e = routing if routing is not None else (None, None)
        v = sgmv_shrink(x, lora_a, seg_starts, seg_slot, seg_rank, impl=impl,
                        tiles=shrink_tiles, routing=route_s)
        return sgmv_expand(y, v, lora_b, seg_starts, seg_slot, seg_rank, seg_scale, impl=impl,
                           tiles=expand_tiles, routing=route_e)
    return _gpu_sgmv_lora(y, x, lora_a, lora_b, seg_starts, seg_slot, seg_rank, seg_scale,
                          impl, tiles, routing, interpret)


def _gpu_sgmv_lora(y, x, lora_a, lora_b, seg_starts, seg_slot, seg_rank, seg_scale, impl, tiles,
                   routing, interpret, slot_offset=None):
    """The GPU shrink -> expand pair (split-K partials straight into the expand)."""
    (num_rows, k), (n, r_max) = x.shape, (y.shape[1], lora_a.shape[-1])
    shrink_cfg, expand_cfg = sgmv_lora_tiles(num_rows, k, n, r_max, impl=impl, tiles=tiles)
    route_s, route_e = routing if routing is not None else (None, None)
    partials = _gpu_sgmv_shrink_partials(x, lora_a, seg_starts, seg_slot, seg_rank, shrink_cfg,
                                         interpret, route_s, slot_offset)
    return _gpu_sgmv_expand(y, partials, lora_b, seg_starts, seg_slot, seg_rank, seg_scale,
                            expand_cfg, interpret, route_e, slot_offset)


def _entry_metadata(slot, slot_rank, slot_scale, slot_offset):
    """(entry [n], rank [n], scale [n]) of stacked-pool rows/segments `slot` [n] (-1: none):
    what the non-GPU paths pass to the plain kernels."""
    valid = slot >= 0
    entry = jnp.where(valid, slot + jnp.reshape(slot_offset, ()), -1).astype(jnp.int32)
    clamped = jnp.maximum(entry, 0)
    return (entry, jnp.where(valid, slot_rank[clamped], 0).astype(jnp.int32),
            jnp.where(valid, slot_scale[clamped], 0.0).astype(jnp.float32))


def sgmv_lora_stacked(y, x, lora_a, lora_b, seg_starts, seg_slot, slot_rank, slot_scale,
                      slot_offset, *, impl=None, tiles=None, routing=None):
    """`sgmv_lora` over a stacked pool: segment s uses entry seg_slot[s] + slot_offset of
    lora_a [P, k, r_max] / lora_b [P, r_max, n] with that entry's rank and scale from
    slot_rank int32 [P] / slot_scale float32 [P]; slot_offset: int32 scalar or [1].
    y [T, n] is updated in place on GPU -> [T, n] (y.dtype)."""
    style, interpret = resolve_impl(impl)
    if style != "gpu":
        entry, rank, scale = _entry_metadata(seg_slot, slot_rank, slot_scale, slot_offset)
        return sgmv_lora(y, x, lora_a, lora_b, seg_starts, entry, rank, scale, impl=impl,
                         tiles=tiles, routing=routing)
    return _gpu_sgmv_lora(y, x, lora_a, lora_b, seg_starts, seg_slot, slot_rank, slot_scale,
                          impl, tiles, routing, interpret, slot_offset)


def _unit_segments(row_slot):
    return jnp.arange(row_slot.shape[0] + 1, dtype=jnp.int32)


def _gpu_bgmv_shrink_partials(x, lora_a, row_slot, row_rank, cfg, interpret, slot_offset=None):
    x_p = pad_to(x, (None, cfg.block_k))
    a_p = pad_to(lora_a, (None, cfg.block_k, cfg.rank_chunk))
    return bgmv_gpu.bgmv_shrink_gpu(x_p, a_p, row_slot.astype(jnp.int32),
                                    row_rank.astype(jnp.int32), cfg, interpret, slot_offset)


def _gpu_bgmv_expand(y, v, lora_b, row_slot, row_rank, row_scale, cfg, interpret,
                     slot_offset=None):
    n = y.shape[1]
    y_p = pad_to(y, (None, cfg.block_n))
    b_p = pad_to(lora_b, (None, cfg.rank_chunk, cfg.block_n))
    if v.ndim == 2:
        v = v[None]
    v = _fit_axis(v, 2, b_p.shape[1])
    out = bgmv_gpu.bgmv_expand_gpu(y_p, v, b_p, row_slot.astype(jnp.int32),
                                   row_rank.astype(jnp.int32), row_scale.astype(jnp.float32),
                                   cfg, interpret, slot_offset)
    return out[:, :n]


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
    partials = _gpu_bgmv_shrink_partials(x, lora_a, row_slot, row_rank, cfg, interpret)
    return partials.sum(axis=0)[:, :r_max].astype(x.dtype)


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
    return _gpu_bgmv_expand(y, v, lora_b, row_slot, row_rank, row_scale, cfg, interpret)


def bgmv_lora(y, x, lora_a, lora_b, row_slot, row_rank, row_scale, *, impl=None, tiles=None):
    """Decode: y[b] += scale[b] * (x[b] @ A[slot[b]][:, :rank]) @ B[slot[b]][:rank].

    On GPU the shrink's split-K partials go straight into the expand (two launches, no
    reduction pass; rows with slot -1 are not touched). `tiles`: a (shrink, expand) pair.
    y [B, n], x [B, k] -> [B, n] (y.dtype).
    """
    style, interpret = resolve_impl(impl)
    shrink_tiles, expand_tiles = tiles if tiles is not None else (None, None)
    if style != "gpu":
        v = bgmv_shrink(x, lora_a, row_slot, row_rank, impl=impl, tiles=shrink_tiles)
        return bgmv_expand(y, v, lora_b, row_slot, row_rank, row_scale, impl=impl,
                           tiles=expand_tiles)
    return _gpu_bgmv_lora(y, x, lora_a, lora_b, row_slot, row_rank, row_scale, tiles,
                          interpret)


def _gpu_bgmv_lora(y, x, lora_a, lora_b, row_slot, row_rank, row_scale, tiles, interpret,
                   slot_offset=None):
    """The GPU BGMV shrink -> expand pair (split-K partials straight into the expand)."""
    shrink_tiles, expand_tiles = tiles if tiles is not None else (None, None)
    (batch, k), (n, r_max) = x.shape, (y.shape[1], lora_a.shape[-1])
    shrink_cfg = choose_tiles("bgmv_shrink", "gpu", batch, k, r_max, r_max, shrink_tiles)
    expand_cfg = choose_tiles("bgmv_expand", "gpu", batch, r_max, n, r_max, expand_tiles)
    partials = _gpu_bgmv_shrink_partials(x, lora_a, row_slot, row_rank, shrink_cfg, interpret,
                                         slot_offset)
    return _gpu_bgmv_expand(y, partials, lora_b, row_slot, row_rank, row_scale, expand_cfg,
                            interpret, slot_offset)


def bgmv_lora_stacked(y, x, lora_a, lora_b, row_slot, slot_rank, slot_scale, slot_offset, *,
                      impl=None, tiles=None):
    """`bgmv_lora` over a stacked pool: row b uses entry row_slot[b] + slot_offset of
    lora_a [P, k, r_max] / lora_b [P, r_max, n] with that entry's rank and scale from
    slot_rank int32 [P] / slot_scale float32 [P]; slot_offset: int32 scalar or [1].
    y [B, n] is updated in place on GPU (rows with slot -1 untouched) -> [B, n] (y.dtype)."""
    style, interpret = resolve_impl(impl)
    if style != "gpu":
        entry, rank, scale = _entry_metadata(row_slot, slot_rank, slot_scale, slot_offset)
        return bgmv_lora(y, x, lora_a, lora_b, entry, rank, scale, impl=impl, tiles=tiles)
    return _gpu_bgmv_lora(y, x, lora_a, lora_b, row_slot, slot_rank, slot_scale, tiles,
                          interpret, slot_offset)


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


def bgmv_lora_grouped(ys, x, lora_as, lora_bs, row_slot, slot_ranks, slot_scales, slot_offset,
                      *, impl=None, tiles=None):
    """`bgmv_lora_stacked` for G projections of one input (q/k/v, gate/up): on GPU one shrink
    launch (x read once, partials [k_splits, B, G*r_max]) and one expand launch writing every
    y_g in place, instead of 2*G launches.

    ys: G arrays [B, n_g]; x [B, k]; lora_as: G stacked pools [P, k, r_max]; lora_bs: G
    [P, r_max, n_g]; row_slot int32 [B] (-1: none); slot_ranks/slot_scales: G tables [P];
    slot_offset int32 scalar or [1]; tiles: a (shrink, expand) pair. -> tuple of G [B, n_g].
    """
    style, interpret = resolve_impl(impl)
    if style != "gpu":
        return tuple(bgmv_lora_stacked(y, x, a, b, row_slot, rank, scale, slot_offset, impl=impl, tiles=tiles)
                     for y, a, b, rank, scale in zip(ys, lora_as, lora_bs, slot_ranks, slot_scales))
    widths = [y.shape[1] for y in ys]
    shrink_cfg, expand_cfg = _grouped_tiles(x, lora_as, widths, tiles)
    partials, b_p, ranks = _grouped_shrink(x, lora_as, lora_bs, row_slot, slot_offset, slot_ranks, shrink_cfg,
                                           expand_cfg, interpret)
    ys_p = [pad_to(y, (None, expand_cfg.block_n)) for y in ys]
    b_p = [pad_axis(b, 2, expand_cfg.block_n) for b in b_p]
    outs = bgmv_gpu.bgmv_expand_grouped_gpu(ys_p, partials, b_p, row_slot.astype(jnp.int32), slot_offset, ranks,
                                            [scale.astype(jnp.float32) for scale in slot_scales], expand_cfg,
                                            interpret)
    return tuple(out[:, :n] for out, n in zip(outs, widths))


def _grouped_tiles(x, lora_as, widths, tiles) -> tuple:
    """(shrink, expand) tiles of a grouped BGMV of x [B, k] into outputs of `widths` (`tiles`: a
    pair, or None: the table's), keyed by the grouped width G*r_max (the shrink's output, the
    expand's input: q/k/v, gate/up and a single projection each get their own table entries);
    the expand's col_blocks cut until it divides every width's blocks."""
    shrink_tiles, expand_tiles = tiles if tiles is not None else (None, None)
    (batch, k), r_max = x.shape, lora_as[0].shape[-1]
    shrink_cfg = choose_tiles("bgmv_shrink", "gpu", batch, k, len(widths) * r_max, r_max, shrink_tiles)
    expand_cfg = choose_tiles("bgmv_expand", "gpu", batch, len(widths) * r_max, min(widths), r_max, expand_tiles)
    while expand_cfg.col_blocks > 1 and any(round_up(n, expand_cfg.block_n) // expand_cfg.block_n
                                            % expand_cfg.col_blocks for n in widths):
        expand_cfg = dataclasses.replace(expand_cfg, col_blocks=expand_cfg.col_blocks // 2)
    return shrink_cfg, expand_cfg


def _grouped_shrink(x, lora_as, lora_bs, row_slot, slot_offset, slot_ranks, shrink_cfg, expand_cfg, interpret):
    """The grouped BGMV shrink of x [B, k] (one launch: split-K partials [parts, B, G*r]) and the B
    pools padded along the rank for the expand (each group's partial columns re-cut where the
    expand pads the rank otherwise): (partials, [P, r, n_g] each, the ranks as int32)."""
    x_p = pad_to(x, (None, shrink_cfg.block_k))
    a_p = [pad_to(a, (None, shrink_cfg.block_k, shrink_cfg.rank_chunk)) for a in lora_as]
    ranks = [rank.astype(jnp.int32) for rank in slot_ranks]
    partials = bgmv_gpu.bgmv_shrink_grouped_gpu(x_p, a_p, row_slot.astype(jnp.int32), slot_offset, ranks,
                                                shrink_cfg, interpret)
    r_pad = a_p[0].shape[-1]
    b_p = [pad_axis(b, 1, expand_cfg.rank_chunk) for b in lora_bs]
    if b_p[0].shape[1] != r_pad:  # rank padded differently for the expand: re-cut each group's columns
        partials = jnp.concatenate([_fit_axis(partials[..., g * r_pad:(g + 1) * r_pad], 2, b_p[0].shape[1])
                                    for g in range(len(lora_as))], axis=2)
    return partials, b_p, ranks


def bgmv_lora_packed(y, widths, x, lora_as, lora_bs, row_slot, slot_ranks, slot_scales, slot_offset,
                     *, impl=None, tiles=None):
    """`bgmv_lora_grouped` on the G projections' outputs side by side in one array (a packed
    kernel's output, `jaxlora.models.packed`): y [B, sum(widths)] -> y with each projection's LoRA
    added in its columns. On GPU, when every width is a multiple of the expand's column group, the
    expand writes y in place (`bgmv_expand_packed_gpu`: no projection's columns copied out of y);
    else (other styles, odd widths) the projections are cut apart, `bgmv_lora_grouped`, and joined.
    x [B, k]; lora_as, lora_bs, slot_ranks, slot_scales, slot_offset, tiles: `bgmv_lora_grouped`'s."""
    style, interpret = resolve_impl(impl)
    widths = [int(n) for n in widths]
    if style == "gpu":
        shrink_cfg, expand_cfg = _grouped_tiles(x, lora_as, widths, tiles)
        if not any(n % expand_cfg.block_n for n in widths):
            partials, b_p, ranks = _grouped_shrink(x, lora_as, lora_bs, row_slot, slot_offset, slot_ranks, shrink_cfg,
                                                   expand_cfg, interpret)
            return bgmv_gpu.bgmv_expand_packed_gpu(y, widths, partials, b_p, row_slot.astype(jnp.int32), slot_offset,
                                                   ranks, [scale.astype(jnp.float32) for scale in slot_scales],
                                                   expand_cfg, interpret)
    ys = jnp.split(y, list(itertools.accumulate(widths))[:-1], axis=-1)
    return jnp.concatenate(bgmv_lora_grouped(ys, x, lora_as, lora_bs, row_slot, slot_ranks, slot_scales, slot_offset,
                                             impl=impl, tiles=tiles), axis=-1)


# The fused decode kernel's default tiles (bgmv_fused_gpu: one program per row and column group of
# block_n * col_blocks columns, each recomputing the row's shrink): wide column groups keep the
# shrink's A re-reads (from L2) few. bench/bgmv_fused.py times a few configs against the pair.
FUSED_TILES = TileConfig(block_rows=1, block_k=512, block_n=256, rank_chunk=16, k_splits=1, num_warps=4,
                         num_stages=2, col_blocks=4)


def bgmv_lora_fused(ys, x, lora_as, lora_bs, row_slot, slot_ranks, slot_scales, slot_offset, *, impl=None,
                    tiles: TileConfig | None = None):
    """`bgmv_lora_grouped` in one launch: each row's shrink and expand in the same programs
    (`bgmv_fused_gpu`), for G >= 1 projections of one input. Same arguments and result (a tuple
    of G [B, n_g]); tiles: one TileConfig (default `FUSED_TILES`, fitted to the shapes)."""
    style, interpret = resolve_impl(impl)
    if style != "gpu":
        return tuple(bgmv_lora_stacked(y, x, a, b, row_slot, rank, scale, slot_offset, impl=impl)
                     for y, a, b, rank, scale in zip(ys, lora_as, lora_bs, slot_ranks, slot_scales))
    from pallas_kernels.bgmv_fused_gpu import bgmv_fused_gpu

    cfg, widths = fused_tiles(x.shape[1], [y.shape[1] for y in ys], lora_as[0].shape[-1], tiles), [y.shape[1] for y in ys]
    x_p = pad_to(x, (None, cfg.block_k))
    a_p = [pad_to(a, (None, cfg.block_k, cfg.rank_chunk)) for a in lora_as]
    b_p = [pad_to(b, (None, cfg.rank_chunk, cfg.block_n)) for b in lora_bs]
    ys_p = [pad_to(y, (None, cfg.block_n)) for y in ys]
    outs = bgmv_fused_gpu(ys_p, x_p, a_p, b_p, row_slot.astype(jnp.int32), slot_offset,
                          [rank.astype(jnp.int32) for rank in slot_ranks],
                          [scale.astype(jnp.float32) for scale in slot_scales], cfg, interpret)
    return tuple(out[:, :n] for out, n in zip(outs, widths))


def fused_tiles(k: int, widths: list[int], r_max: int, tiles: TileConfig | None = None) -> TileConfig:
    """`tiles` (default FUSED_TILES) fitted to a call: block_k and block_n powers of two no larger
    than the dimensions need (>= 16), rank_chunk <= the padded rank, col_blocks halved until it
    divides every projection's block count."""
    cfg = tiles or FUSED_TILES
    fit = lambda block, dim: max(16, min(block, 1 << max(int(dim) - 1, 0).bit_length()))
    cfg = dataclasses.replace(cfg, block_k=fit(cfg.block_k, k), block_n=fit(cfg.block_n, max(widths)),
                              rank_chunk=fit(cfg.rank_chunk, r_max))
    while cfg.col_blocks > 1 and any(round_up(n, cfg.block_n) // cfg.block_n % cfg.col_blocks for n in widths):
        cfg = dataclasses.replace(cfg, col_blocks=cfg.col_blocks // 2)
    return cfg
