"""Weights written into arrays that already exist (the server's warm start, issue 35).

`jaxlora-serve` builds its engine on zero weights of the right shapes (`placeholder_weights`: packed,
windowed, the KV pages sized after them as before) and starts loading its step programs (they need
shapes, not values), then `fill_weights` writes the checkpoint into the engine's weight arrays in
place: the reads run on `parallel_read`'s threads (GIL released), each layer's tensor goes to the
device as it is in the file and one compiled program writes it, transposed and cast, into its
layer and columns of the target (the target donated: no second copy of the weights, one layer's
tensor in flight). So the start-up pays max(weights, programs), not their sum. The values are the
same bits as `parallel_read.read_weights` followed by `models.packed.pack_projections`: the same
bytes, transposes and casts, the packed kernels' parts side by side in `PACKED_PROJECTIONS` order."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.models.llama import layer_key, weight_shapes
from jaxlora.nn.model_config import PACKED_PROJECTIONS, LlamaConfig
from jaxlora.weights.layout import Planned
from jaxlora.weights.parallel_read import READ_THREADS, BufferReader, buffer_layout

log = logging.getLogger("jaxlora.weights")


def placeholder_weights(config: LlamaConfig, dtype) -> dict[str, jax.Array]:
    """{model weight name: zeros [*its shape] in `dtype`} on the default device, made by one
    program (a weight's zeros cost a memset, not a transfer)."""
    shapes = weight_shapes(config)
    return _zeros(tuple(sorted((name, tuple(shape)) for name, shape in shapes.items())), jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _zeros(shapes: tuple, dtype) -> dict[str, jax.Array]:
    return {name: jnp.zeros(shape, dtype) for name, shape in shapes}


def remake_zeros(variables: Mapping) -> None:
    """Deletes the arrays of `variables` (name -> an nnx Variable holding zeros, a placeholder's
    weight on one device, uncommitted) and sets each to new zeros of its shape and dtype, made by one
    program once all are deleted: the new arrays lie side by side in device memory, where packing,
    the adapter window and split layers left the old ones between the holes of the arrays they
    replaced. ValueError for an array placed on a mesh (committed): placeholders are not."""
    arrays = {name: variable[...] for name, variable in variables.items()}
    if any(getattr(array, "_committed", False) for array in arrays.values()):
        raise ValueError("remake_zeros takes a placeholder's uncommitted arrays, not ones placed on devices")
    by_dtype: dict = {}
    for name, array in arrays.items():
        by_dtype.setdefault(np.dtype(array.dtype), []).append((name, tuple(array.shape)))
        array.delete()
    del arrays
    for dtype, shapes in by_dtype.items():
        for name, zeros in _zeros(tuple(sorted(shapes)), dtype).items():
            variables[name].set_value(zeros)


def targets(plan: Mapping[str, Planned]) -> dict[str, tuple[str, int]]:
    """{planned weight name: (the name of the array it is written into, its first column there)}:
    a projection of `PACKED_PROJECTIONS` goes into the packed kernel (bias) after the parts before
    it (their output widths: a piece's rows in the file's [out, in] layout); others into themselves."""
    out = {name: (name, 0) for name in plan}
    for parts, packed in PACKED_PROJECTIONS.items():
        for kind in ("kernel", "bias"):
            offset = 0
            for part in parts:
                name = f"layers.{part}.{kind}"
                if name in plan:
                    out[name] = (f"layers.{packed}.{kind}", offset)
                    offset += int(plan[name].pieces[0].shape[0])
    return out


def fill_weights(plan: Mapping[str, Planned], weights: Mapping, threads: int = 4, split_layers: bool = False) -> None:
    """Writes every planned weight (`layout.plan_weights` over `TensorRef`s) into `weights`
    (name -> an nnx Variable: `set_value` of the written array; the old one donated) at
    its `targets` place, transposed where the plan says, cast to the target's dtype; with
    `split_layers` a stacked weight's layer i goes into `layer_key(i, name)` (a `SplitLayersLlama`'s
    arrays) instead of the stack's row i. KeyError for a target `weights` lacks, ValueError for a
    piece that does not fit it; WeightsError when a file ends early. `threads`: those compiling the
    write programs meanwhile."""
    started = time.perf_counter()
    places = targets(plan)
    programs = _WritePrograms(plan, places, weights, threads, split_layers)
    with BufferReader(dict(plan)) as reader:
        for name, buffer in reader:
            place, offset = places[name]
            transpose = plan[name].transpose
            pieces = enumerate(buffer) if plan[name].stacked else [(None, buffer)]
            for layer, piece in pieces:
                key, row = _target(place, layer, split_layers)
                variable = weights[key]
                width = piece.shape[-2] if transpose else piece.shape[-1]
                if offset + width > variable[...].shape[-1]:
                    raise ValueError(f"{name}: columns [{offset}, {offset + width}) past {key}'s {variable[...].shape}")
                target = variable[...]
                write = programs(target, piece, row, transpose)
                variable.set_value(write(target, jax.device_put(piece), np.int32(row or 0), np.int32(offset)))
                del target  # donated
        jax.block_until_ready([weights[key][...] for key in programs.targets])
    log.info("weights: %.2f GB read in %.1f s by %d threads (%.2f GB/s), written on the device at %.1f s",
             reader.bytes / 1e9, reader.read_s, READ_THREADS, reader.bytes / 1e9 / max(reader.read_s, 1e-9),
             time.perf_counter() - started)


def _target(place: str, layer: int | None, split_layers: bool) -> tuple[str, int | None]:
    """(the array that layer `layer` (None: a weight without layers) of the `targets` place `place`
    is written into, its row there: the layer in a stack, None in an array of its own)."""
    if layer is None or not split_layers:
        return place, layer
    if not place.startswith("layers."):
        raise ValueError(f"{place}: a stacked weight outside the decoder layers cannot be split")
    return layer_key(layer, place[len("layers."):]), None


class _WritePrograms:
    """`_write` compiled once per distinct (target, piece, transpose, stacked) from the moment it is
    made, on `threads` threads (abstract shapes); called as programs(target, piece, layer, transpose).
    `targets`: the names of the arrays written."""

    def __init__(self, plan: Mapping[str, Planned], places: dict, weights: Mapping, threads: int,
                 split_layers: bool):
        keys, self.targets = set(), set()
        for name, planned in plan.items():
            place, _ = places[name]
            layers = range(len(planned.pieces)) if planned.stacked else [None]
            self.targets |= {_target(place, layer, split_layers)[0] for layer in layers}
            key, row = _target(place, 0 if planned.stacked else None, split_layers)
            target = weights[key][...]
            piece = jax.ShapeDtypeStruct(tuple(planned.pieces[0].shape), buffer_layout(planned)[1])  # a layer's
            keys.add(self._key(target, piece, row is not None, planned.transpose))
        pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jaxlora-write")
        self._compiled = {key: pool.submit(self._compile, *key) for key in keys}
        pool.shutdown(wait=False)

    @staticmethod
    def _key(target, piece, stacked: bool, transpose: bool) -> tuple:
        return (tuple(target.shape), np.dtype(target.dtype), tuple(piece.shape), np.dtype(piece.dtype), stacked,
                transpose)

    @staticmethod
    def _compile(target_shape, target_dtype, piece_shape, piece_dtype, stacked, transpose):
        scalar = jax.ShapeDtypeStruct((), np.int32)
        return _write.lower(jax.ShapeDtypeStruct(target_shape, target_dtype), jax.ShapeDtypeStruct(
            piece_shape, piece_dtype), scalar, scalar, stacked, transpose).compile()

    def __call__(self, target, piece, layer, transpose: bool):
        key = self._key(target, piece, layer is not None, transpose)
        if key not in self._compiled:
            raise ValueError(f"no write of a {piece.dtype}{piece.shape} piece into a {target.dtype}{target.shape} "
                             "array was planned")
        return self._compiled[key].result()


@functools.partial(jax.jit, static_argnums=(4, 5), donate_argnums=(0,))
def _write(target: jax.Array, piece: jax.Array, layer, offset, stacked: bool, transpose: bool) -> jax.Array:
    """target [L, ..., n] (or [..., n] unstacked) with layer `layer`'s last-axis entries [offset,
    offset + m) set to piece [..., m] ([m, k] transposed to [k, m] with `transpose`), cast."""
    value = (jnp.swapaxes(piece, -1, -2) if transpose else piece).astype(target.dtype)
    if stacked:
        value = value[None]
    if value.shape[:-1] != ((1,) if stacked else ()) + target.shape[stacked:-1] or value.shape[-1] > target.shape[-1]:
        raise ValueError(f"a {value.shape} piece does not fit a {target.shape} target")
    start = ((layer,) if stacked else ()) + (0,) * (value.ndim - 1 - stacked) + (offset,)
    return jax.lax.dynamic_update_slice(target, value, start)
