"""Grouping adapters before joint compression (Compress-then-Serve clusters large collections and
gives each cluster its own bases): k-means over the adapters' subspaces, one assignment per adapter
over all its layers and modules.

What a cluster shares is a pair of bases, so adapters belong together when their products span
the same column and row spaces, whatever their cores: the feature of a product ΔW_i is its two
energy-weighted subspaces, the Grams ΔW_i ΔW_i^T and ΔW_i^T ΔW_i (adapters with similar vec(ΔW_i),
the paper's criterion, have similar Grams too). The Grams are never formed: each is sketched as
G^T Gram G (s x s, Gaussian G shared by all adapters) from the factors, and only the off-diagonal
entries are kept (the diagonal carries a bias tr(Gram_i) tr(Gram_j) / s; the rest has
E<sketch_i, sketch_j> proportional to <Gram_i, Gram_j>). Each (layer, module) is normalised so that
each counts equally, and the concatenation again. k-means is a small Lloyd's algorithm with
k-means++ seeding and a few restarts (a dozen lines: scikit-learn is not a dependency).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.compress.factored import mm

SKETCH_SIZE = 24


def sketch(a: jax.Array, b: jax.Array, key: jax.Array, size: int = SKETCH_SIZE) -> np.ndarray:
    """[N, size*(size-1)] features of the products a_i @ b_i (a [N, k, r], b [N, r, n]): the
    off-diagonal sketches of the input-side and output-side Grams, each half unit-norm (zero for
    zero products)."""
    key_in, key_out = jax.random.split(key)
    g_in = jax.random.normal(key_in, (a.shape[1], size)) / np.sqrt(size)
    g_out = jax.random.normal(key_out, (b.shape[2], size)) / np.sqrt(size)
    left = mm(mm(g_in.T, a), b)  # [N, s, n]: G_in^T ΔW_i
    right = mm(a, mm(b, g_out))  # [N, k, s]: ΔW_i G_out
    upper = np.triu_indices(size, 1)
    halves = []
    for factor in (left, jnp.swapaxes(right, 1, 2)):
        gram = mm(factor, jnp.swapaxes(factor, 1, 2))[:, upper[0], upper[1]]
        norms = jnp.linalg.norm(gram, axis=1, keepdims=True)
        halves.append(jnp.where(norms > 0, gram / jnp.maximum(norms, 1e-30), 0.0))
    return np.asarray(jnp.concatenate(halves, axis=1))


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
