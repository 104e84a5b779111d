"""Linear algebra on LoRA products kept in factored form: ΔW_i = a_i @ b_i with a_i [k, r_i] and
b_i [r_i, n], for a stack of n adapters (a [N, k, r], b [N, r, n]; zero-padded ranks are exact).

Nothing here forms a k x n product for every adapter: Gram operators are applied to a few vectors
at a time (sum_i a_i (b_i (b_i^T x)) ...), and subspaces are found by randomised subspace
iteration with a Rayleigh-Ritz step (Halko, Martinsson, Tropp 2011), which is monotone: a
refined subspace never captures less of the operator than the one it started from."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def mm(x: jax.Array, y: jax.Array) -> jax.Array:
    """x @ y at full float32 precision (compression is offline: accuracy over speed)."""
    return jnp.matmul(x, y, precision=_HIGHEST)


def products_norm_sq(a: jax.Array, b: jax.Array) -> jax.Array:
    """||a_i @ b_i||_F^2 of each adapter from its factors: a [N, k, r], b [N, r, n] -> [N]."""
    a_gram = jnp.einsum("nkr,nks->nrs", a, a, precision=_HIGHEST)
    b_gram = jnp.einsum("nrm,nsm->nrs", b, b, precision=_HIGHEST)
    return jnp.sum(a_gram * b_gram, axis=(1, 2))


def product_svd(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Exact thin SVD of one product a @ b (a [k, r], b [r, n]) through QR of both factors:
    (left [k, r], singular values [r] descending, right [r, n]) with a @ b = left * s @ right."""
    q_a, r_a = jnp.linalg.qr(a)
    q_b, r_b = jnp.linalg.qr(b.T)
    left, s, right = jnp.linalg.svd(mm(r_a, r_b.T), full_matrices=False)
    return mm(q_a, left), s, mm(right, q_b.T)


def rayleigh_ritz(apply_gram: Callable, basis: jax.Array, width: int) -> jax.Array:
    """The best `width`-dim subspace of span([basis, G basis]) for the PSD operator G (`apply_gram`:
    [d, m] -> [d, m]): orthonormal [d, width], columns by decreasing Ritz value. It contains what
    `basis` captures, so tr(U^T G U) never decreases."""
    candidates, _ = jnp.linalg.qr(jnp.concatenate([basis, apply_gram(basis)], axis=1))
    projected = mm(candidates.T, apply_gram(candidates))
    _, vectors = jnp.linalg.eigh((projected + projected.T) / 2)
    return mm(candidates, vectors[:, ::-1][:, :width])


def top_subspace(apply_gram: Callable, dim: int, rank: int, key: jax.Array, iters: int = 6,
                 oversample: int = 8) -> jax.Array:
    """Orthonormal [dim, rank] spanning (approximately, exactly when G has rank <= rank) the top
    eigenvectors of the PSD operator G: randomised subspace iteration with oversampling, each
    step a Rayleigh-Ritz refinement."""
    width = min(dim, rank + oversample)
    basis, _ = jnp.linalg.qr(jax.random.normal(key, (dim, width), jnp.float32))
    basis = jax.lax.fori_loop(0, iters, lambda _, basis: rayleigh_ritz(apply_gram, basis, width), basis)
    return basis[:, :rank]


def stacked_gram_in(a: jax.Array, b: jax.Array) -> Callable:
    """x [k, m] -> sum_i ΔW_i ΔW_i^T x (the input-side Gram of the horizontally stacked products)."""
    return lambda x: jnp.einsum("nkr,nrm->km", a, mm(b, mm(jnp.swapaxes(b, 1, 2), mm(jnp.swapaxes(a, 1, 2), x))),
                                precision=_HIGHEST)


def stacked_gram_out(a: jax.Array, b: jax.Array) -> Callable:
    """y [n, m] -> sum_i ΔW_i^T ΔW_i y (the output-side Gram of the vertically stacked products)."""
    return stacked_gram_in(jnp.swapaxes(b, 1, 2), jnp.swapaxes(a, 1, 2))


def mean_product(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Factors of the mean product (1/N) sum_i a_i b_i as one adapter of rank N*r:
    (a [1, k, N*r], b [1, N*r, n])."""
    count, k, r = a.shape
    a_cat = jnp.swapaxes(a, 0, 1).reshape(1, k, count * r)
    return a_cat / count, b.reshape(1, count * r, b.shape[-1])
