"""Tile configurations: a lookup table keyed by (device kind, op, shape bucket) + a heuristic.

`tile_table.json` (next to this file) has the form
    {"<device_kind>": {"<op>": {"<bucket>": {"block_rows": 64, ...}}}}
with `bucket = shape_bucket(num_rows, in_dim, out_dim)`. The offline profiler
`python -m pallas_kernels.tune` fills it on the device at hand. A bucket missing from it takes
the nearest row bucket of the same (in_dim, out_dim) (within 4x rows); any other device, op
or shape falls back to `heuristic_tiles` (a new GPU must work without a table entry). Entries
may be partial: missing fields come from the heuristic; extra fields (the profiler's measured
times) are ignored.

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
    split-K programs (partial sums summed by the expand, or outside the kernel).
    num_warps/num_stages: Triton. col_blocks: GPU SGMV expand, block_n-wide column blocks
    one program loops over (its v rows / split-K partials then come from L1, not L2).
    """

    block_rows: int = 32
    block_k: int = 128
    block_n: int = 128
    rank_chunk: int = 16
    k_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    col_blocks: int = 1


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
    """Triton defaults: enough programs to fill ~132 SMs a few times over (split-K for the
    shrinks, column blocks for the expands); uniform-rank pools take one rank chunk
    (`fit_tiles` cuts rank_chunk to a divisor of r_max)."""
    if op.startswith("bgmv"):
        if op == "bgmv_shrink":
            block_k = min(256, max(16, next_pow2(in_dim)))
            k_blocks = -(-in_dim // block_k)
            k_splits = max(1, min(k_blocks, 1024 // max(num_rows, 1)))
            return TileConfig(1, block_k, 16, 16, k_splits, 4, 2)
        return TileConfig(1, 16, min(256, max(16, next_pow2(out_dim))), 16, 1, 4, 2)
    rows = min(64, max(16, next_pow2(num_rows)))
    if op == "sgmv_shrink":
        block_k = min(256, max(16, next_pow2(in_dim)))
        k_blocks = -(-in_dim // block_k)
        tiles = max(1, -(-num_rows // rows))
        k_splits = max(1, min(k_blocks, 256 // tiles))
        return TileConfig(rows, block_k, 16, 64, k_splits, 4, 3)
    block_k = min(64, max(16, next_pow2(in_dim)))
    block_n = min(128, max(16, next_pow2(out_dim)))
    return TileConfig(rows, block_k, block_n, 64, 1, 4, 2)


def _tpu_heuristic(op: str, num_rows: int, in_dim: int, out_dim: int) -> TileConfig:
    rows = 8 if op.startswith("bgmv") else min(128, max(8, next_pow2(num_rows)))
    rank_dim = out_dim if op.endswith("shrink") else in_dim
    rank_block = rank_dim if rank_dim <= 128 else 128
    block_k = in_dim if in_dim <= 512 else 512
    block_n = out_dim if out_dim <= 512 else 512
    return TileConfig(rows, block_k, block_n, rank_block, 1, 4, 2)


def smem_limit(device_kind: str) -> int:
    """Shared memory per block (bytes) Triton may use: Hopper/Blackwell 227 KiB (H100 reports
    232448), A100 163 KiB, anything else 99 KiB (sm_86/sm_89 class)."""
    kind = device_kind.upper()
    if any(name in kind for name in ("H100", "H200", "H800", "H20", "B200", "B100", "GB200")):
        return 232448
    if any(name in kind for name in ("A100", "A800")):
        return 166912
    return 101376


# Opt-in shared memory one thread block may use (bytes) by CUDA compute capability (the CUDA
# programming guide's "maximum amount of shared memory per thread block"; what the device reports
# as shared_memory_per_block_optin): V100 96 KiB, T4 64 KiB, A100 / Orin 163 KiB, sm_86 / sm_89
# 99 KiB, Hopper (H100 / H200 / GH200), datacenter Blackwell and Thor 227 KiB, sm_12x 99 KiB.
SMEM_PER_BLOCK_BY_CAPABILITY = {
    (7, 0): 98304, (7, 2): 98304, (7, 5): 65536, (8, 0): 166912, (8, 6): 101376,
    (8, 7): 166912, (8, 9): 101376, (9, 0): 232448, (10, 0): 232448, (10, 3): 232448,
    (11, 0): 232448, (12, 0): 101376, (12, 1): 101376,
}
# Off a GPU (lowering for CUDA with jax.export on a CPU host) Mosaic GPU checks against 227 KiB.
AOT_SMEM_PER_BLOCK = 232448


def _capability(device) -> tuple[int, int] | None:
    text = str(getattr(device, "compute_capability", "") or "")
    major, _, minor = text.partition(".")
    if not major.isdigit():
        return None
    return int(major), int(minor) if minor.isdigit() else 0


def device_smem_limit(device=None) -> int:
    """Opt-in shared memory per thread block of `device` (default: jax's first local device), in
    bytes: the device's own `shared_memory_per_block_optin` attribute (what Mosaic GPU checks a
    kernel against) when it has one, else `SMEM_PER_BLOCK_BY_CAPABILITY` by compute capability
    (an unlisted one: the largest listed capability at or below it, same major), else by device
    kind (`smem_limit`). A device that is not a GPU (lowering for CUDA on a CPU host) gets
    `AOT_SMEM_PER_BLOCK`, Mosaic GPU's own assumption there."""
    if device is None:
        import jax

        device = jax.local_devices()[0]
    reported = getattr(device, "shared_memory_per_block_optin", None)
    if isinstance(reported, int) and reported > 0:
        return reported
    if getattr(device, "platform", "gpu") != "gpu":
        return AOT_SMEM_PER_BLOCK
    capability = _capability(device)
    if capability is not None:
        same_major = [cc for cc in SMEM_PER_BLOCK_BY_CAPABILITY
                      if cc[0] == capability[0] and cc <= capability]
        if same_major:
            return SMEM_PER_BLOCK_BY_CAPABILITY[max(same_major)]
    return smem_limit(str(getattr(device, "device_kind", "")))


def heuristic_tiles(op: str, num_rows: int, in_dim: int, out_dim: int, style: str) -> TileConfig:
    """Tiles for a device with no table entry; style "gpu" (Triton) or "tpu" (Mosaic)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    if style == "tpu":
        return _tpu_heuristic(op, num_rows, in_dim, out_dim)
    return _gpu_heuristic(op, num_rows, in_dim, out_dim)


def _nearest_entry(op_table: dict, num_rows: int, in_dim: int, out_dim: int,
                   max_octaves: int = 2) -> dict | None:
    """The entry of this exact bucket, else of the same (in_dim, out_dim) buckets with the
    nearest row bucket within `max_octaves` powers of two (ties: the larger rows), else None."""
    key = shape_bucket(num_rows, in_dim, out_dim)
    if key in op_table:
        return op_table[key]
    rows = next_pow2(num_rows).bit_length()
    suffix = key.split("x", 1)[1]
    best = None
    for other, entry in op_table.items():
        other_rows, _, other_suffix = other.partition("x")
        if other_suffix != suffix or not other_rows.isdigit():
            continue
        distance = abs(int(other_rows).bit_length() - rows)
        rank = (distance, -int(other_rows))
        if distance <= max_octaves and (best is None or rank < best[0]):
            best = (rank, entry)
    return None if best is None else best[1]


def get_tile_config(
    device_kind: str,
    op: str,
    num_rows: int,
    in_dim: int,
    out_dim: int,
    style: str = "gpu",
    table: dict | None = None,
) -> TileConfig:
    """Table entry for (device_kind, op, shape bucket) over the heuristic's defaults.

    A bucket missing from the table takes the entry of the nearest row bucket of the same
    (in_dim, out_dim) buckets (within 4x rows); an unknown device, op or shape gets the
    heuristic. Non-TileConfig fields of an entry (measured times) are ignored.
    """
    base = heuristic_tiles(op, num_rows, in_dim, out_dim, style)
    table = load_table() if table is None else table
    entry = _nearest_entry(table.get(device_kind, {}).get(op, {}), num_rows, in_dim, out_dim)
    if not entry:
        return base
    known = {f.name for f in dataclasses.fields(TileConfig)}
    return dataclasses.replace(base, **{k: int(v) for k, v in entry.items() if k in known})
