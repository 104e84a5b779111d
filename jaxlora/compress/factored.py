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


def orthonormalize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(q [d, m] with orthonormal or zero columns, r = q^T x [m, m]; x = q @ r up to the
    directions dropped), for x [d, m]: the eigendecomposition of x^T x (directions below 1e-3 of
    the largest singular value, where float32 rounding of the Gram dominates, become zero
    columns), then two Newton-Schulz steps q <- q (3 I - q^T q) / 2 that restore the
    orthogonality the Gram's squared condition number costs. XLA's QR on a CPU is two orders of
    magnitude slower than this for the tall, thin matrices here, and its eigh slows down on the
    clustered spectrum of a second Gram pass."""
    gram = mm(x.T, x)
    values, vectors = jnp.linalg.eigh((gram + gram.T) / 2)
    keep = values > 1e-6 * jnp.maximum(values[-1], 1e-30)  # below: float32 rounding of the Gram
    q = jnp.where(keep, mm(x, vectors) / jnp.sqrt(jnp.where(keep, values, 1.0)), 0.0)
    eye = jnp.eye(q.shape[1], dtype=q.dtype)
    for _ in range(2):
        q = mm(q, 1.5 * eye - 0.5 * mm(q.T, q))
    return q, mm(q.T, x)


def product_svd(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Exact thin SVD of one product a @ b (a [k, r], b [r, n]) from orthonormal bases of both
    factors: (left [k, r], singular values [r] descending, right [r, n]) with a @ b = left * s @ right."""
    q_a, r_a = orthonormalize(a)
    q_b, r_b = orthonormalize(b.T)
    left, s, right = jnp.linalg.svd(mm(r_a, r_b.T), full_matrices=False)
    return mm(q_a, left), s, mm(right, q_b.T)


def rayleigh_ritz(apply_gram: Callable, basis: jax.Array, width: int) -> jax.Array:
    """The best `width`-dim subspace of span([basis, G basis]) for the PSD operator G (`apply_gram`:
    [d, m] -> [d, m]): [d, width] with orthonormal (or, past G's rank, zero) columns by decreasing
    Ritz value. It contains what `basis` captures, so tr(U^T G U) never decreases."""
    applied = apply_gram(basis)
    applied = applied / jnp.maximum(jnp.linalg.norm(applied, axis=0), 1e-30)  # the scale of `basis`: none dropped
    candidates, _ = orthonormalize(jnp.concatenate([basis, applied], axis=1))
    projected = mm(candidates.T, apply_gram(candidates))
    _, vectors = jnp.linalg.eigh((projected + projected.T) / 2)
    return mm(candidates, vectors[:, ::-1][:, :width])


def top_subspace(apply_gram: Callable, dim: int, rank: int, key: jax.Array, iters: int = 6,
                 oversample: int = 8) -> jax.Array:
    """Orthonormal [dim, rank] spanning (approximately, exactly when G has rank <= rank) the top
    eigenvectors of the PSD operator G: randomised subspace iteration with oversampling, each
    step a Rayleigh-Ritz refinement."""
    width = min(dim, rank + oversample)
    basis, _ = orthonormalize(jax.random.normal(key, (dim, width), jnp.float32))
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
