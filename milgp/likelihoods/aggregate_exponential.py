"""Exponential aggregate outputs (Law et al. 2018, Appendix A.1, A.4).

``y_a ~ Exponential(mean η_a)``, ``η_a = Σ_i w_i Ψ(f_i)``, i.e. ``log p(y|η) = −y/η − log η``
(natural parameter ``θ = F(η) = −1/η``, ``c(θ) = log η``). Both expectations are intractable; we
take lower bounds of each, so the objective is a true lower bound of the ELBO:

* ``E[F(η_a)] = −E[1/η_a] ≥ −1 / Σ_i (w_i / ξ_i)``, ``ξ_i = E[1/Ψ(f_i)]`` — the concave-link bound
  of Appendix A.4 (Eq. 26) with its optimal ``α_i ∝ w_i/ξ_i``. (Eq. 26 as printed reads
  ``−Σ(w/ξ) / Σ(w/ξ)²``; with the optimal α the value is ``−1/Σ_i(w_i/ξ_i)``.) For ``Ψ = exp``,
  ``ξ_i = e^{−μ_i + σ_i²/2}``, so ``w_i/ξ_i = w_i e^{μ_i − σ_i²/2}``.
* ``−E[log η_a] ≥ −log E[η_a] = −log Σ_i w_i e^{μ_i + σ_i²/2}`` (Jensen, concavity of log).

Only marginals are needed. ``Ψ = square`` is not offered: ``E[1/f²] = ∞`` for Gaussian ``f``, so
the bound is vacuous (Appendix A.4's remark that it is tractable does not hold for ``v²``).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from milgp.data.bags import Bags, segment_logsumexp
from milgp.likelihoods.aggregate import AggregateLikelihood, ExpLink, Link, PaddedBlocks

__all__ = ["ExponentialAggregateLikelihood"]


class ExponentialAggregateLikelihood(AggregateLikelihood):
    """Exponential bag likelihood with the concave-link lower bound (Law et al. 2018, Appendix A.4)."""

    def __init__(self, link: str | Link = "exp"):
        super().__init__(link)
        if not isinstance(self.link, ExpLink):
            raise ValueError(
                f"the Exponential aggregate model supports link='exp' only (got {self.link.name!r}): with "
                "Ψ(f)=f², E[1/f²] is infinite under a Gaussian q(f) and the Appendix A.4 bound is vacuous"
            )

    def check_targets(self, y: np.ndarray) -> None:
        self.refuse_bags(y < 0, y, "Exponential targets must be non-negative")

    def bag_terms(
        self, y: Tensor, weights: Tensor, mean: Tensor, var: Tensor, bags: Bags, blocks: PaddedBlocks | None
    ) -> Tensor:
        bag_index, num_bags = bags.index, bags.num_bags
        log_w = torch.log(weights)
        log_z = segment_logsumexp(log_w + mean - 0.5 * var, bag_index, num_bags)  # log Σ w_i/ξ_i
        log_e = segment_logsumexp(log_w + mean + 0.5 * var, bag_index, num_bags)  # log E[η_a]
        return -y * torch.exp(-log_z) - log_e

    def observation_moments(self, rate_mean: Tensor, rate_var: Tensor, weight_sq_sum: Tensor) -> tuple[Tensor, Tensor]:
        """``E[y] = E[η]``, ``Var[y] = E[Var(y|η)] + Var[η] = 2·E[η²] − E[η]²``."""
        second = rate_var + rate_mean * rate_mean
        return rate_mean, 2 * second - rate_mean * rate_mean

    def log_prob_given_rate(self, y: Tensor, rate: Tensor, weight_sq_sum: Tensor) -> Tensor:
        """``log p(y_a | η_a) = −y_a/η_a − log η_a`` (exponential with mean ``η_a``)."""
        return -y / rate - torch.log(rate)

    def forward(self, function_samples: Tensor, *args: Any, **kwargs: Any) -> torch.distributions.Exponential:
        """Individual response with unit weight: ``Exponential(rate = 1/Ψ(f))``."""
        return torch.distributions.Exponential(rate=1.0 / self.link(function_samples))
