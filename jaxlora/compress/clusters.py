"""Grouping adapters before joint compression (Compress-then-Serve clusters large collections and
gives each cluster its own bases): k-means on the normalised products vec(ΔW_i), one assignment
per adapter over all its layers and modules.

The products are never formed: each (layer, module) contributes a Gaussian sketch
G_in^T ΔW_i G_out (s x s, E||sketch||^2 = ||ΔW_i||^2, so inner products of the normalised
products are kept up to Johnson-Lindenstrauss error), normalised per (layer, module) so that each
counts equally, and the concatenation is normalised again. k-means is a small Lloyd's algorithm
with k-means++ seeding and a few restarts (a dozen lines: scikit-learn is not a dependency)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.compress.factored import mm

SKETCH_SIZE = 16


def sketch(a: jax.Array, b: jax.Array, key: jax.Array, size: int = SKETCH_SIZE) -> np.ndarray:
    """[N, size*size] unit-norm sketches of the products a_i @ b_i (a [N, k, r], b [N, r, n]);
    zero rows for zero products."""
    key_in, key_out = jax.random.split(key)
    g_in = jax.random.normal(key_in, (a.shape[1], size)) / np.sqrt(size)
    g_out = jax.random.normal(key_out, (b.shape[2], size)) / np.sqrt(size)
    sketches = mm(mm(g_in.T, a), mm(b, g_out)).reshape(a.shape[0], -1)
    norms = jnp.linalg.norm(sketches, axis=1, keepdims=True)
    return np.asarray(jnp.where(norms > 0, sketches / jnp.maximum(norms, 1e-30), 0.0))


def normalise_rows(features: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(features, axis=1, keepdims=True)
    return np.where(norms > 0, features / np.maximum(norms, 1e-30), 0.0)


def kmeans(features: np.ndarray, k: int, seed: int = 0, restarts: int = 4, iters: int = 100) -> np.ndarray:
    """Cluster labels [N] (0..k-1, every cluster non-empty) of the rows of `features` [N, F]:
    the best of `restarts` k-means++ seeded Lloyd runs by inertia."""
    count = features.shape[0]
    if not 1 <= k <= count:
        raise ValueError(f"clusters must be in [1, {count}] (the number of adapters), got {k}")
    rng = np.random.default_rng(seed)
    best, best_inertia = None, np.inf
    for _ in range(restarts):
        labels, inertia = _lloyd(features, _kmeans_pp(features, k, rng), iters)
        if inertia < best_inertia:
            best, best_inertia = labels, inertia
    return best


def _kmeans_pp(features: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    centres = [features[rng.integers(len(features))]]
    for _ in range(1, k):
        dist = np.min([np.sum((features - c) ** 2, axis=1) for c in centres], axis=0)
        total = dist.sum()
        pick = rng.choice(len(features), p=dist / total) if total > 0 else rng.integers(len(features))
        centres.append(features[pick])
    return np.stack(centres)


def _lloyd(features: np.ndarray, centres: np.ndarray, iters: int) -> tuple[np.ndarray, float]:
    """(labels, inertia) after Lloyd iterations; an emptied cluster takes the farthest point."""
    labels = None
    for _ in range(iters):
        dist = np.sum((features[:, None] - centres[None]) ** 2, axis=2)
        new = np.argmin(dist, axis=1)
        for c in range(len(centres)):
            if not np.any(new == c):
                far = int(np.argmax(dist[np.arange(len(new)), new]))
                new[far] = c
        if labels is not None and np.array_equal(new, labels):
            break
        labels = new
        centres = np.stack([features[labels == c].mean(axis=0) for c in range(len(centres))])
    inertia = float(np.sum((features - centres[labels]) ** 2))
    return labels, inertia
