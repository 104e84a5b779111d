"""The model's arrays from planned safetensors tensors (`layout.plan_weights` over
`safetensors_file.TensorRef`s): `READ_THREADS` threads fill one contiguous host buffer per model
weight ([L, *piece] for a stacked one, in the file's dtype) with `read_chunk`s of at most
`CHUNK_BYTES` (GIL released: the reads run beside everything else), up to `AHEAD_BYTES` of weights
ahead of the one being placed. Each buffer then goes to the device as one transfer, and one
compiled program there transposes it to the model's [L, in, out] and casts it (the programs,
one per distinct shape, compile on their own threads while the first weights are read); on a CPU
numpy does both on the host, as `layout._assemble` does. Same values as `layout.stack_weights`,
bit for bit: the same bytes, the same transpose and cast.

Why (issue 35): the safetensors library copies each tensor into a new array under the GIL (~1 GB/s
on the H200 machine whatever the threads), then each of 291 tensors went to the device on its own
and 32 of them were stacked there: 16.5 s of a 34 s warm start for 16 GB."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.weights.layout import Planned, on_host
from jaxlora.weights.safetensors_file import TensorRef, read_chunk

log = logging.getLogger("jaxlora.weights")

READ_THREADS = 8
CHUNK_BYTES = 64 << 20
AHEAD_BYTES = 4 << 30


def read_weights(plan: dict[str, Planned], dtype) -> dict[str, jax.Array]:
    """{model weight name: array [*model shape] in `dtype` on the default device} of `plan`
    (pieces: `TensorRef`s); WeightsError (from `read_chunk`) when a file ends early."""
    dtype, host = jnp.dtype(dtype), on_host()
    started = time.perf_counter()
    programs = None if host else LayoutPrograms(plan, dtype)
    weights = {}
    with BufferReader(plan) as reader:
        for name, buffer in reader:
            weights[name] = place(buffer, plan[name].transpose, dtype, programs)
        jax.block_until_ready(list(weights.values()))
    seconds = time.perf_counter() - started
    log.info("weights: %.2f GB read in %.1f s by %d threads (%.2f GB/s), on the device at %.1f s", reader.bytes / 1e9,
             reader.read_s, READ_THREADS, reader.bytes / 1e9 / max(reader.read_s, 1e-9), seconds)
    return weights


def buffer_layout(planned: Planned) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of a weight's host buffer: [L, *piece] stacked, else the piece's; the
    pieces' common dtype (numpy's promotion, as `jnp.stack` of them)."""
    pieces = planned.pieces
    shape = ((len(pieces),) if planned.stacked else ()) + tuple(pieces[0].shape)
    return shape, np.result_type(*(piece.dtype for piece in pieces))


