"""A compressed collection of LoRA adapters (Compress-then-Serve) and how it is made, grown and
read back as ordinary adapters.

`compress(sources, base, method, rank, clusters)` compresses every layer of every target module
on its own (`jaxlora.compress.methods`), cluster by cluster, from the adapters' stacked factors
(one layer and module at a time on the device, so memory stays bounded by one stack). Tensors,
in the kernels' layout (y = x @ ΔW), per module m:

  svd:           m.a [L, N, k, r], m.b [L, N, r, n]          (each adapter at rank r)
  jd-full/diag:  m.basis_in [L, C, k, r], m.basis_out [L, C, r, n] (each cluster's bases),
                 m.sigma [L, N, r, r] (JD-Full) or [L, N, r] (JD-Diag diagonals)

so adapter i's ΔW at layer l is basis_in[l, c_i] @ Σ_i @ basis_out[l, c_i] (scales folded in).
`add` projects new adapters onto the existing bases (the paper's "new LoRA" case) and
`recompress` compresses sources and new adapters again from scratch."""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.compress import clusters as clustering
from jaxlora.compress import methods
from jaxlora.lora.adapter import LoraAdapter, ModuleLora
from jaxlora.lora.compressed import SharedBasisSet
from jaxlora.lora.adapter_config import AdapterError, LoraConfig
from jaxlora.nn.model_config import PROJECTIONS, LlamaConfig, projection_shapes

METHODS = ("svd", "jd-full", "jd-diag")
JOINT = ("jd-full", "jd-diag")


@dataclasses.dataclass(frozen=True)
class Source:
    """One input adapter: its weights, the base model its config names ("" if none), a content
    hash (sha256 of its files, or of its weights) and where it was read from ("" if in memory)."""

    adapter: LoraAdapter
    base_model: str = ""
    sha256: str = ""
    path: str = ""

    @property
    def name(self) -> str:
        return self.adapter.name


@dataclasses.dataclass
class CompressedCollection:
    """See the module doc. errors: {adapter: {module: relative Frobenius error over all layers}};
    sources: [{"name", "base_model", "sha256", "path"}] in adapter order; cluster [N] int."""

    method: str
    rank: int
    base_model: str
    num_layers: int
    shapes: dict[str, tuple[int, int]]
    names: list[str]
    cluster: np.ndarray
    tensors: dict[str, np.ndarray]
    errors: dict[str, dict[str, float]]
    sources: list[dict]

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(m for m in PROJECTIONS if m in self.shapes)

    @property
    def num_clusters(self) -> int:
        return int(self.cluster.max()) + 1 if len(self.cluster) else 0

    def index(self, name: str) -> int:
        if name not in self.names:
            raise KeyError(f"no adapter {name!r} in the collection")
        return self.names.index(name)

    def factors(self, name: str, module: str) -> tuple[np.ndarray, np.ndarray]:
        """Adapter `name`'s compressed ΔW of `module` as one LoRA of rank r: (a [L, k, r], b [L, r, n])."""
        i = self.index(name)
        if self.method == "svd":
            return self.tensors[f"{module}.a"][:, i], self.tensors[f"{module}.b"][:, i]
        c = int(self.cluster[i])
        sigma = self.tensors[f"{module}.sigma"][:, i]
        basis_in = self.tensors[f"{module}.basis_in"][:, c]
        a = basis_in * sigma[:, None, :] if self.method == "jd-diag" else basis_in @ sigma
        return a, self.tensors[f"{module}.basis_out"][:, c]

    def delta_weight(self, name: str, module: str, layer: int) -> np.ndarray:
        """The reconstructed ΔW [k, n] of one adapter, module and layer (scale included)."""
        a, b = self.factors(name, module)
        return a[layer] @ b[layer]

    def as_adapter(self, name: str) -> LoraAdapter:
        """Adapter `name` as an ordinary rank-r LoRA (scale 1): what the compressed serving path
        computes for it, usable by every backend (and by SVD collections' serving)."""
        config = LoraConfig(r=self.rank, lora_alpha=float(self.rank), target_modules=self.modules)
        modules = {}
        for module in self.modules:
            a, b = self.factors(name, module)
            modules[module] = ModuleLora(np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32),
                                         np.full(self.num_layers, self.rank, np.int32),
                                         np.ones(self.num_layers, np.float32))
        return LoraAdapter(name, config, modules)

    def serving_set(self) -> SharedBasisSet:
        """The shared bases and cores for the `compressed` LoRA backend (JD methods; an SVD
        collection has no shared basis: serve `as_adapter`s)."""
        if self.method not in JOINT:
            raise ValueError(f"a {self.method} collection has no shared bases; serve its adapters as ordinary ones")
        modules = {m: {part: self.tensors[f"{m}.{part}"] for part in ("basis_in", "basis_out", "sigma")}
                   for m in self.modules}
        return SharedBasisSet(tuple(self.names), self.cluster.astype(np.int32), modules)

    def parameter_count(self) -> int:
        """Numbers stored for the adapters' weights (all tensors)."""
        return int(sum(t.size for t in self.tensors.values()))


