"""Gaussian orthant probabilities ``P(X < 0 componentwise)``, ``X ~ N(μ, Σ)``, for many bags at once.

The MIL probit bag prediction (Wang & Pinar 2021, §3.4) is ``1 − P(all m*_n < 0)`` with
``m*_b ~ N(μ*_b, Σ*_b + I)``: an orthant probability with the *full* within-bag covariance. Wang & Pinar
point to Genz & Bretz (2009); this module implements Genz's separation-of-variables (SOV)
transformation (Genz 1992; Genz & Bretz 2009, §4.1.3) with randomised quasi-Monte Carlo:

With ``Σ = L Lᵀ`` and ``X = μ + L y``, the constraint ``X_i < 0`` reads
``y_i < b_i(y_<i) = (−μ_i − Σ_{j<i} L_ij y_j) / L_ii``. Writing ``e_i = Φ(b_i)`` and
``y_i = Φ⁻¹(w_i e_i)`` turns the probability into an integral over the unit cube,

    P = ∫_{[0,1]^{n−1}} Π_{i=1}^{n} e_i(w_1, …, w_{i−1}) dw,

whose integrand is smooth and bounded in ``[0, 1]``. We average it over ``num_points`` points of a
scrambled Sobol sequence (``torch.quasirandom.SobolEngine``), independently scrambled
``replicates`` times; the replicate means are i.i.d. unbiased estimates, so their mean is the
estimate and ``std / sqrt(replicates)`` its standard error (Owen 1997: randomised QMC error
``O(N^{−1}(log N)^{(d−1)/2})`` for smooth integrands, in practice close to ``1/N``).
Variables are statically re-ordered by increasing marginal probability ``Φ(−μ_i/σ_i)`` (the
most constraining first), Genz & Bretz's simple variance-reducing prior ordering.

The product is accumulated in log space (``log_ndtr``) and ``Φ⁻¹(w e)`` is evaluated on the
smaller side (``−Φ⁻¹(1 − w e)`` with ``1 − w e = (1 − w) + w Φ(−b)``) so that nothing underflows or
loses precision for bags of 100+ instances or near-certain bags. Padded input is accepted
(:func:`orthant_probability`).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["orthant_probability"]


def orthant_probability(
    mean: Tensor,
    cov: Tensor,
    mask: Tensor | None = None,
    num_points: int = 1024,
    replicates: int = 8,
    seed: int = 0,
    max_elements: int = 2**23,
) -> tuple[Tensor, Tensor]:
    """``P(X < 0)`` for ``X ~ N(mean_b, cov_b)``, per bag, and its randomised-QMC standard error.

    Bags are handled in batches of equal *real* size ``n_b`` (the padding is cut off first): each
    batch loops over its own ``n_b`` coordinates with ``n_b − 1``-dimensional Sobol points, so a
    bag's estimate depends only on its own coordinates, ``num_points``, ``replicates`` and ``seed`` —
    not on how far it was padded or which bags share the call (a bag of 5 next to one of 300 costs
    5 steps, not 300).

    Args:
        mean: ``(B, n)`` padded means.
        cov: ``(B, n, n)`` padded covariances (padded rows/columns: identity).
        mask: ``(B, n)`` True for real coordinates (``None``: all real).
        num_points: Sobol points per replicate (a power of two is best).
        replicates: independent scramblings (≥ 2 for a standard error).
        seed: seed of the first scrambling (replicate ``r`` uses ``seed + r``).
        max_elements: bags are processed in chunks so that ``replicates · num_points · chunk · n_b``
            stays below this.

    Returns:
        ``(p, stderr)``, each ``(B,)``. For ``n_b = 1`` the answer is exact (``stderr = 0``); a bag
        with no real coordinate gets ``p = 1``.
    """
    if mean.ndim != 2 or cov.shape != mean.shape + mean.shape[-1:]:
        raise ValueError(f"expected mean (B, n) and cov (B, n, n), got {tuple(mean.shape)} and {tuple(cov.shape)}")
    if replicates < 1 or num_points < 1:
        raise ValueError("replicates and num_points must be positive")
    B = mean.shape[0]
    if mask is None:
        mask = torch.ones_like(mean, dtype=torch.bool)
    mask = mask.to(torch.bool)
    p = mean.new_ones(B)
    se = mean.new_zeros(B)
    sizes = mask.sum(1)
    for k in torch.unique(sizes).tolist():
        if k == 0:
            continue
        idx = torch.nonzero(sizes == k, as_tuple=True)[0]
        # real coordinates first, in their original order; then drop the padding
        keep = torch.argsort((~mask[idx]).to(torch.int8), dim=1, stable=True)[:, :k]
        m_k, c_k = _select(mean[idx], cov[idx], keep)
        p[idx], se[idx] = _orthant_dense(m_k, c_k, num_points, replicates, seed, max_elements)
    return p, se


def _select(mean: Tensor, cov: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """``mean`` ``(B, n)`` and ``cov`` ``(B, n, n)`` at each bag's coordinates ``idx`` ``(B, k)``, in that order."""
    B, k = idx.shape
    rows = torch.gather(cov, 1, idx.unsqueeze(-1).expand(B, k, cov.shape[-1]))
    return torch.gather(mean, 1, idx), torch.gather(rows, 2, idx.unsqueeze(1).expand(B, k, k))


