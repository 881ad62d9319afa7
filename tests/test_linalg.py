"""robust_cholesky: escalating jitter, clear errors."""
import pytest
import torch

from milgp.linalg import CholeskyError, cholesky_inverse_from_precision, robust_cholesky


def test_positive_definite_matrix_is_factorised_without_jitter():
    """A well-conditioned SPD matrix must be factorised exactly (L Lᵀ = A)."""
    g = torch.Generator().manual_seed(0)
    R = torch.randn(5, 5, generator=g, dtype=torch.float64)
    A = R @ R.mT + torch.eye(5, dtype=torch.float64)
    L = robust_cholesky(A)
    torch.testing.assert_close(L @ L.mT, A)


def test_singular_psd_matrix_gets_escalated_jitter():
    """A rank-deficient PSD matrix must succeed after escalating jitter (small perturbation)."""
    v = torch.ones(4, 1, dtype=torch.float64)
    A = v @ v.mT
    L = robust_cholesky(A, what="K_zz")
    assert torch.isfinite(L).all()
    assert (L @ L.mT - A).abs().max() < 1e-3


def test_indefinite_matrix_raises_named_error():
    """A clearly indefinite matrix cannot be fixed by jitter: CholeskyError names the matrix."""
    A = -torch.eye(3, dtype=torch.float64)
    with pytest.raises(CholeskyError, match="K_zz .*not positive definite"):
        robust_cholesky(A, what="K_zz")


def test_nan_matrix_raises_named_error():
    """NaN entries must be reported as such, not as a matrix that jitter cannot make positive definite."""
    A = torch.eye(3, dtype=torch.float64)
    A[0, 1] = float("nan")
    with pytest.raises(CholeskyError, match="kernel .*NaN"):
        robust_cholesky(A, what="kernel")


def test_cholesky_inverse_from_precision():
    """S = P⁻¹ (symmetric) and L_P the Cholesky factor of P."""
    g = torch.Generator().manual_seed(1)
    R = torch.randn(4, 4, generator=g, dtype=torch.float64)
    P = R @ R.mT + 0.5 * torch.eye(4, dtype=torch.float64)
    S, L_P = cholesky_inverse_from_precision(P)
    torch.testing.assert_close(S @ P, torch.eye(4, dtype=torch.float64))
    torch.testing.assert_close(S, S.mT)
    torch.testing.assert_close(L_P @ L_P.mT, P)
