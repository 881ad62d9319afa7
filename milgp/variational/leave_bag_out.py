"""Leave-one-bag-out predictive of the training bags from one fit (cavity distributions).

At a fixed point of the closed-form updates the whitened ``q(v)`` is Gaussian with natural
parameters that are sums over bags (:mod:`milgp.variational.natural_update`):

    P = I + Σ_b A_b Λ_b A_bᵀ,      η = Σ_b A_b (β_b − Λ_b mean(x_b)),

with each bag's quadratic coefficients ``(β_b, Λ_b)`` (VGPMIL: ``π_b − ½`` and ``θ_b``). Removing
bag ``b``'s own terms gives the *cavity* ``q_{−b}(v) = N(P_{−b}⁻¹ η_{−b}, P_{−b}⁻¹)``, the posterior
of a fit that never saw bag ``b`` (with the other bags' local variables held at their values).
Its predictive at bag ``b``'s instances is an honest, out-of-bag prediction of that bag, as in
approximate leave-one-out cross-validation for GPs (Opper & Winther, *Gaussian processes for
classification: mean-field algorithms*, Neural Computation 2000; Vehtari et al., *Bayesian
leave-one-out cross-validation approximations for Gaussian latent variable models*, JMLR 2016).

The estimators calibrate bags and select kernels on these out-of-bag predictions (about one sweep).
"""
from __future__ import annotations

from typing import Any

import torch
from gpytorch.models import ApproximateGP
from torch import Tensor

from milgp.data.bags import BagBatch, BagGroup, to_padded
from milgp.likelihoods.base import AugmentedBagLikelihood
from milgp.models.closed_form_strategy import Projection, WhitenedPosterior
from milgp.prediction.bag_posterior import BagPosterior
from milgp.variational.natural_update import natural_statistics

__all__ = ["leave_bag_out_posterior"]


@torch.no_grad()
def leave_bag_out_posterior(
    model: ApproximateGP,
    likelihood: AugmentedBagLikelihood,
    batch: BagBatch,
    locals_: Any,
    block_budget: int = 2**18,
    projection: tuple[Tensor, Projection] | None = None,
    moments: tuple[Tensor, Tensor] | None = None,
) -> BagPosterior:
    """Cavity predictive ``q_{−b}(f_b)`` of every training bag.

    Each bag's cavity is computed in whichever space is smaller: for a bag of ``n_b ≤ M``
    instances by the Woodbury identity in its own ``n_b``-dimensional space,

        A_bᵀ S_{−b} A_b = C + C W C,   A_bᵀ m_{−b} = (I + C W)(A_bᵀ m − C β_b),

    with ``C = A_bᵀ S A_b``, ``W = Λ^{½}(I − Λ^{½} C Λ^{½})⁻¹Λ^{½}`` (``I − Λ^{½}CΛ^{½}`` has eigenvalues
    ``1/(1 + σ²)``, so it is positive definite); for larger bags by downdating ``P`` and factorising
    the ``M × M`` cavity precision.

    Args:
        batch: the training bags (``x`` ``(N, D)``, ``bag_index``, ``bag_labels``).
        locals_: the likelihood's locals at the fit (e.g. ``π`` ``(N,)``).
        block_budget: at most this many block entries per group of bags.
        projection: ``(L, Projection)`` of ``batch.x`` already computed for the model's kernel.
        moments: ``(mean, var)`` of ``q(f)`` at ``batch.x`` already computed (e.g.
            :attr:`FitResult.moments`).

    Returns:
        A :class:`BagPosterior` with the cavity marginals of all ``N`` instances and, for joint
        bag rules, the cavity's within-bag covariance blocks.
    """
    x = batch.x
    proj = (model.variational_strategy.projection(x) if projection is None else projection[1]).with_residual()
    mean, var = model.variational_strategy.marginals(proj, model.variational_strategy.whitened_posterior()) if moments is None else moments
    beta, lam = likelihood.quadratic_terms(mean, var, batch.bags, batch.bag_labels, locals_)
    beta = beta - lam * proj.prior_mean
    AT = proj.A.mT  # (N, M)
    M = AT.shape[1]
    # the Gaussian these statistics define (q(v) itself may lag one update behind the locals)
    eta, P = natural_statistics(proj.A, beta, lam).targets()
    target = WhitenedPosterior.from_natural(eta, P)
    m, S = target.m, target.S

    def cavity_v(group: BagGroup, full: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Padded cavity mean ``(B_g, n)`` and covariance ``(B_g, n, n)`` of ``A_bᵀ v`` (``full=False``:
        its diagonal ``(B_g, n)`` alone, never forming an ``n × n`` matrix for a long bag), the mask
        and the padded projections ``A_pad`` ``(B_g, n, M)``."""
        inst, bags = group.inst, group.local_bags
        A_pad, mask = to_padded(AT, bags, rows=inst)  # padding rows are zero
        lam_pad, _ = to_padded(lam, bags, rows=inst)
        beta_pad, _ = to_padded(beta, bags, rows=inst)
        n = mask.shape[1]
        if n <= M:
            C = A_pad @ (A_pad @ S).mT
            C = 0.5 * (C + C.mT)
            r = lam_pad.sqrt()
            eye_n = torch.eye(n, dtype=x.dtype, device=x.device)
            L = torch.linalg.cholesky(eye_n - r.unsqueeze(-1) * C * r.unsqueeze(-2))
            V = torch.linalg.solve_triangular(L, r.unsqueeze(-1) * C, upper=False)  # (B_g, n, n)
            u = (A_pad @ m.unsqueeze(-1)).squeeze(-1) - (C @ beta_pad.unsqueeze(-1)).squeeze(-1)
            w = torch.linalg.solve_triangular(L, (r * u).unsqueeze(-1), upper=False)  # L⁻¹Λ^{½}u
            cov = C + V.mT @ V if full else torch.diagonal(C, dim1=-2, dim2=-1) + V.square().sum(-2)
            return u + (V.mT @ w).squeeze(-1), cov, mask, A_pad
        G = A_pad.mT @ (A_pad * lam_pad.unsqueeze(-1))
        h = (A_pad.mT @ beta_pad.unsqueeze(-1)).squeeze(-1)
        L_c = torch.linalg.cholesky(P - 0.5 * (G + G.mT))
        m_c = torch.cholesky_solve((eta - h).unsqueeze(-1), L_c).squeeze(-1)
        W = torch.linalg.solve_triangular(L_c, A_pad.mT, upper=False)  # (B_g, M, n)
        return (A_pad @ m_c.unsqueeze(-1)).squeeze(-1), W.mT @ W if full else W.square().sum(-2), mask, A_pad

    cav_mean, cav_var = torch.empty_like(mean), torch.empty_like(var)
    for g in batch.bags.groups(max(1, block_budget // M), block_budget):
        mean_v, var_v, mask, _ = cavity_v(g, full=False)
        cav_mean[g.inst] = proj.prior_mean[g.inst] + mean_v[mask]
        cav_var[g.inst] = proj.residual[g.inst] + var_v[mask]

    def blocks(group: BagGroup) -> tuple[Tensor, Tensor, Tensor]:
        _, cov_v, _, A_pad = cavity_v(group, full=True)
        mean_pad, _ = to_padded(cav_mean, group.local_bags, rows=group.inst)
        cov, mask = model.variational_strategy.block_covariances(x[group.inst], group.local_bags, A_pad, cov_v)
        return mean_pad, cov, mask

    return BagPosterior(cav_mean, cav_var.clamp_min(1e-10), batch.bags, blocks, block_budget)
