"""Closed-form natural updates of the whitened q(v) (Castro-Macías et al. 2024, Algorithm 1).

When the augmented expected log-likelihood is quadratic in ``f``,

    E[log p(y | f, locals)] = Σ_n b_n f_n − ½ Σ_n λ_n f_n² + const,

the optimal Gaussian ``q(v)`` has natural parameters

    η̂₁ = s · A (b − λ ⊙ mean(x)),      −2 η̂₂ = P̂ = I + s · A diag(λ) Aᵀ,

with ``A = L⁻¹K_zx`` and ``s`` = total bags / bags in the batch (VGPMIL: ``b = π − ½``, ``λ = θ``;
Castro-Macías et al. 2024, Eqs. 26–27, whitened). Full batch with step ρ = 1 this *is* CAVI; with
minibatches of whole bags, ``η ← (1−ρ_t) η + ρ_t η̂`` with Robbins–Monro steps ρ_t is stochastic
variational inference; one ``gpytorch.optim.NGD(lr=ρ)`` step on the augmented ``VariationalELBO``
is the same update (tested). The step itself: :meth:`milgp.models.WhitenedPosterior.natural_step`.
"""
from __future__ import annotations

import numpy as np
import torch
from scipy.linalg import blas
from torch import Tensor

from milgp.likelihoods.natural_statistics import NaturalStatistics

__all__ = [
    "NaturalStatistics",
    "RobbinsMonro",
    "natural_statistics",
    "weighted_gram",
]


_GRAM_BLOCK = 1024
"""Instances per ``syrk`` in the blocked path of :func:`weighted_gram` (a scaled ``1024 × M`` block stays in cache)."""
_GRAM_BLOCKED_BYTES = 2**24
"""Size of the scaled float64 ``N × M`` matrix above which :func:`weighted_gram` works in blocks (16 MiB)."""


def natural_statistics(A: Tensor, linear: Tensor, precision: Tensor, prior_mean: Tensor | None = None) -> NaturalStatistics:
    """Statistics of ``Σ_n b_n f_n − ½ λ_n f_n²`` with ``f_n = mean_n + A_nᵀ v``.

    Args:
        A: ``(M, N)`` whitened projection.
        linear: ``(N,)`` coefficients ``b_n``.
        precision: ``(N,)`` coefficients ``λ_n ≥ 0``.
        prior_mean: ``(N,)`` mean function values (``None`` = zero mean).

    Cost ``O(N M²)``.
    """
    b = linear if prior_mean is None else linear - precision * prior_mean
    h = A @ b
    if A.device.type == "cpu" and bool((precision >= 0).all()):  # the syrk of weighted_gram
        G = weighted_gram(A, precision.sqrt())
    else:  # any sign of λ; on a GPU without the host read (a device synchronisation) of the test
        G = (A * precision.unsqueeze(0)) @ A.mT
        G = 0.5 * (G + G.mT)
    return NaturalStatistics(h=h, G=G)


def weighted_gram(A: Tensor, w: Tensor) -> Tensor:
    """``(A diag(w)) (A diag(w))ᵀ`` ``(M, M)`` for ``A`` ``(M, N)``, ``w`` ``(N,)``, exactly symmetric.

    On the CPU a BLAS ``syrk`` (half the flops of the general product), in float64 above
    :data:`_GRAM_BLOCKED_BYTES` accumulated over cached blocks of :data:`_GRAM_BLOCK` instances
    (docs/performance.md); elsewhere, or with gradients, one matrix product.
    """
    if A.device.type != "cpu" or A.dtype not in (torch.float64, torch.float32) or A.requires_grad or w.requires_grad:
        Yt = A.mT * w.unsqueeze(1)
        G = Yt.mT @ Yt
        return 0.5 * (G + G.mT)
    N, M = A.mT.shape
    if A.dtype != torch.float64 or N * M * 8 <= _GRAM_BLOCKED_BYTES:
        Yt = (A.mT * w.unsqueeze(1)).numpy()  # (N, M), in the memory layout of A
        return torch.from_numpy(Yt.T @ Yt)  # a syrk; NumPy fills the lower triangle from the upper
    At, w_np = A.mT.numpy(), w.numpy()
    buffer = np.empty((_GRAM_BLOCK, M))  # its transpose is (M, block), Fortran order
    G = np.zeros((M, M), order="F")
    for start in range(0, N, _GRAM_BLOCK):
        rows = buffer[: min(_GRAM_BLOCK, N - start)]
        np.multiply(At[start : start + rows.shape[0]], w_np[start : start + rows.shape[0], None], out=rows)
        G = blas.dsyrk(1.0, rows.T, beta=1.0, c=G, trans=0, lower=0, overwrite_c=1)  # upper triangle += Yᵀ Y
    upper = np.triu(G)
    return torch.from_numpy(upper + np.triu(upper, 1).T)


class RobbinsMonro:
    """Step sizes ``ρ_t = (t + τ)^(−κ)`` with ``κ ∈ (0.5, 1]`` and delay ``τ ≥ 0``.

    ``Σρ_t = ∞`` and ``Σρ_t² < ∞`` so stochastic natural steps converge (Robbins & Monro 1951;
    Hoffman et al. 2013, SVI). ``t`` starts at 0; with ``τ = 1`` the first step is 1.
    """

    def __init__(self, tau: float = 1.0, kappa: float = 0.6):
        if not 0.5 < kappa <= 1.0:
            raise ValueError(f"Robbins–Monro needs kappa in (0.5, 1], got {kappa}")
        if not tau > 0:
            raise ValueError(f"Robbins–Monro needs tau > 0 (the first step is tau**-kappa), got {tau}")
        self.tau = tau
        self.kappa = kappa

    def __call__(self, t: int) -> float:
        return float(min(1.0, (t + self.tau) ** (-self.kappa)))
