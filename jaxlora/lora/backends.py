"""The registry of LoRA backends: each way of computing the LoRA rows of a projection is one
`LoraBackend` carrying its functions (from `jaxlora.lora.ops`) and its facts; configs validate
names here (`get`, `names`), the command lines take their choices from here, and `resolve` says
what `auto` means on a platform. No code elsewhere tests a backend by its name.

A name is resolved once, at the edge (the serving command line and `EngineConfig`, `TrainConfig`,
the model's and `generate`'s public calls), into its `LoraBackend` (`get`); the object is what
travels down to the projections (`jaxlora.lora.project.LayerLora`). `DEFAULT` is the backend of a
call that names none; `TRAINING_DEFAULT` that of a training config that names none.

  gather, onehot, ragged_dot, loop   XLA ops (GSPMD partitions them: tensor-parallel serving);
  pallas                             the SGMV/BGMV kernels in the device's style (the GPU style
                                     in interpret mode on a CPU); pallas_gpu, pallas_tpu: one
                                     style explicitly (interpret mode off its own backend);
  hybrid                             serving: with a `ServingPlan`, the BGMV kernels on the one-
                                     token rows and, on a mixed step, a segment GEMM over the
                                     step's first prefill segments' own A/B (`ops.segment_*`);
                                     the one-hot GEMMs with a `LoraPlan` (bench/NOTES_serve.md);
  hybrid_xla                         hybrid with a decode-only step's LoRA in elementwise form for
                                     XLA to fuse (`ops.elementwise_*`; an experiment, issue 34);
  fused, fused_tpu                   training: x @ W and the LoRA in one fused kernel, inside
                                     the projection (`jaxlora.lora.project`);
  compressed                         serving: a compressed collection's adapters from shared
                                     bases (Compress-then-Serve), mixed with the pool's adapters
                                     (`jaxlora.lora.compressed`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jaxlora.lora import compressed, ops
from jaxlora.lora.plan import LoraPlan, ServingPlan

AUTO = "auto"
DEFAULT = "gather"  # the model, `generate`, the grad step and the serving engine, when none is named
TRAINING_DEFAULT = "onehot"  # `TrainConfig`, the MPMD pipeline: the fastest XLA path for a few adapters
# (bench/results/sgmv_h100.json)
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class LoraBackend:
    """One LoRA backend: its functions and its facts.

    plan_type: the plan class the serving engine builds for it (`LoraPlan`, or `ServingPlan`: rows
      ordered once per step, so the kernels move no rows).
    partitionable: GSPMD can partition it over a mesh (plain XLA ops): it serves tensor parallel.
    custom_kernel: it runs a `pallas_call` (no SPMD rule, no varying-axes types under shard_map).
    serves / trains: the serving engine / the trainer accept it.
    row_delta: (rows [N, k], a layer's pool, plan) -> [N, n] float32; None where it computes
      nothing itself (hybrid routes, the fused backends work inside the projection).
    in_place, in_place_group: with a `ServingPlan`, `ops.pallas_accumulate` and its grouped form
      (the delta added in place into the projection's output); None: y + delta.
    in_place_packed: the grouped form on projections' outputs side by side in one array
      (`ops.pallas_accumulate_packed`; decode-only plans), or None: cut apart, `in_place_group`.
    fused_linear: the fused projection (`ops.fused_linear`), or None.
    route: plan -> the backend that computes that plan (hybrid), or None: itself.
    shared_basis: it serves the adapters of a compressed collection (`jaxlora.lora.compressed`).
    adds_in_input_dtype: the projection's output stays in x's dtype and the LoRA is added to it in
      that dtype (as PEFT adds it; a bf16 GEMM writes bf16), not in float32.
    segment_window: the most prefill segments its mixed `ServingPlan`s should hold (a mixed step's
      segment GEMM covers that many; the engine plans no more: `jaxlora.lora.ops.SEGMENT_WINDOW`);
      None: no bound.
    tail_segments: over paged pools (unified paging), a mixed `ServingPlan` of it covers the one-token
      rows with segments too (`build_serving_plan`), so its kernels are the paged SGMV pair alone:
      no BGMV pair and no row gather, half the launches of a mixed step's projection.
    """

    name: str
    plan_type: type
    partitionable: bool
    custom_kernel: bool
    serves: bool
    trains: bool
    row_delta: Callable | None = None
    in_place: Callable | None = None
    in_place_group: Callable | None = None
    in_place_packed: Callable | None = None
    fused_linear: Callable | None = None
    route: Callable | None = None
    shared_basis: bool = False
    adds_in_input_dtype: bool = False
    segment_window: int | None = None
    tail_segments: bool = False

    def __reduce_ex__(self, protocol):
        """A registry backend pickles and copies as its name: the copy is the registry's own object,
        equal to it (a program jitted with it as a static argument is found again), as the name was."""
        if _REGISTRY.get(self.name) is self:
            return get, (self.name,)
        return super().__reduce_ex__(protocol)

    @property
    def fused(self) -> bool:
        """The LoRA runs inside the projection's own kernel (`fused_linear`), not as a delta."""
        return self.fused_linear is not None

    def for_plan(self, plan) -> LoraBackend:
        """The backend that computes `plan` (hybrid picks one; every other backend is itself)."""
        return self if self.route is None else self.route(plan)

    def delta(self, x: jax.Array, module_pool, plan) -> jax.Array:
        """The LoRA output of one projection: x [..., k] in the plan's row order; module_pool a
        layer's dict or a `ops.StackedModulePool`; plan a `LoraPlan` or `ServingPlan` over the
        rows. Returns [..., n] in x's dtype, zero for rows whose slot is -1."""
        backend = self.for_plan(plan)
        if backend.row_delta is None:
            raise ValueError(f"the {self.name} LoRA backend computes no delta: it runs inside the projection "
                             f"(jaxlora.lora.project)")
        delta = backend.row_delta(x.reshape(-1, x.shape[-1]), ops.layer_pool(module_pool), plan)
        return delta.reshape(*x.shape[:-1], delta.shape[-1]).astype(x.dtype)

    def accumulate(self, y: jax.Array, x: jax.Array, module_pool, plan) -> jax.Array:
        """y [..., n] float32 (a projection's output) plus the LoRA of x [..., k]: in place with a
        `ServingPlan` where the backend can, else `delta` rounded to x's dtype added."""
        backend = self.for_plan(plan)
        if backend.in_place is not None and isinstance(plan, ServingPlan):
            return backend.in_place(y, x, module_pool, plan)
        return y + backend.delta(x, module_pool, plan).astype(_F32)

    def accumulate_packed(self, y: jax.Array, widths, x: jax.Array, module_pools, plan) -> jax.Array | None:
        """`accumulate_group` for projections whose outputs lie side by side in y [..., sum(widths)]
        (a packed kernel's), in place on y (`in_place_packed`: no projection's columns cut out of y);
        None where the backend has no such kernel for `plan` (the caller cuts y apart and takes
        `accumulate_group`)."""
        backend = self.for_plan(plan)
        if backend.in_place_packed is None or not isinstance(plan, ServingPlan):
            return None
        return backend.in_place_packed(y, widths, x, module_pools, plan)

    def accumulate_group(self, ys, x: jax.Array, module_pools, plan) -> tuple:
        """`accumulate` for several projections of one input x [..., k] (q/k/v, gate/up): ys their
        float32 outputs [..., n_g], module_pools their pools; grouped kernels where the backend
        has them (`in_place_group`), else one `accumulate` each."""
        backend = self.for_plan(plan)
        if backend.in_place_group is not None and isinstance(plan, ServingPlan):
            return backend.in_place_group(ys, x, module_pools, plan)
        return tuple(backend.accumulate(y, x, pool, plan) for y, pool in zip(ys, module_pools))


def _xla(name: str, row_delta: Callable) -> LoraBackend:
    return LoraBackend(name, LoraPlan, partitionable=True, custom_kernel=False, serves=True, trains=True,
                       row_delta=row_delta)


def _pallas(name: str, style: str | None) -> LoraBackend:
    return LoraBackend(name, ServingPlan, partitionable=False, custom_kernel=True, serves=True, trains=True,
                       row_delta=functools.partial(ops.pallas_delta, style=style),
                       in_place=functools.partial(ops.pallas_accumulate, style=style),
                       in_place_group=functools.partial(ops.pallas_accumulate_group, style=style),
                       in_place_packed=functools.partial(ops.pallas_accumulate_packed, style=style),
                       tail_segments=True)


def _fused(name: str, style: str | None) -> LoraBackend:
    return LoraBackend(name, LoraPlan, partitionable=False, custom_kernel=True, serves=False, trains=True,
                       fused_linear=functools.partial(ops.fused_linear, style=style))


# hybrid's route for a mixed ServingPlan (not a registry name of its own): the segment GEMM over
# the step's first prefill segments (only their A/B gathered, once per step), BGMV for every other
# LoRA row; SGMV measured +37 ms and the one-hot GEMMs over all slots +9.9 ms on an 11 ms mixed
# step of the H200 (bench/NOTES_serve.md).
_HYBRID_MIXED = LoraBackend("hybrid", ServingPlan, partitionable=False, custom_kernel=True, serves=True, trains=False,
                            row_delta=ops.segment_delta, in_place=ops.segment_accumulate,
                            in_place_group=ops.segment_accumulate_group, adds_in_input_dtype=True)


# hybrid's route for a decode-only ServingPlan: the BGMV kernels in place on the projection's
# output in the activations' dtype (the base GEMM writes bf16, the kernels add into it).
_HYBRID_DECODE = dataclasses.replace(_pallas("hybrid", None), trains=False, adds_in_input_dtype=True,
                                     tail_segments=False)


def _hybrid_route(plan) -> LoraBackend:
    """With a `ServingPlan`: BGMV alone on a decode-only step, the segment GEMM + BGMV on a mixed
    one (both adding into the outputs in the activations' dtype); with any other plan the
    one-hot GEMMs."""
    if not isinstance(plan, ServingPlan):
        return _REGISTRY["onehot"]
    return _HYBRID_DECODE if plan.seg_starts is None else _HYBRID_MIXED


# hybrid_xla's route for a decode-only ServingPlan: the LoRA in elementwise form (`ops.elementwise_*`:
# no kernel of its own, for XLA to fuse into the projection's consumers), in the activations' dtype.
_HYBRID_DECODE_XLA = LoraBackend("hybrid_xla", ServingPlan, partitionable=False, custom_kernel=False, serves=True,
                                 trains=False, row_delta=ops.elementwise_delta, in_place=ops.elementwise_accumulate,
                                 in_place_group=ops.elementwise_accumulate_group,
                                 in_place_packed=ops.elementwise_accumulate_packed, adds_in_input_dtype=True)


def _hybrid_xla_route(plan) -> LoraBackend:
    """hybrid's route with the decode-only step's LoRA in elementwise form (an experiment of issue
    34 item 3 against the BGMV pair: bench/NOTES_serve.md, nineteenth session)."""
    if isinstance(plan, ServingPlan) and plan.seg_starts is None:
        return _HYBRID_DECODE_XLA
    return _hybrid_route(plan)


_REGISTRY: dict[str, LoraBackend] = {backend.name: backend for backend in (
    _xla("gather", ops.gather_delta),
    _xla("onehot", ops.onehot_delta),
    _xla("ragged_dot", ops.ragged_dot_delta),
    _xla("loop", ops.loop_delta),
    _pallas("pallas", None),
    _pallas("pallas_gpu", "gpu"),
    _pallas("pallas_tpu", "tpu"),
    LoraBackend("hybrid", ServingPlan, partitionable=False, custom_kernel=True, serves=True, trains=True,
                route=_hybrid_route, segment_window=ops.SEGMENT_WINDOW),
    LoraBackend("hybrid_xla", ServingPlan, partitionable=False, custom_kernel=True, serves=True, trains=False,
                route=_hybrid_xla_route, segment_window=ops.SEGMENT_WINDOW),
    _fused("fused", None),
    _fused("fused_tpu", "tpu"),
    LoraBackend("compressed", LoraPlan, partitionable=False, custom_kernel=False, serves=True, trains=False,
                row_delta=compressed.compressed_delta, shared_basis=True),
)}

# What a backend without the fact cannot do, for `get`'s errors.
_CANNOT = {"serves": "cannot serve (a training kernel)", "trains": "cannot train",
           "partitionable": "cannot run tensor parallel (a pallas_call has no GSPMD partitioning rule)"}


def names(**facts: bool) -> tuple[str, ...]:
    """Names of the backends whose facts match (e.g. `names(serves=True)`), in registry order."""
    return tuple(name for name, backend in _REGISTRY.items()
                 if all(getattr(backend, fact) == value for fact, value in facts.items()))


def get(name: str | LoraBackend, **facts: bool) -> LoraBackend:
    """The backend called `name` (a `LoraBackend` is taken as it is); ValueError, listing the valid
    names, for an unknown name or a backend without the facts asked for (serves, trains,
    partitionable: e.g. `get(name, serves=True)`). The edges call it once; below them the object
    travels."""
    if isinstance(name, LoraBackend):
        return check(name, **facts)
    if name not in _REGISTRY:
        raise ValueError(f"unknown LoRA backend {name!r}; choose from {', '.join(names(**facts))}")
    return check(_REGISTRY[name], **facts)


def check(backend: LoraBackend, **facts: bool) -> LoraBackend:
    """`backend` itself; ValueError, listing the backends that have them, if it lacks one of the
    facts asked for (`get`)."""
    for fact, value in facts.items():
        if getattr(backend, fact) != value:
            raise ValueError(f"LoRA backend {backend.name!r} {_CANNOT[fact]}; use one of {', '.join(names(**facts))}")
    return backend


def resolve(name: str, platform: str, tensor_parallel: int = 1) -> str:
    """The backend `auto` means on `platform` ("gpu", "tpu", "cpu"): on one GPU "hybrid" (BGMV
    kernels on one-token rows, a segment GEMM on prefill chunks; bench/NOTES_serve.md); with tensor
    parallel on a GPU, or on a TPU, "onehot" (XLA GEMMs, partitionable; the kernels are unmeasured
    on TPU); on a CPU "gather". Any other name is returned as given."""
    if name != AUTO:
        return name
    if platform == "gpu":
        return "hybrid" if tensor_parallel == 1 else "onehot"
    return "onehot" if platform == "tpu" else "gather"
