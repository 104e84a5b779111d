"""Reading a safetensors file the way a busy server should: the whole file in one read, tensors as
numpy views of that buffer (no copy per tensor), and checks over all of them in a few numpy calls.

Why not `safetensors.safe_open(...).get_tensor(key)` per tensor: a server's disk reader threads run
beside the engine thread, which holds the GIL most of the time. Every call that releases the GIL
(a file read, a large numpy copy) then costs the reader up to the interpreter's switch interval
(5 ms) before it runs again, so the cost of a read is the count of such calls times 5 ms, not its
bytes: an 8B-shaped PEFT adapter of 128 tensors took ~0.7 s beside a thread that keeps the GIL
busy and ~10 ms alone (bench/NOTES_serve.md, issue 34 item 5). Here a read is 4 system calls
(open, fstat, one read, close); `TensorFile.maybe_nonfinite` is one numpy call per dtype.

Format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N, N
bytes of JSON {key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the data; offsets are relative to the data's start, the tensors tile it without gaps
(checked, as the reference implementation does), little-endian, C order."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

import ml_dtypes
import numpy as np

DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype("<u1"), "I8": np.dtype("<i1"), "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"), "U32": np.dtype("<u4"), "I32": np.dtype("<i4"), "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
MAX_HEADER_BYTES = 100 << 20  # the reference implementation's limit

_OTHER_FLOATS = ("bfloat16", "float8_e4m3fn", "float8_e5m2")  # float dtypes numpy does not call kind "f"


class SafetensorsError(ValueError):
    """The file is not a well-formed safetensors file (truncated, corrupt header, bad offsets)."""


@dataclasses.dataclass(frozen=True)
class TensorFile:
    """A safetensors file read whole. buffer: uint8 [file bytes]; data_start: where the data begins
    in it; entries: {key: (dtype, shape, begin, end)} (offsets relative to data_start), in the
    file's order."""

    buffer: np.ndarray
    data_start: int
    entries: dict
    header: bytes = b""  # the JSON header as read: files with equal headers lay their tensors out alike

    def tensor(self, key: str) -> np.ndarray:
        """Tensor `key` as a view of the buffer (no copy)."""
        dtype, shape, begin, end = self.entries[key]
        start = self.data_start + begin
        return self.buffer[start:self.data_start + end].view(dtype).reshape(shape)

    def tensors(self) -> dict[str, np.ndarray]:
        """{key: view} of every tensor, in the file's order."""
        return {key: self.tensor(key) for key in self.entries}

    def maybe_nonfinite(self) -> bool:
        """False when every floating-point tensor is finite; True when one may hold NaN or Inf (the
        caller then checks exactly). One numpy call per run of tensors of one dtype (one run when
        the file has one dtype, the usual case): their float32 (float64) sum, which is NaN or Inf
        if any value is, and otherwise only when the sum overflows."""
        for dtype, spans in self._spans().items():
            if not (dtype.kind == "f" or dtype.name in _OTHER_FLOATS):
                continue
            total = np.float64 if dtype.itemsize == 8 else np.float32
            for start, stop in spans:
                if not np.isfinite(np.add.reduce(self.buffer[start:stop].view(dtype), dtype=total)):
                    return True
        return False

    def _spans(self) -> dict:
        """{dtype: [(start, stop)]}: maximal runs of the buffer held by tensors of one dtype."""
        spans: dict = {}
        for dtype, _, begin, end in sorted(self.entries.values(), key=lambda e: e[2]):
            runs = spans.setdefault(dtype, [])
            start, stop = self.data_start + begin, self.data_start + end
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], stop)
            elif stop > start:
                runs.append((start, stop))
        return spans


def read_file(file: str) -> np.ndarray:
    """The bytes of `file` as a uint8 array, in one read (module doc): FileNotFoundError, OSError."""
    fd = os.open(file, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        buffer = np.empty(size, np.uint8)
        done = 0
        while done < size:
            got = os.readv(fd, [buffer[done:]])
            if got == 0:
                return buffer[:done]  # the file shrank meanwhile: parse reports it
            done += got
        return buffer
    finally:
        os.close(fd)


def load(file: str) -> TensorFile:
    """`file` read (`read_file`) and parsed (`parse`)."""
    return parse(read_file(file))


def parse(buffer: np.ndarray) -> TensorFile:
    """The header of a safetensors file held in `buffer` (uint8), checked: SafetensorsError if it is
    truncated, its header is not a JSON object of tensor entries, or the offsets do not tile the data."""
    if buffer.size < 8:
        raise SafetensorsError(f"file of {buffer.size} bytes is shorter than the 8-byte header length")
    length = int(buffer[:8].view("<u8")[0])
    if length > min(MAX_HEADER_BYTES, buffer.size - 8):
        raise SafetensorsError(f"header of {length} bytes does not fit a file of {buffer.size} bytes")
    raw, data_start = buffer[8:8 + length].tobytes(), 8 + length
    kept = _kept_entries if length <= KEPT_HEADER_BYTES else _parsed_entries
    return TensorFile(buffer, data_start, kept(raw, buffer.size - data_start), raw)


KEPT_HEADER_BYTES = 1 << 20  # headers up to this size have their checked entries kept (an adapter's: ~10-100 KB)


@functools.lru_cache(maxsize=256)
def _kept_entries(raw: bytes, data_bytes: int) -> dict:
    """`_parsed_entries`, kept per (header, data size): adapters trained with one config have equal
    headers, so a server reading thousands of them parses and checks each layout once (its reader
    threads hold the GIL for the per-tensor Python work, ~1 ms a 128-tensor file, while the engine
    thread waits for it). Callers must not change the dict."""
    return _parsed_entries(raw, data_bytes)


def _parsed_entries(raw: bytes, data_bytes: int) -> dict:
    """{key: (dtype, shape, begin, end)} of a header's tensors, checked against `data_bytes` of data."""
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SafetensorsError(f"header is not valid JSON: {err}") from None
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    entries = {key: _entry(key, value) for key, value in header.items() if key != "__metadata__"}
    _check_tiling(entries, data_bytes)
    return entries


def _entry(key: str, value) -> tuple:
    """(dtype, shape, begin, end) of one header entry, checked."""
    if not isinstance(value, dict):
        raise SafetensorsError(f"tensor {key!r}: header entry is not an object")
    dtype = DTYPES.get(value.get("dtype"))
    shape, offsets = value.get("shape"), value.get("data_offsets")
    if dtype is None:
        raise SafetensorsError(f"tensor {key!r}: unsupported dtype {value.get('dtype')!r}")
    if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise SafetensorsError(f"tensor {key!r}: bad shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise SafetensorsError(f"tensor {key!r}: bad data_offsets {offsets!r}")
    if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:  # Python ints: no numpy call per tensor
        raise SafetensorsError(f"tensor {key!r}: data_offsets {offsets} do not hold shape {shape} of {dtype}")
    return dtype, tuple(shape), offsets[0], offsets[1]


def _check_tiling(entries: dict, data_bytes: int) -> None:
    """The tensors cover the data region exactly, without gaps or overlaps (else: truncated or corrupt)."""
    end = 0
    for _, _, begin, stop in sorted(entries.values(), key=lambda e: (e[2], e[3])):
        if begin != end:
            raise SafetensorsError(f"tensor data is not contiguous (a gap or overlap at byte {begin})")
        end = stop
    if end != data_bytes:
        raise SafetensorsError(f"the tensors hold {end} bytes of data, the file {data_bytes} (truncated?)")
