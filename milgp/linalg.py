"""Numerically careful linear algebra shared by the GP heads."""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["CholeskyError", "robust_cholesky", "cholesky_inverse_from_precision"]


class CholeskyError(RuntimeError):
    """Raised when a matrix is not positive definite even after escalating jitter."""


def robust_cholesky(matrix: Tensor, jitter: float = 0.0, max_tries: int = 6, what: str = "matrix") -> Tensor:
    """Lower Cholesky factor of ``matrix + jitter·I``, escalating the jitter ×10 on failure.

    Args:
        matrix: ``(..., M, M)`` symmetric matrix.
        jitter: diagonal added on the first try (then ×10, up to ``max_tries`` tries, starting at
            ``1e-8·mean(diag)`` when ``jitter`` is 0).
        what: a name for the matrix used in the error message (e.g. ``"K_zz"``).

    Raises:
        CholeskyError: naming ``what``, the largest jitter tried, and whether the input had NaNs.
    """
    eye = torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)
    L, info = torch.linalg.cholesky_ex(matrix + jitter * eye if jitter else matrix)
    finite = torch.isfinite(matrix).all()
    if bool(finite & (info == 0).all()):  # one host read (a device synchronisation on a GPU) when it succeeds
        return L
    if not bool(finite):
        raise CholeskyError(f"{what} contains NaN or inf entries; cannot factorise it")
    scale = matrix.diagonal(dim1=-2, dim2=-1).abs().mean().clamp_min(1e-12).item()
    extra = max(jitter, 1e-8 * scale)
    for _ in range(max_tries):
        L, info = torch.linalg.cholesky_ex(matrix + extra * eye)
        if not bool((info != 0).any()):
            return L
        extra *= 10
    raise CholeskyError(
        f"{what} ({matrix.shape[-1]}×{matrix.shape[-1]}) is not positive definite even with jitter "
        f"{extra / 10:.1e} added to the diagonal; check the kernel hyperparameters and for duplicated inducing points"
    )


def cholesky_inverse_from_precision(precision: Tensor, what: str = "precision") -> tuple[Tensor, Tensor]:
    """``(S, L_P)`` with ``S = P⁻¹`` and ``L_P`` the lower Cholesky factor of ``P``."""
    L_P = robust_cholesky(precision, what=what)
    S = torch.cholesky_inverse(L_P)
    return 0.5 * (S + S.mT), L_P
