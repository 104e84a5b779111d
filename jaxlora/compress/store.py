"""The compressed-collection format on disk: a directory with `manifest.json` (method, rank,
clusters, base model, shapes, the adapters in order with their cluster, their source's hash and
path, and each adapter's relative reconstruction error per module) and `tensors.safetensors`
(the tensors of `jaxlora.compress.collection`, float32, plus `cluster` [N] int32)."""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxlora.compress.collection import METHODS, CompressedCollection
from jaxlora.jsonfile import read_json_file

MANIFEST = "manifest.json"
TENSORS = "tensors.safetensors"
FORMAT = "jaxlora-compressed-lora/1"


class CollectionError(ValueError):
    """A compressed collection that cannot be read; the message names the file and the problem."""


def save(collection: CompressedCollection, path: str) -> None:
    """Writes `collection` into directory `path` (created if needed; its two files replaced)."""
    os.makedirs(path, exist_ok=True)
    tensors = {name: np.ascontiguousarray(value, np.float32) for name, value in collection.tensors.items()}
    tensors["cluster"] = np.asarray(collection.cluster, np.int32)
    save_file(tensors, os.path.join(path, TENSORS), metadata={"format": FORMAT})
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest(collection), f, indent=1)


def manifest(collection: CompressedCollection) -> dict:
    """The JSON manifest of `collection` (what `save` writes and `jaxlora-compress info` prints)."""
    adapters = [{**source, "cluster": int(c), "errors": collection.errors[source["name"]]}
                for source, c in zip(collection.sources, collection.cluster)]
    return {"format": FORMAT, "method": collection.method, "rank": collection.rank,
            "clusters": collection.num_clusters, "base_model": collection.base_model,
            "num_layers": collection.num_layers,
            "modules": {m: list(collection.shapes[m]) for m in collection.modules},
            "parameters": collection.parameter_count(), "adapters": adapters}


def load(path: str) -> CompressedCollection:
    """Reads a collection written by `save`; CollectionError naming the problem otherwise."""
    info = _read_manifest(path)
    tensors = _read_tensors(os.path.join(path, TENSORS))
    try:
        cluster = tensors.pop("cluster").astype(np.int32)
        adapters = info["adapters"]
        collection = CompressedCollection(
            method=info["method"], rank=int(info["rank"]), base_model=info["base_model"],
            num_layers=int(info["num_layers"]), shapes={m: tuple(s) for m, s in info["modules"].items()},
            names=[a["name"] for a in adapters], cluster=cluster, tensors=tensors,
            errors={a["name"]: a["errors"] for a in adapters},
            sources=[{k: a[k] for k in ("name", "base_model", "sha256", "path")} for a in adapters])
    except (KeyError, TypeError, ValueError) as err:
        raise CollectionError(f"{path}: malformed compressed collection: {err!r}") from err
    _check_consistent(collection, path)
    return collection


def _read_manifest(path: str) -> dict:
    file = os.path.join(path, MANIFEST)
    info = read_json_file(file, CollectionError, f"is {path} a compressed collection from jaxlora-compress?")
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CollectionError(f"{file}: not a {FORMAT} manifest")
    if info.get("method") not in METHODS:
        raise CollectionError(f"{file}: unknown method {info.get('method')!r}")
    return info


def _read_tensors(file: str) -> dict[str, np.ndarray]:
    if not os.path.exists(file):
        raise CollectionError(f"{file}: not found")
    try:
        with safe_open(file, framework="numpy") as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception as err:
        raise CollectionError(f"{file}: cannot read safetensors (truncated or corrupt?): {err}") from err


def _check_consistent(collection: CompressedCollection, path: str) -> None:
    """CollectionError unless every module's tensors have the shapes the manifest implies."""
    count, layers, rank = len(collection.names), collection.num_layers, collection.rank
    clusters = collection.num_clusters
    if collection.cluster.shape != (count,) or (count and collection.cluster.min() < 0):
        raise CollectionError(f"{path}: cluster labels do not match the {count} adapters")
    for module in collection.modules:
        k, n = collection.shapes[module]
        if collection.method == "svd":
            want = {"a": (layers, count, k, rank), "b": (layers, count, rank, n)}
        else:
            core = (rank, rank) if collection.method == "jd-full" else (rank,)
            want = {"basis_in": (layers, clusters, k, rank), "basis_out": (layers, clusters, rank, n),
                    "sigma": (layers, count, *core)}
        for part, shape in want.items():
            got = collection.tensors.get(f"{module}.{part}")
            if got is None or got.shape != shape:
                raise CollectionError(f"{path}: tensor {module}.{part} has shape "
                                      f"{None if got is None else got.shape}, the manifest implies {shape}")
            if not np.isfinite(got).all():
                raise CollectionError(f"{path}: tensor {module}.{part} holds NaN or Inf")