def _orthant_dense(
    mean: Tensor, cov: Tensor, num_points: int, replicates: int, seed: int, max_elements: int
) -> tuple[Tensor, Tensor]:
    """:func:`orthant_probability` for unpadded bags of one size ``n``: ``mean (B, n)``, ``cov (B, n, n)``,
    coordinates sorted by increasing marginal probability first (module docstring)."""
    B, n = mean.shape
    sd = torch.diagonal(cov, dim1=-2, dim2=-1).clamp_min(torch.finfo(cov.dtype).tiny).sqrt()
    if n > 1:
        mean, cov = _select(mean, cov, torch.argsort(torch.special.log_ndtr(-mean / sd), dim=1, stable=True))
    L, info = torch.linalg.cholesky_ex(cov)
    if bool((info != 0).any()):
        eye = torch.eye(n, dtype=cov.dtype, device=cov.device)
        L = torch.linalg.cholesky(cov + 1e-10 * sd.pow(2).mean(-1, keepdim=True).unsqueeze(-1) * eye)
    if n > 1:
        w = torch.stack(
            [
                torch.quasirandom.SobolEngine(n - 1, scramble=True, seed=seed + r).draw(num_points, dtype=torch.float64)
                for r in range(replicates)
            ]
        ).to(device=mean.device, dtype=mean.dtype)  # (R, S, n-1)
    else:
        num_points = 1
        w = mean.new_zeros(replicates, 1, 0)
    chunk = max(1, max_elements // max(1, replicates * num_points * n))
    ps, ses = [], []
    for start in range(0, B, chunk):
        sl = slice(start, start + chunk)
        est = _sov(mean[sl], L[sl], w)  # (R, b)
        ps.append(est.mean(0))
        ses.append(est.std(0) / math.sqrt(replicates) if replicates > 1 else torch.zeros_like(est[0]))
    return torch.cat(ps), torch.cat(ses)


def _sov(mean: Tensor, L: Tensor, w: Tensor) -> Tensor:
    """Genz SOV integrand averaged over the points ``w`` ``(R, S, n−1)``: ``(R, b)`` estimates.

    Works on ``y`` laid out ``(b, n, R·S)`` so that ``Σ_{j<i} L_ij y_j`` is one batched mat-vec."""
    b, n = mean.shape
    R, S = w.shape[:2]
    P = R * S
    tiny = torch.finfo(mean.dtype).tiny
    wt = w.reshape(P, -1).mT  # (n-1, P)
    y = mean.new_zeros(b, n, P)
    log_f = mean.new_zeros(b, P)
    diag = torch.diagonal(L, dim1=-2, dim2=-1)  # (b, n)
    for i in range(n):
        shift = torch.bmm(L[:, i : i + 1, :i], y[:, :i]).squeeze(1) if i else 0.0  # (b, P)
        upper = (-mean[:, i : i + 1] - shift) / diag[:, i : i + 1]
        log_e = torch.special.log_ndtr(upper)
        log_f = log_f + log_e
        if i == n - 1:
            break
        wi = wt[i]  # (P,)
        u = wi * torch.exp(log_e)
        low = u < 0.5
        comp = (1.0 - wi) + wi * torch.special.ndtr(-upper)  # 1 − w e, without cancellation
        y[:, i] = torch.where(
            low,
            torch.special.ndtri(torch.where(low, u, torch.full_like(u, 0.25)).clamp_min(tiny)),
            -torch.special.ndtri(torch.where(low, torch.full_like(comp, 0.25), comp).clamp_min(tiny)),
        )
    return torch.exp(log_f).reshape(b, R, S).mean(-1).mT
