"""The compression methods on one layer's stack of products, against dense numpy references."""

import jax
import numpy as np
import pytest

from jaxlora.compress import methods

K, N_OUT = 37, 29  # odd sizes


def random_stack(count: int, rank: int, seed: int):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(count, K, rank)).astype(np.float32)
    b = rng.normal(size=(count, rank, N_OUT)).astype(np.float32)
    return a, b


def dense(a, b) -> np.ndarray:
    return np.einsum("nkr,nrm->nkm", np.asarray(a, np.float64), np.asarray(b, np.float64))


def merged_error(products: np.ndarray, rank: int) -> float:
    """Remark 1's bound: every adapter replaced by the rank-r SVD of the mean product."""
    left, s, right = np.linalg.svd(products.mean(axis=0))
    merged = (left[:, :rank] * s[:rank]) @ right[:rank]
    return float(np.sum((products - merged) ** 2))


def test_svd_is_exact_at_full_rank_and_eckart_young_below():
    a, b = random_stack(5, 4, seed=1)
    products = dense(a, b)
    full = methods.svd(a, b, rank=6)  # >= every adapter's rank (zero-padded)
    assert np.linalg.norm(dense(full.a, full.b) - products) <= 1e-5 * np.linalg.norm(products)
    assert float(full.error.max()) <= 1e-6 * np.sum(products**2)
    low = methods.svd(a, b, rank=2)
    singular = np.linalg.svd(products, compute_uv=False)
    np.testing.assert_allclose(low.error, np.sum(singular[:, 2:] ** 2, axis=1), rtol=1e-4)
    np.testing.assert_allclose(np.sum((dense(low.a, low.b) - products) ** 2, axis=(1, 2)), low.error, rtol=1e-4)


def test_jd_full_is_exact_in_a_shared_subspace():
    rng = np.random.default_rng(2)
    shared = 5
    p, q = rng.normal(size=(K, shared)), rng.normal(size=(shared, N_OUT))
    a = np.stack([p @ rng.normal(size=(shared, 3)) for _ in range(9)]).astype(np.float32)
    b = np.stack([rng.normal(size=(3, shared)) @ q for _ in range(9)]).astype(np.float32)
    result = methods.jd_full(a, b, shared, jax.random.key(0))
    products = dense(a, b)
    rebuilt = np.einsum("kr,nrs,sm->nkm", result.basis_in, result.sigma, result.basis_out)
    assert np.linalg.norm(rebuilt - products) <= 1e-5 * np.linalg.norm(products)
    np.testing.assert_allclose(result.basis_in.T @ result.basis_in, np.eye(shared), atol=1e-5)
    np.testing.assert_allclose(result.basis_out @ result.basis_out.T, np.eye(shared), atol=1e-5)


@pytest.mark.parametrize("seed,rank", [(3, 3), (4, 7)])
def test_jd_full_beats_merging_and_jd_diag_never_beats_jd_full(seed, rank):
    a, b = random_stack(8, 4, seed)
    products = dense(a, b)
    full = methods.jd_full(a, b, rank, jax.random.key(seed))
    diag = methods.jd_diag(a, b, rank, jax.random.key(seed))
    full_rebuilt = np.einsum("kr,nrs,sm->nkm", full.basis_in, full.sigma, full.basis_out)
    diag_rebuilt = np.einsum("kr,nr,rm->nkm", diag.basis_in, diag.sigma, diag.basis_out)
    full_err = np.sum((full_rebuilt - products) ** 2, axis=(1, 2))
    diag_err = np.sum((diag_rebuilt - products) ** 2, axis=(1, 2))
    total = np.sum(products**2)
    # the reported errors are the dense ones
    np.testing.assert_allclose(full.error, full_err, rtol=1e-3, atol=1e-5 * total)
    np.testing.assert_allclose(diag.error, diag_err, rtol=1e-3, atol=1e-5 * total)
    assert full_err.sum() <= merged_error(products, rank) * (1 + 1e-5)  # Remark 1
    assert diag_err.sum() >= full_err.sum() * (1 - 1e-5)  # a diagonal core is a constrained full one
    assert full_err.sum() < total  # it captures something


def test_projection_onto_bases_reports_the_dense_error():
    a, b = random_stack(6, 4, seed=5)
    result = methods.jd_full(a[:4], b[:4], 6, jax.random.key(1))
    sigma, error = methods.project_full(a[4:], b[4:], result.basis_in, result.basis_out)
    rebuilt = np.einsum("kr,nrs,sm->nkm", result.basis_in, sigma, result.basis_out)
    np.testing.assert_allclose(error, np.sum((rebuilt - dense(a[4:], b[4:])) ** 2, axis=(1, 2)), rtol=1e-3)
    diag = methods.jd_diag(a[:4], b[:4], 6, jax.random.key(1))
    s, error = methods.project_diag(a[4:], b[4:], diag.basis_in, diag.basis_out)
    rebuilt = np.einsum("kr,nr,rm->nkm", diag.basis_in, s, diag.basis_out)
    np.testing.assert_allclose(error, np.sum((rebuilt - dense(a[4:], b[4:])) ** 2, axis=(1, 2)), rtol=1e-3)