class BufferReader:
    """Iterates (name, filled host buffer) over `plan` in its order; the reads of the next weights
    run on `threads` threads meanwhile, at most `ahead_bytes` of buffers (at least one) not yet
    taken. `bytes`: bytes of the buffers taken; `read_s`: see there. A
    context manager: leaving it cancels the reads not started."""

    def __init__(self, plan: dict[str, Planned], threads: int | None = None, chunk_bytes: int | None = None,
                 ahead_bytes: int | None = None):
        self._plan, self._order = plan, list(plan)
        self._chunk = chunk_bytes or CHUNK_BYTES
        self._ahead = AHEAD_BYTES if ahead_bytes is None else ahead_bytes
        self._pool = concurrent.futures.ThreadPoolExecutor(threads or READ_THREADS, thread_name_prefix="jaxlora-read")
        self._pending: dict[str, tuple[np.ndarray, list]] = {}
        self._next, self._started, self._last = 0, time.perf_counter(), None
        self.bytes = 0

    @property
    def read_s(self) -> float:
        """Seconds from the reader's start to the end of the last read so far."""
        return 0.0 if self._last is None else self._last - self._started

    def _read(self, file: str, offset: int, view: memoryview, name: str) -> None:
        read_chunk(file, offset, view, name)
        self._last = time.perf_counter()

    def _submit(self, name: str) -> None:
        planned = self._plan[name]
        shape, dtype = buffer_layout(planned)
        buffer = np.empty(shape, dtype)
        futures = []
        for i, piece in enumerate(planned.pieces):
            target = buffer[i] if planned.stacked else buffer
            if piece.dtype != dtype:  # a piece of another dtype: read, then cast (widening) into place
                futures.append(self._pool.submit(_read_cast, piece, target))
                continue
            futures += [self._pool.submit(self._read, piece.file, offset, view, piece.name)
                        for offset, view in piece.chunks(target, self._chunk)]
        self._pending[name] = (buffer, futures)

    def _fill(self) -> None:
        """Submits the next weights' reads while fewer than `ahead_bytes` are pending (or none)."""
        while self._next < len(self._order) and (
                not self._pending or sum(b.nbytes for b, _ in self._pending.values()) < self._ahead):
            self._submit(self._order[self._next])
            self._next += 1

    def __iter__(self):
        for name in self._order:
            self._fill()
            buffer, futures = self._pending.pop(name)
            for future in futures:
                future.result()
            self.bytes += buffer.nbytes
            self._fill()
            yield name, buffer

    def __enter__(self) -> "BufferReader":
        return self

    def __exit__(self, *exc) -> None:
        self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)


def _read_cast(piece: TensorRef, target: np.ndarray) -> None:
    target[...] = piece.read()


def place(buffer: np.ndarray, transpose: bool, dtype: np.dtype, programs: "LayoutPrograms | None") -> jax.Array:
    """A weight's host buffer [..., a, b] as the model's array ([..., b, a] with `transpose`) in
    `dtype`: on the device through `programs` (one transfer, one compiled copy), or with
    `programs` None on the host (numpy; one copy, none when nothing changes)."""
    if programs is not None:
        if not transpose and buffer.dtype == dtype:
            return jax.device_put(buffer)
        return programs(jax.device_put(buffer), transpose)
    if not transpose and buffer.dtype == dtype:
        return jnp.asarray(buffer)
    out = np.empty(buffer.shape[:-2] + buffer.shape[:-3:-1] if transpose else buffer.shape, dtype)
    out[...] = np.swapaxes(buffer, -1, -2) if transpose else buffer
    return jnp.asarray(out)


class LayoutPrograms:
    """The device copies `place` runs (transpose and cast), one compiled program per distinct
    (buffer shape, dtype, transpose), compiled on `threads` threads from the moment it is made
    (abstract shapes: no weight needed). Called as programs(device buffer, transpose)."""

    def __init__(self, plan: dict[str, Planned], dtype: np.dtype, threads: int = 4):
        self._dtype = dtype
        keys = {buffer_layout(planned) + (planned.transpose,) for planned in plan.values()}
        keys = {key for key in keys if key[2] or key[1] != dtype}
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jaxlora-layout")
        self._compiled = {key: self._pool.submit(self._compile, *key) for key in keys}
        self._pool.shutdown(wait=False)

    def _compile(self, shape, dtype, transpose: bool):
        return _device_layout.lower(jax.ShapeDtypeStruct(shape, dtype), transpose, self._dtype).compile()

    def __call__(self, buffer: jax.Array, transpose: bool) -> jax.Array:
        future = self._compiled.get((tuple(buffer.shape), np.dtype(buffer.dtype), transpose))
        if future is None:  # not planned: compiled on first use
            return _device_layout(buffer, transpose, self._dtype)
        return future.result()(buffer)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _device_layout(buffer: jax.Array, transpose: bool, dtype) -> jax.Array:
    """[..., a, b] -> [..., b, a] if `transpose`, cast to `dtype` (one fused copy)."""
    return (jnp.swapaxes(buffer, -1, -2) if transpose else buffer).astype(dtype)
