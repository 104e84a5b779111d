"""Tile configurations: a lookup table keyed by (device kind, op, shape bucket) + a heuristic.

`tile_table.json` (next to this file) has the form
    {"<device_kind>": {"<op>": {"<bucket>": {"block_rows": 64, ...}}}}
with `bucket = shape_bucket(num_rows, in_dim, out_dim)`. An offline profiler fills it; any
device, op or bucket missing from it falls back to `heuristic_tiles` (a new GPU must work
without a table entry). Entries may be partial: missing fields come from the heuristic.

Ops and their (num_rows, in_dim, out_dim): "sgmv_shrink"/"bgmv_shrink" (T, k, r_max),
"sgmv_expand"/"bgmv_expand" (T, r_max, n), "segment_outer" (T, p, q).
"""

import dataclasses
import functools
import json
import pathlib

TABLE_PATH = pathlib.Path(__file__).with_name("tile_table.json")
OPS = ("sgmv_shrink", "sgmv_expand", "bgmv_shrink", "bgmv_expand", "segment_outer")


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Block sizes and launch parameters for one kernel call.

    block_rows: rows of x/y per tile. block_k: contraction block of shrink (p block of
    segment_outer). block_n: output column block of expand (q block of segment_outer).
    rank_chunk: rank granularity (GPU: static chunks skipped beyond a segment's rank; TPU:
    the rank block of a grid axis whose blocks >= rank are skipped). k_splits: GPU shrink
    split-K programs (partial sums reduced outside the kernel). num_warps/num_stages: Triton.
    """

    block_rows: int = 32
    block_k: int = 128
    block_n: int = 128
    rank_chunk: int = 16
    k_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2


def next_pow2(value: int) -> int:
    """Smallest power of two >= value (>= 1)."""
    return 1 << max(int(value) - 1, 0).bit_length()


def shape_bucket(num_rows: int, in_dim: int, out_dim: int) -> str:
    """Table key of a shape: each dimension rounded up to a power of two."""
    return f"{next_pow2(num_rows)}x{next_pow2(in_dim)}x{next_pow2(out_dim)}"


@functools.lru_cache(maxsize=8)
def load_table(path: str = str(TABLE_PATH)) -> dict:
    """The JSON tile table ({} when the file is missing or empty)."""
    file = pathlib.Path(path)
    if not file.exists() or not file.read_text().strip():
        return {}
    return json.loads(file.read_text())


def _gpu_heuristic(op: str, num_rows: int, in_dim: int, out_dim: int) -> TileConfig:
    rows = min(64, max(16, next_pow2(num_rows)))
    if op.startswith("bgmv"):
        rows = 1
    if op.endswith("shrink"):
        block_k = min(256, max(16, next_pow2(in_dim)))
        k_blocks = -(-in_dim // block_k)
        tiles = max(1, num_rows // max(rows, 1))
        k_splits = max(1, min(k_blocks, 128 // tiles))
        return TileConfig(rows, block_k, 16, 16, k_splits, 4, 2)
    block_k = min(64, max(16, next_pow2(in_dim)))
    block_n = min(128, max(16, next_pow2(out_dim)))
    return TileConfig(rows, block_k, block_n, 16, 1, 4, 2)


def _tpu_heuristic(op: str, num_rows: int, in_dim: int, out_dim: int) -> TileConfig:
    rows = 8 if op.startswith("bgmv") else min(128, max(8, next_pow2(num_rows)))
    rank_dim = out_dim if op.endswith("shrink") else in_dim
    rank_block = rank_dim if rank_dim <= 128 else 128
    block_k = in_dim if in_dim <= 512 else 512
    block_n = out_dim if out_dim <= 512 else 512
    return TileConfig(rows, block_k, block_n, rank_block, 1, 4, 2)


def heuristic_tiles(op: str, num_rows: int, in_dim: int, out_dim: int, style: str) -> TileConfig:
    """Tiles for a device with no table entry; style "gpu" (Triton) or "tpu" (Mosaic)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    if style == "tpu":
        return _tpu_heuristic(op, num_rows, in_dim, out_dim)
    return _gpu_heuristic(op, num_rows, in_dim, out_dim)


def get_tile_config(
    device_kind: str,
    op: str,
    num_rows: int,
    in_dim: int,
    out_dim: int,
    style: str = "gpu",
    table: dict | None = None,
) -> TileConfig:
    """Table entry for (device_kind, op, shape bucket) over the heuristic's defaults."""
    base = heuristic_tiles(op, num_rows, in_dim, out_dim, style)
    table = load_table() if table is None else table
    entry = table.get(device_kind, {}).get(op, {}).get(shape_bucket(num_rows, in_dim, out_dim))
    if not entry:
        return base
    known = {f.name for f in dataclasses.fields(TileConfig)}
    return dataclasses.replace(base, **{k: int(v) for k, v in entry.items() if k in known})
