"""The compression methods of Compress-then-Serve (papers/compress-then-serve.zh.txt §3) for one
layer of one projection: n adapters' products ΔW_i = a_i @ b_i (a [N, k, r0], b [N, r0, n]; the
adapter's scale folded into b), in the kernels' layout (y = x @ ΔW).

- `svd`: each product truncated to rank r on its own (Eckart-Young): a_i' [k, r], b_i' [r, n].
- `jd_full`: ΔW_i ~ P Σ_i Q with P [k, r] and Q^T [n, r] orthonormal and shared, Σ_i [r, r]
  (the paper's U Σ_i V with P = V^T, Q = U^T). Alternating maximisation of sum_i ||P^T ΔW_i Q^T||^2
  (Σ_i = P^T ΔW_i Q^T is optimal for fixed bases; the paper's Appendix B alternates the same
  block updates), each basis update a Rayleigh-Ritz step on [P, G P], so the captured energy
  never decreases. Initialised from whichever captures more of two starts: the SVD of the stacked
  products (top subspaces of sum ΔW_i ΔW_i^T and sum ΔW_i^T ΔW_i) and the SVD of their mean;
  the latter makes the result never worse than merging (the paper's Remark 1).
- `jd_diag`: ΔW_i ~ P diag(s_i) Q with P, Q free: alternating least squares over P, Q and the
  s_i (each block update is an exact least-squares solve, so the error never increases),
  initialised from the JD-Full solution's bases and diagonals.

Errors are squared Frobenius norms ||ΔW_i - approx_i||^2 per adapter, computed from the factors.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxlora.compress.factored import (mean_product, mm, product_svd, products_norm_sq, rayleigh_ritz,
                                       stacked_gram_in, stacked_gram_out, top_subspace)

_HIGHEST = jax.lax.Precision.HIGHEST


class SvdResult(NamedTuple):
    """Each adapter at rank r: a [N, k, r], b [N, r, n]; error [N] squared Frobenius."""

    a: jax.Array
    b: jax.Array
    error: jax.Array


class JointResult(NamedTuple):
    """Shared bases and per-adapter cores: basis_in [k, r] (P), basis_out [r, n] (Q), sigma
    [N, r, r] (JD-Full) or [N, r] (JD-Diag: the diagonals); error [N] squared Frobenius."""

    basis_in: jax.Array
    basis_out: jax.Array
    sigma: jax.Array
    error: jax.Array


@functools.partial(jax.jit, static_argnames="rank")
def svd(a: jax.Array, b: jax.Array, rank: int) -> SvdResult:
    """Each adapter truncated to `rank` (zero-padded when its own rank is smaller)."""

    def one(a_i, b_i):
        left, s, right = product_svd(a_i, b_i)
        keep = min(rank, s.shape[0])
        pad = rank - keep
        new_a = jnp.pad(left[:, :keep] * s[:keep], ((0, 0), (0, pad)))
        return new_a, jnp.pad(right[:keep], ((0, pad), (0, 0))), jnp.sum(s[keep:] ** 2)

    new_a, new_b, error = jax.vmap(one)(a, b)
    return SvdResult(new_a, new_b, error)


def full_cores(a: jax.Array, b: jax.Array, basis_in: jax.Array, basis_out: jax.Array) -> jax.Array:
    """Σ_i = P^T a_i b_i Q^T [N, r, r]: the best full cores for fixed orthonormal bases."""
    return mm(mm(basis_in.T, a), mm(b, basis_out.T))


def _captured(a, b, basis_in, basis_out) -> jax.Array:
    return jnp.sum(full_cores(a, b, basis_in, basis_out) ** 2)


def _start_bases(a, b, rank, key):
    """(P, Q) of the better start: the stacked products' SVD, or their mean's."""
    k, n = a.shape[1], b.shape[2]
    keys = jax.random.split(key, 4)
    stacked = (top_subspace(stacked_gram_in(a, b), k, rank, keys[0]),
               top_subspace(stacked_gram_out(a, b), n, rank, keys[1]).T)
    mean_a, mean_b = mean_product(a, b)
    merged = (top_subspace(stacked_gram_in(mean_a, mean_b), k, rank, keys[2], iters=10),
              top_subspace(stacked_gram_out(mean_a, mean_b), n, rank, keys[3], iters=10).T)
    better = _captured(a, b, *stacked) >= _captured(a, b, *merged)
    return jax.tree.map(lambda s, m: jnp.where(better, s, m), stacked, merged)


@functools.partial(jax.jit, static_argnames=("rank", "iters"))
def jd_full(a: jax.Array, b: jax.Array, rank: int, key: jax.Array, iters: int = 30) -> JointResult:
    """JD-Full at shared rank `rank` (see the module doc)."""
    basis_in, basis_out = _start_bases(a, b, rank, key)

    def step(_, bases):
        basis_in, basis_out = bases
        proj_b = mm(b, basis_out.T)  # [N, r0, rank]: the products already mapped through Q^T
        basis_in = rayleigh_ritz(stacked_gram_in(a, proj_b), basis_in, rank)
        proj_a = mm(basis_in.T, a)  # [N, rank, r0]
        basis_out = rayleigh_ritz(stacked_gram_out(proj_a, b), basis_out.T, rank).T
        return basis_in, basis_out

    basis_in, basis_out = jax.lax.fori_loop(0, iters, step, (basis_in, basis_out))
    sigma = full_cores(a, b, basis_in, basis_out)
    error = jnp.maximum(products_norm_sq(a, b) - jnp.sum(sigma**2, axis=(1, 2)), 0.0)
    return JointResult(basis_in, basis_out, sigma, error)


def _diag_terms(a, b, basis_in, basis_out):
    """(H [r, r] = (P^T P) * (Q Q^T), rhs [N, r] = diag(P^T ΔW_i Q^T)): the normal equations of the
    diagonals for fixed bases."""
    gram = mm(basis_in.T, basis_in) * mm(basis_out, basis_out.T)
    rhs = jnp.einsum("nrs,nsr->nr", mm(basis_in.T, a), mm(b, basis_out.T), precision=_HIGHEST)
    return gram, rhs


def _solve(gram: jax.Array, rhs: jax.Array) -> jax.Array:
    """rhs @ gram^-1 for a symmetric PSD gram [r, r] (a relative ridge keeps it invertible)."""
    ridge = 1e-9 * jnp.trace(gram) / gram.shape[0] + 1e-30
    return jnp.linalg.solve(gram + ridge * jnp.eye(gram.shape[0]), rhs.T).T


def _diag_step(a, b, params):
    """One round of exact least-squares updates: P, then Q, then the diagonals s [N, r]."""
    basis_in, basis_out, s = params
    weights = mm(s.T, s)  # sum_i s_i s_i^T
    rhs_in = jnp.einsum("nkr,nr->kr", mm(a, mm(b, basis_out.T)), s, precision=_HIGHEST)
    basis_in = _solve(mm(basis_out, basis_out.T) * weights, rhs_in)
    rhs_out = jnp.einsum("nrm,nr->rm", mm(mm(basis_in.T, a), b), s, precision=_HIGHEST)
    basis_out = _solve(mm(basis_in.T, basis_in) * weights, rhs_out.T).T
    norms_in = jnp.linalg.norm(basis_in, axis=0) + 1e-30
    norms_out = jnp.linalg.norm(basis_out, axis=1) + 1e-30
    basis_in, basis_out = basis_in / norms_in, basis_out / norms_out[:, None]
    gram, rhs = _diag_terms(a, b, basis_in, basis_out)
    return basis_in, basis_out, _solve(gram, rhs)


def jd_diag(a: jax.Array, b: jax.Array, rank: int, key: jax.Array, iters: int = 30) -> JointResult:
    """JD-Diag at shared rank `rank` (see the module doc)."""
    start = jd_full(a, b, rank, key, iters)  # compiled once per shape, shared with JD-Full
    return _refine_diag(a, b, start.basis_in, start.basis_out, jnp.diagonal(start.sigma, axis1=1, axis2=2), iters)


@functools.partial(jax.jit, static_argnames="iters")
def _refine_diag(a, b, basis_in, basis_out, s, iters: int) -> JointResult:
    """`iters` rounds of `_diag_step` from (P, Q, s) and the final errors."""
    params = (basis_in, basis_out, s)
    basis_in, basis_out, s = jax.lax.fori_loop(0, iters, lambda _, p: _diag_step(a, b, p), params)
    gram, rhs = _diag_terms(a, b, basis_in, basis_out)
    error = products_norm_sq(a, b) - 2 * jnp.sum(s * rhs, axis=1) + jnp.einsum("nr,rs,ns->n", s, gram, s)
    return JointResult(basis_in, basis_out, s, jnp.maximum(error, 0.0))


def project_full(a, b, basis_in, basis_out) -> tuple[jax.Array, jax.Array]:
    """New adapters onto fixed JD-Full bases: (Σ [N, r, r], error [N])."""
    sigma = full_cores(a, b, basis_in, basis_out)
    return sigma, jnp.maximum(products_norm_sq(a, b) - jnp.sum(sigma**2, axis=(1, 2)), 0.0)


def project_diag(a, b, basis_in, basis_out) -> tuple[jax.Array, jax.Array]:
    """New adapters onto fixed JD-Diag bases: (s [N, r] by least squares, error [N])."""
    gram, rhs = _diag_terms(a, b, basis_in, basis_out)
    s = _solve(gram, rhs)
    error = products_norm_sq(a, b) - 2 * jnp.sum(s * rhs, axis=1) + jnp.einsum("nr,rs,ns->n", s, gram, s)
    return s, jnp.maximum(error, 0.0)
