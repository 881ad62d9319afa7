"""Poisson aggregate counts, VBAgg-Poisson (Law et al. 2018, §3, Eqs. 4, 8–14).

``y_a ~ Poisson(Σ_{i∈a} p_i Ψ(f_i))`` with populations ``p_i > 0``. The expected log-likelihood
(Law et al. 2018, Eq. 8/10) is

    y_a E[log Σ_i p_i Ψ(f_i)] − Σ_i p_i E[Ψ(f_i)] − log y_a!,

whose second term is exact (``E[e^f] = e^{μ+σ²/2}``, ``E[f²] = μ² + σ²``). The first is not:

* ``link="exp"``: Lemma 1 / Eq. 12 (Jensen with optimal mixture weights) gives the lower bound
  ``E log Σ p_i e^{f_i} ≥ log Σ p_i e^{μ_i}`` — only marginals needed; the objective is Eq. 14 (with
  the populations kept inside the log, as in Eq. 12) and is a true lower bound of the ELBO.
* ``link="square"``: the second-order Taylor expansion of ``E log‖V‖²``, ``V = P^{1/2} f_a``, around
  ``E‖V‖²`` (Eq. 11, Appendix E.4):
  ``ζ_a = log T_a − (2 m̃ᵀS̃m̃ + tr(S̃²)) / T_a²`` with ``T_a = mᵀPm + tr(SP)``,
  ``m̃ᵀS̃m̃ = (Pm)ᵀS^a(Pm)`` and ``tr(S̃²) = Σ_ij p_i p_j (S^a_ij)²`` — needs the full within-bag
  covariance ``S^a``. This is an approximation, not a bound. Note: Eq. 13 prints the expected rate
  as ``m² + S_ii/2``; the exact expectation ``E[f²] = m² + S_ii`` is used here.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from milgp.data.bags import Bags, segment_logsumexp, segment_sum
from milgp.likelihoods.aggregate import AggregateLikelihood, ExpLink, Link, PaddedBlocks, SquareLink

__all__ = ["PoissonAggregateLikelihood"]


class PoissonAggregateLikelihood(AggregateLikelihood):
    """VBAgg-Poisson bag likelihood (link ``"exp"``: Lemma 1 bound; ``"square"``: Taylor, Eq. 11).

    Targets are non-negative integer counts per bag; weights are populations ``p_i > 0``.
    """

    target_name = "count"

    def __init__(self, link: str | Link = "exp"):
        super().__init__(link)
        if not isinstance(self.link, (ExpLink, SquareLink)):
            raise ValueError(f"the Poisson aggregate model needs a positive link, 'exp' or 'square', got {self.link.name!r}")
        self.needs_covariance = isinstance(self.link, SquareLink)

    def check_targets(self, y: np.ndarray) -> None:
        self.refuse_bags((y < 0) | (y != np.round(y)), y, "Poisson counts must be non-negative integers")

    def bag_terms(
        self, y: Tensor, weights: Tensor, mean: Tensor, var: Tensor, bags: Bags, blocks: PaddedBlocks | None
    ) -> Tensor:
        bag_index, num_bags = bags.index, bags.num_bags
        rate = segment_sum(weights * self.link.mean(mean, var), bag_index, num_bags)  # Σ p_i E[Ψ(f_i)]
        const = torch.lgamma(y + 1)
        if isinstance(self.link, ExpLink):
            log_term = segment_logsumexp(torch.log(weights) + mean, bag_index, num_bags)  # Lemma 1
        elif blocks is None:
            raise ValueError("the square link needs the within-bag covariance blocks (PaddedBlocks)")
        else:
            log_term = self.taylor_log_norm(blocks)
        return y * log_term - rate - const

    @staticmethod
    def taylor_log_norm(blocks: PaddedBlocks) -> Tensor:
        """``ζ_a ≈ E log Σ_i p_i f_i²`` per bag ``(B,)`` (Law et al. 2018, Eq. 11)."""
        w, m, S = blocks.weights, blocks.mean, blocks.cov
        diag = torch.diagonal(S, dim1=-2, dim2=-1)
        T = (w * (m * m + diag)).sum(-1)
        pm = w * m
        quad = (pm.unsqueeze(-2) @ S @ pm.unsqueeze(-1)).squeeze(-1).squeeze(-1)
        WS = w.unsqueeze(-1) * S * w.unsqueeze(-2)
        tr2 = (WS * S).sum((-1, -2))
        return torch.log(T) - (2 * quad + tr2) / (T * T)

    def observation_moments(self, rate_mean: Tensor, rate_var: Tensor, weight_sq_sum: Tensor) -> tuple[Tensor, Tensor]:
        """``E[y_a] = E[η_a]``, ``Var[y_a] = E[η_a] + Var[η_a]``."""
        return rate_mean, rate_mean + rate_var

    def log_prob_given_rate(self, y: Tensor, rate: Tensor, weight_sq_sum: Tensor) -> Tensor:
        """``log Poisson(y_a | η_a) = y_a log η_a − η_a − log y_a!``."""
        return y * torch.log(rate) - rate - torch.lgamma(y + 1)

    def bag_metrics(self, y: np.ndarray, y_mean: np.ndarray) -> dict[str, float]:
        """``poisson_deviance``: the mean Poisson deviance ``2[y log(y/μ) − (y − μ)]`` at
        ``μ = E[y_a]`` (``y log(y/μ) = 0`` at ``y = 0``)."""
        mu = np.maximum(y_mean, 1e-12)
        y_log = np.where(y > 0, y * np.log(np.where(y > 0, y, 1.0) / mu), 0.0)
        return {"poisson_deviance": float(np.mean(2.0 * (y_log - (y - mu))))}

    def forward(self, function_samples: Tensor, *args: Any, **kwargs: Any) -> torch.distributions.Poisson:
        """Individual count with unit population: ``Poisson(Ψ(f))``."""
        return torch.distributions.Poisson(self.link(function_samples))