def source_parameter_count(sources: list[Source]) -> int:
    """Numbers in the source adapters' A and B (each layer at its own rank)."""
    total = 0
    for source in sources:
        for weights in source.adapter.modules.values():
            fan_in, fan_out = weights.a.shape[1], weights.b.shape[2]
            total += int(weights.rank.sum()) * (fan_in + fan_out)
    return total


def weights_sha256(adapter: LoraAdapter) -> str:
    """A content hash of an in-memory adapter's weights and scales."""
    digest = hashlib.sha256()
    for module in sorted(adapter.modules):
        weights = adapter.modules[module]
        for array in (weights.a, weights.b, weights.rank, weights.scale):
            digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def check_sources(sources: list[Source], base: LlamaConfig, base_model: str = "",
                  modules: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The target modules all `sources` share; AdapterError naming the first adapter whose base
    model (when both name one; `base_model` or else the first one named), target modules or shapes
    differ from the rest (or from `modules`)."""
    if not sources:
        raise AdapterError("no adapters to compress")
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise AdapterError(f"adapter names repeat: {sorted({n for n in names if names.count(n) > 1})}")
    shapes = projection_shapes(base)
    modules = tuple(sorted(sources[0].adapter.modules, key=PROJECTIONS.index)) if modules is None else modules
    base_model = base_model or next((s.base_model for s in sources if s.base_model), "")
    for source in sources:
        if base_model and source.base_model and source.base_model != base_model:
            raise AdapterError(f"adapter {source.name!r} was trained on base model {source.base_model!r}, "
                               f"not {base_model!r}")
        own = tuple(sorted(source.adapter.modules, key=PROJECTIONS.index))
        if own != modules:
            raise AdapterError(f"adapter {source.name!r} targets {list(own)}, the collection {list(modules)}: "
                               "compress adapters with the same target modules together")
        for module, weights in source.adapter.modules.items():
            want = (base.num_layers, *shapes[module])
            got = (weights.a.shape[0], weights.a.shape[1], weights.b.shape[2])
            if got != want or weights.b.shape[0] != base.num_layers:
                raise AdapterError(f"adapter {source.name!r}: {module} has (layers, in, out) {got}, the base model "
                                   f"{want}")
    return modules


def stack_factors(adapters: list[LoraAdapter], module: str, layer: int) -> tuple[jax.Array, jax.Array]:
    """(a [N, k, r0], b [N, r0, n]) of one layer and module, scale folded into b, ranks zero-padded
    to the largest (r0 >= 1)."""
    width = max(1, max(int(x.modules[module].rank[layer]) for x in adapters))
    a = np.zeros((len(adapters), adapters[0].modules[module].a.shape[1], width), np.float32)
    b = np.zeros((len(adapters), width, adapters[0].modules[module].b.shape[2]), np.float32)
    for i, adapter in enumerate(adapters):
        weights = adapter.modules[module]
        rank = int(weights.rank[layer])
        a[i, :, :rank] = weights.a[layer, :, :rank]
        b[i, :rank] = weights.b[layer, :rank] * weights.scale[layer]
    return jnp.asarray(a), jnp.asarray(b)


def cluster_adapters(stack, modules, num_layers: int, clusters: int, seed: int) -> np.ndarray:
    """k-means labels [N] over the sketches of all layers and modules (`jaxlora.compress.clusters`);
    stack(module, layer) -> (a [N, k, r], b [N, r, n]) as `stack_factors`."""
    if clusters == 1:
        return np.zeros(stack(modules[0], 0)[0].shape[0], np.int32)
    key = jax.random.key(seed)
    parts = []
    for layer in range(num_layers):
        for module in modules:
            key, sub = jax.random.split(key)
            parts.append(clustering.sketch(*stack(module, layer), sub))
    features = clustering.normalise_rows(np.concatenate(parts, axis=1))
    return clustering.kmeans(features, clusters, seed).astype(np.int32)


def compress_stacks(stack, modules, num_layers: int, method: str, rank: int, cluster: np.ndarray, iters: int = 30,
                    seed: int = 0, progress=None) -> tuple[dict, np.ndarray, np.ndarray]:
    """The compression loop over layers and modules, from stack(module, layer) -> (a [N, k, r],
    b [N, r, n]) (scales folded in; e.g. `stack_factors`, or arrays made on the device): (tensors
    {"<module>.<part>": [L, ...]}, squared errors [modules, L, N], squared norms [modules, L, N]).
    One layer and module is in memory at a time."""
    tensors, errors, norms = {}, None, None
    key = jax.random.key(seed)
    for layer in range(num_layers):
        for m, module in enumerate(modules):
            a, b = stack(module, layer)
            if errors is None:
                errors = np.zeros((len(modules), num_layers, a.shape[0]))
                norms = np.zeros_like(errors)
            key, sub = jax.random.split(key)
            parts, errors[m, layer] = _compress_layer(a, b, method, rank, cluster, sub, iters)
            norms[m, layer] = np.asarray(methods.products_norm_sq(a, b))
            for part, value in parts.items():
                tensors.setdefault(f"{module}.{part}", []).append(value)
        if progress is not None:
            progress(layer + 1, num_layers)
    return {name: np.stack(values) for name, values in tensors.items()}, errors, norms


def compress(sources: list[Source], base: LlamaConfig, method: str, rank: int, clusters: int = 1,
             base_model: str = "", iters: int = 30, seed: int = 0, progress=None) -> CompressedCollection:
    """Compresses `sources` (see the module doc); `progress(done, total)` is called per layer.
    AdapterError for mismatched adapters, ValueError for a bad method, rank or cluster count."""
    modules = check_sources(sources, base, base_model)
    shapes = {m: projection_shapes(base)[m] for m in modules}
    _check_options(method, rank, clusters, len(sources), shapes)
    adapters = [s.adapter for s in sources]
    stack = lambda module, layer: stack_factors(adapters, module, layer)
    cluster = cluster_adapters(stack, modules, base.num_layers, clusters, seed)
    tensors, errors, norms = compress_stacks(stack, modules, base.num_layers, method, rank, cluster, iters, seed,
                                             progress)
    base_model = base_model or next((s.base_model for s in sources if s.base_model), "")
    return CompressedCollection(method, rank, base_model, base.num_layers, shapes, [s.name for s in sources],
                                cluster, tensors, _relative_errors(errors, norms, modules, sources),
                                [_source_record(s) for s in sources])


def _check_options(method: str, rank: int, clusters: int, count: int, shapes: dict) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown compression method {method!r}; choose from {', '.join(METHODS)}")
    smallest = min(min(shape) for shape in shapes.values())
    if not 1 <= rank <= smallest:
        raise ValueError(f"rank must be in [1, {smallest}] (the smallest projection side), got {rank}")
    if not 1 <= clusters <= count:
        raise ValueError(f"clusters must be in [1, {count}] (the number of adapters), got {clusters}")
    if clusters > 1 and method not in JOINT:
        raise ValueError(f"clusters apply to the joint methods ({', '.join(JOINT)}); svd compresses each adapter alone")


def _compress_layer(a, b, method, rank, cluster, key, iters) -> tuple[dict, np.ndarray]:
    """({tensor part: array}, squared errors [N]) of one layer and module."""
    if method == "svd":
        result = methods.svd(a, b, rank)
        return {"a": np.asarray(result.a), "b": np.asarray(result.b)}, np.asarray(result.error)
    solve = methods.jd_full if method == "jd-full" else methods.jd_diag
    count = int(cluster.max()) + 1
    basis_in = np.zeros((count, a.shape[1], rank), np.float32)
    basis_out = np.zeros((count, rank, b.shape[2]), np.float32)
    sigma = np.zeros((a.shape[0], rank, rank) if method == "jd-full" else (a.shape[0], rank), np.float32)
    error = np.zeros(a.shape[0])
    for c in range(count):
        members = np.flatnonzero(cluster == c)
        padded = _padded(members)  # zero adapters change no Gram: one compile per size bucket
        a_c = jnp.where((padded >= 0)[:, None, None], a[np.maximum(padded, 0)], 0.0)
        b_c = jnp.where((padded >= 0)[:, None, None], b[np.maximum(padded, 0)], 0.0)
        result = solve(a_c, b_c, rank, jax.random.fold_in(key, c), iters)
        basis_in[c], basis_out[c] = np.asarray(result.basis_in), np.asarray(result.basis_out)
        count_c = len(members)
        sigma[members], error[members] = np.asarray(result.sigma)[:count_c], np.asarray(result.error)[:count_c]
    return {"basis_in": basis_in, "basis_out": basis_out, "sigma": sigma}, error


def _padded(members: np.ndarray) -> np.ndarray:
    """`members` padded with -1 (a zero adapter) to a power of two."""
    size = 1 << max(0, int(len(members) - 1).bit_length())
    return np.concatenate([members, np.full(size - len(members), -1)]).astype(np.int64)


def _relative_errors(errors, norms, modules, sources) -> dict:
    """{adapter: {module: sqrt(sum_l err / sum_l ||ΔW||^2)}} (0 where the module is all zero)."""
    err, norm = errors.sum(axis=1), norms.sum(axis=1)  # [modules, N]
    rel = np.sqrt(np.where(norm > 0, err / np.maximum(norm, 1e-30), 0.0))
    return {s.name: {m: float(rel[j, i]) for j, m in enumerate(modules)} for i, s in enumerate(sources)}


def _source_record(source: Source) -> dict:
    return {"name": source.name, "base_model": source.base_model,
            "sha256": source.sha256 or weights_sha256(source.adapter), "path": source.path}


def add(collection: CompressedCollection, sources: list[Source], base: LlamaConfig) -> CompressedCollection:
    """A new collection with `sources` added without touching the existing members: projected
    onto the bases of the cluster that captures most of each (JD), or truncated on their own (SVD).
    Their errors are in `errors` as for the others. AdapterError for mismatched adapters or a
    name already in the collection."""
    check_sources(sources, base, collection.base_model, collection.modules)
    taken = sorted(set(collection.names) & {s.name for s in sources})
    if taken:
        raise AdapterError(f"the collection already has adapters named {taken}")
    adapters = [s.adapter for s in sources]
    layers = range(collection.num_layers)
    stacks = {(l, m): stack_factors(adapters, m, l) for l in layers for m in collection.modules}
    cluster = _best_clusters(collection, stacks)
    tensors = dict(collection.tensors)
    errors = np.zeros((len(collection.modules), collection.num_layers, len(adapters)))
    norms = np.zeros_like(errors)
    for (layer, module), (a, b) in stacks.items():
        m = collection.modules.index(module)
        norms[m, layer] = np.asarray(methods.products_norm_sq(a, b))
        parts, errors[m, layer] = _project_layer(collection, module, layer, a, b, cluster)
        for part, value in parts.items():
            name = f"{module}.{part}"
            tensors[name] = _append_layer(tensors[name], collection.tensors[name], layer, value)
    return dataclasses.replace(
        collection, names=collection.names + [s.name for s in sources],
        cluster=np.concatenate([collection.cluster, cluster]).astype(np.int32), tensors=tensors,
        errors={**collection.errors, **_relative_errors(errors, norms, collection.modules, sources)},
        sources=collection.sources + [_source_record(s) for s in sources])


def _append_layer(current: np.ndarray, old: np.ndarray, layer: int, value: np.ndarray) -> np.ndarray:
    """The per-adapter tensor [L, N, ...] grown by the new adapters' rows of `layer` (allocated on
    the first layer seen)."""
    if current is old:
        current = np.concatenate([old, np.zeros((old.shape[0], value.shape[0], *old.shape[2:]), old.dtype)], axis=1)
    current[layer, old.shape[1]:] = value
    return current


def _best_clusters(collection, stacks) -> np.ndarray:
    """[N_new] cluster of each new adapter: the one whose bases capture most of its products."""
    count = len(next(iter(stacks.values()))[0])
    if collection.method == "svd":
        return np.zeros(count, np.int32)
    captured = np.zeros((collection.num_clusters, count))
    for (layer, module), (a, b) in stacks.items():
        for c in range(collection.num_clusters):
            basis_in = collection.tensors[f"{module}.basis_in"][layer, c]
            basis_out = collection.tensors[f"{module}.basis_out"][layer, c]
            _, error = _projector(collection.method)(a, b, basis_in, basis_out)
            captured[c] -= np.asarray(error)
    return np.argmax(captured, axis=0).astype(np.int32)


def _projector(method: str):
    return methods.project_full if method == "jd-full" else methods.project_diag


def _project_layer(collection, module, layer, a, b, cluster) -> tuple[dict, np.ndarray]:
    if collection.method == "svd":
        result = methods.svd(a, b, collection.rank)
        return {"a": np.asarray(result.a), "b": np.asarray(result.b)}, np.asarray(result.error)
    shape = (len(cluster), *collection.tensors[f"{module}.sigma"].shape[2:])
    sigma, error = np.zeros(shape, np.float32), np.zeros(len(cluster))
    for c in np.unique(cluster):
        members = np.flatnonzero(cluster == c)
        basis_in = collection.tensors[f"{module}.basis_in"][layer, c]
        basis_out = collection.tensors[f"{module}.basis_out"][layer, c]
        s, e = _projector(collection.method)(a[members], b[members], basis_in, basis_out)
        sigma[members], error[members] = np.asarray(s), np.asarray(e)
    return {"sigma": sigma}, error


def recompress(collection: CompressedCollection, sources: list[Source], new: list[Source], base: LlamaConfig,
               iters: int = 30, seed: int = 0) -> CompressedCollection:
    """The collection compressed again from scratch with `new` adapters added: `sources` are its
    members' original adapters, in its order (AdapterError if a name or hash differs)."""
    taken = sorted(set(collection.names) & {s.name for s in new})
    if taken:
        raise AdapterError(f"the collection already has adapters named {taken}")
    if [s.name for s in sources] != collection.names:
        raise AdapterError(f"recompression needs the collection's source adapters in order: {collection.names}")
    for source, record in zip(sources, collection.sources):
        digest = source.sha256 or weights_sha256(source.adapter)
        if record["sha256"] and digest != record["sha256"]:
            raise AdapterError(f"adapter {source.name!r} has changed since it was compressed (sha256 differs)")
    return compress(sources + new, base, collection.method, collection.rank, collection.num_clusters,
                    collection.base_model, iters, seed)
