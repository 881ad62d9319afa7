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

The estimators fit their bag calibration (:class:`milgp.prediction.calibration.BagCalibrator`)
and select kernel hyperparameters on these out-of-bag predictions, at the cost of about one
sweep: per bag an ``M × M`` downdate and Cholesky factorisation, batched over groups of bags.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from milgp.data.bags import BagBatch, make_bag_groups, to_padded
from milgp.likelihoods.base import AugmentedBagLikelihood
from milgp.models.sparse_gp import SparseGP
from milgp.prediction.bag_posterior import BagPosterior

__all__ = ["leave_bag_out_posterior"]


@torch.no_grad()
def leave_bag_out_posterior(
    model: SparseGP,
    likelihood: AugmentedBagLikelihood,
    batch: BagBatch,
    locals_: Any,
    block_budget: int = 2**22,
) -> BagPosterior:
    """Cavity predictive ``q_{−b}(f_b)`` of every training bag.

    Args:
        batch: the training bags (``x`` ``(N, D)``, ``bag_index``, ``bag_labels``).
        locals_: the likelihood's locals at the fit (e.g. ``π`` ``(N,)``).
        block_budget: at most this many ``M × M`` and padded-block entries per group of bags.

    Returns:
        A :class:`BagPosterior` with the cavity marginals of all ``N`` instances and, for joint
        bag rules, the cavity's within-bag covariance blocks.
    """
    x, bag_index, B = batch.x, batch.bag_index, batch.num_bags
    q = model.whitened_posterior()
    L_K = model.inducing_cholesky()
    proj = model.projection(x, L_K)
    mean, var = model.marginals(proj, q)
    beta, lam = likelihood.quadratic_terms(mean, var, bag_index, batch.bag_labels, B, locals_)
    beta = beta - lam * proj.prior_mean
    AT = proj.A.mT  # (N, M)
    M = AT.shape[1]
    eye = torch.eye(M, dtype=x.dtype, device=x.device)
    P = eye + (AT * lam.unsqueeze(1)).mT @ AT
    eta = AT.mT @ beta
    def cavity(inst: Tensor, local: Tensor, n_bags: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Padded ``A_b`` ``(B_g, n, M)``, mask, and each bag's cavity mean ``m_{−b}`` ``(B_g, M)`` and
        Cholesky factor ``L_{−b}`` of ``P_{−b}`` ``(B_g, M, M)``."""
        A_pad, mask = to_padded(AT[inst], local, n_bags)
        lam_pad, _ = to_padded(lam[inst], local, n_bags)
        beta_pad, _ = to_padded(beta[inst], local, n_bags)
        G = A_pad.mT @ (A_pad * lam_pad.unsqueeze(-1))  # padding rows are zero
        h = (A_pad.mT @ beta_pad.unsqueeze(-1)).squeeze(-1)
        L_c = torch.linalg.cholesky(P - 0.5 * (G + G.mT))
        m_c = torch.cholesky_solve((eta - h).unsqueeze(-1), L_c).squeeze(-1)
        return A_pad, mask, m_c, L_c

    cav_mean, cav_var = torch.empty_like(mean), torch.empty_like(var)
    for g in make_bag_groups(bag_index, B, chunk_instances=max(1, block_budget // (M * M))):
        A_pad, mask, m_c, L_c = cavity(g.inst, g.local, g.num_bags)
        W = torch.linalg.solve_triangular(L_c, A_pad.mT, upper=False)  # (B_g, M, n)
        cav_mean[g.inst] = proj.prior_mean[g.inst] + (A_pad @ m_c.unsqueeze(-1)).squeeze(-1)[mask]
        cav_var[g.inst] = proj.prior_var[g.inst] - (AT[g.inst] ** 2).sum(1) + (W * W).sum(1)[mask]

    def blocks(inst: Tensor, local: Tensor, n_bags: int) -> tuple[Tensor, Tensor, Tensor]:
        A_pad, mask, _, L_c = cavity(inst, local, n_bags)
        W = torch.linalg.solve_triangular(L_c, A_pad.mT, upper=False)
        x_pad, _ = to_padded(x[inst], local, n_bags)
        mean_pad, _ = to_padded(cav_mean[inst], local, n_bags)
        n = mask.shape[1]
        eye_n = torch.eye(n, dtype=x.dtype, device=x.device)
        cov = model.covar_module(x_pad).to_dense() + model.jitter * eye_n - A_pad @ A_pad.mT + W.mT @ W
        pair = mask.unsqueeze(-1) & mask.unsqueeze(-2)
        cov = torch.where(pair, cov, eye_n.expand_as(cov))
        return mean_pad, 0.5 * (cov + cov.mT), mask

    return BagPosterior(cav_mean, cav_var.clamp_min(1e-10), bag_index, B, blocks, block_budget)
