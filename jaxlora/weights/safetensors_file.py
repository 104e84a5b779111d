"""A safetensors file's tensors as references (file, byte offset, dtype, shape), read straight into
a caller's buffer with `os.preadv`, which releases the GIL: threads read in parallel, each byte
copied once out of the page cache (the safetensors library's `get_tensor` copies every tensor into
a fresh array under the GIL: ~1 GB/s on an 8B checkpoint whatever the threads; issue 35).

The format: an 8-byte little-endian header length N, N bytes of JSON {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}, then the data, offsets relative to its start."""

from __future__ import annotations

import dataclasses
import json
import os
import struct

import ml_dtypes
import numpy as np

from jaxlora.weights.errors import WeightsError

DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
          "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "U8": np.uint8, "U16": np.uint16,
          "U32": np.uint32, "U64": np.uint64, "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn,
          "F8_E5M2": ml_dtypes.float8_e5m2}
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's bound


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """One tensor of a file: its C-ordered bytes at `offset` of `file`, `dtype`, `shape`."""

    file: str
    name: str
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def __getitem__(self, rows: slice) -> "TensorRef":
        """The rows `rows` (a step-1 slice of the first axis: contiguous bytes) as a reference."""
        start, stop, step = rows.indices(self.shape[0] if self.shape else 0)
        if step != 1 or not self.shape:
            raise ValueError("a TensorRef slices only contiguous rows")
        row_bytes = self.nbytes // max(self.shape[0], 1)
        return dataclasses.replace(self, offset=self.offset + start * row_bytes,
                                   shape=(max(stop - start, 0),) + self.shape[1:])

    def chunks(self, out: np.ndarray, chunk_bytes: int) -> list[tuple[int, memoryview]]:
        """[(file offset, byte view of `out`)] of pieces of at most `chunk_bytes` (>= one row):
        reading each (`read_chunk`) fills `out` [shape] (`dtype`, C-contiguous)."""
        if out.shape != self.shape or out.dtype != self.dtype or not out.flags.c_contiguous:
            raise ValueError(f"{self.name}: buffer {out.dtype}{out.shape} for a tensor {self.dtype}{self.shape}")
        data = memoryview(out.reshape(-1).view(np.uint8))
        step = max(chunk_bytes, 1)
        return [(self.offset + start, data[start:start + step]) for start in range(0, self.nbytes, step)]

    def read(self) -> np.ndarray:
        """The tensor as a new array (one thread)."""
        out = np.empty(self.shape, self.dtype)
        for offset, view in self.chunks(out, max(self.nbytes, 1)):
            read_chunk(self.file, offset, view, self.name)
        return out


def read_chunk(file: str, offset: int, view: memoryview, name: str = "") -> None:
    """Fills `view` with the bytes of `file` from `offset` (WeightsError if the file ends first)."""
    fd = os.open(file, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise WeightsError(f"{file}: cannot read tensor {name}: the file ends at byte {offset + done}")
            done += got
    finally:
        os.close(fd)


def read_header(file: str) -> dict[str, TensorRef]:
    """{tensor name: `TensorRef`} of a safetensors file; WeightsError naming the file when it is
    not one (a header that does not parse, a tensor past the end: truncated or corrupt)."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"header length {length} in a file of {size} bytes")
            header = json.loads(f.read(length))
        return _refs(file, header, 8 + length, size)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as err:
        raise WeightsError(f"{file}: cannot read safetensors (truncated or corrupt?): {err}") from err


def _refs(file: str, header: dict, data_start: int, size: int) -> dict[str, TensorRef]:
    """The header's tensors, each checked: a known dtype, its offsets spanning shape x itemsize
    bytes inside the file (ValueError otherwise)."""
    refs = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"tensor {name} has dtype {entry['dtype']!r} (not one of {', '.join(DTYPES)})")
        begin, end = (int(x) for x in entry["data_offsets"])
        ref = TensorRef(file, name, data_start + begin, np.dtype(DTYPES[entry["dtype"]]),
                        tuple(int(d) for d in entry["shape"]))
        if end - begin != ref.nbytes or begin < 0 or data_start + end > size:
            raise ValueError(f"tensor {name} spans bytes [{begin}, {end}) of the data; its shape {ref.shape} needs "
                             f"{ref.nbytes}, the file holds {size - data_start}")
        refs[name] = ref
    return refs
