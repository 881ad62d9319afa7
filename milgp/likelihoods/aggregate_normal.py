"""Normal aggregate outputs, exact and conjugate (Law et al. 2018, Appendix A.3, Eqs. 21–25).

``y_a ~ N(Σ_{i∈a} w_i f_i, τ Σ_{i∈a} w_i²)`` (Eq. 22 with ``τ_i^a = τ``; identity link), with the
noise ``τ`` learned. The ELBO data term is exact (Eq. 25, with weights):

    −½ log(2π τ W2_a) − [(y_a − wᵀm^a)² + wᵀS^a w] / (2 τ W2_a),    W2_a = Σ_i w_i².

``wᵀS^a w`` is the within-bag covariance summed with the weights (``1ᵀS^a1`` for unit weights).

**Natural update.** With ``f_b = μ0_b + A_bᵀ v`` the expected log-likelihood is exactly quadratic in
``v``: ``−(y_a − wᵀμ0_b − g_aᵀv)² / (2τW2_a)`` plus ``v``-free terms, with ``g_a = Σ_{i∈a} w_i A_i``
(an ``index_add`` per bag). Its statistics are the rank-one-per-bag

    G = Σ_a g_a g_aᵀ / (τ W2_a),      h = Σ_a (y_a − wᵀμ0_b) g_a / (τ W2_a),

(not the diagonal ``natural_statistics``), and one natural step with ρ = 1 lands on the exact
optimum ``q*(v) = N(P̂⁻¹h, P̂⁻¹)``, ``P̂ = I + G``.
"""
from __future__ import annotations

import math
from typing import Any

import gpytorch
import torch
from gpytorch.constraints import GreaterThan
from torch import Tensor

from milgp.data.bags import Bags, segment_sum
from milgp.likelihoods.aggregate import AggregateLikelihood, IdentityLink, Link, PaddedBlocks
from milgp.likelihoods.natural_statistics import NaturalStatistics

__all__ = ["NormalAggregateLikelihood"]

_LOG_2PI = math.log(2 * math.pi)


class NormalAggregateLikelihood(AggregateLikelihood):
    """Gaussian bag likelihood with learned noise ``τ`` (attribute :attr:`noise`).

    Args:
        noise: initial ``τ`` (variance per unit weight).
        noise_lower_bound: constraint on ``τ``.
    """

    needs_covariance = True
    conjugate = True

    def __init__(self, link: str | Link = "identity", noise: float = 1.0, noise_lower_bound: float = 1e-6):
        super().__init__(link)
        if not isinstance(self.link, IdentityLink):
            raise ValueError(f"the Normal aggregate model is exact and conjugate with link='identity' only, got {self.link.name!r}")
        # float64, so that the initial τ is exact (a float32 parameter rounded it before any .to(float64))
        self.register_parameter("raw_noise", torch.nn.Parameter(torch.zeros((), dtype=torch.float64)))
        self.register_constraint("raw_noise", GreaterThan(noise_lower_bound))
        self.noise = noise

    @property
    def noise(self) -> Tensor:
        return self.raw_noise_constraint.transform(self.raw_noise)

    @noise.setter
    def noise(self, value: float | Tensor) -> None:
        value = torch.as_tensor(value, dtype=self.raw_noise.dtype)
        bound = self.raw_noise_constraint.lower_bound
        if value.numel() != 1 or not bool(value > bound) or not bool(torch.isfinite(value)):
            raise ValueError(f"the noise τ must be a finite number above its lower bound {float(bound):g}, got {value.tolist()}")
        self.initialize(raw_noise=self.raw_noise_constraint.inverse_transform(value))

    def bag_terms(
        self, y: Tensor, weights: Tensor, mean: Tensor, var: Tensor, bags: Bags, blocks: PaddedBlocks | None
    ) -> Tensor:
        bag_index, num_bags = bags.index, bags.num_bags
        tau = self.noise.to(mean)
        w2 = segment_sum(weights * weights, bag_index, num_bags)
        resid = y - segment_sum(weights * mean, bag_index, num_bags)
        if blocks is not None:
            wsw = (blocks.weights.unsqueeze(-2) @ blocks.cov @ blocks.weights.unsqueeze(-1)).squeeze(-1).squeeze(-1)
        elif bool((bags.sizes == 1).all()):
            wsw = segment_sum(weights * weights * var, bag_index, num_bags)
        else:
            raise ValueError("the Normal aggregate ELBO needs the within-bag covariance blocks for bags of more than one instance")
        scale = tau * w2
        return -0.5 * (_LOG_2PI + torch.log(scale)) - 0.5 * (resid * resid + wsw) / scale

    def closed_form_statistics(self, y: Tensor, weights: Tensor, A: Tensor, prior_mean: Tensor, bags: Bags) -> NaturalStatistics:
        """Exact statistics ``(h, G)`` (see the module docstring); ``A`` is ``(M, N)``."""
        bag_index, num_bags = bags.index, bags.num_bags
        with torch.no_grad():
            tau = self.noise.to(A)
            w2 = segment_sum(weights * weights, bag_index, num_bags)
            g = segment_sum(weights.unsqueeze(-1) * A.mT, bag_index, num_bags)  # (B, M)
            resid = y - segment_sum(weights * prior_mean, bag_index, num_bags)
            c = 1.0 / (tau * w2)
            G = (g * c.unsqueeze(-1)).mT @ g
            h = g.mT @ (c * resid)
        return NaturalStatistics(h=h, G=0.5 * (G + G.mT))

    def observation_moments(self, rate_mean: Tensor, rate_var: Tensor, weight_sq_sum: Tensor) -> tuple[Tensor, Tensor]:
        """``y_a``: mean ``E[η_a]``, variance ``Var[η_a] + τ Σ w_i²``."""
        return rate_mean, rate_var + self.noise.detach().to(rate_var) * weight_sq_sum

    def log_prob_given_rate(self, y: Tensor, rate: Tensor, weight_sq_sum: Tensor) -> Tensor:
        """``log N(y_a | η_a, τ Σ w_i²)``."""
        scale = self.noise.detach().to(rate) * weight_sq_sum
        return -0.5 * (_LOG_2PI + torch.log(scale) + (y - rate) ** 2 / scale)

    def forward(self, function_samples: Tensor, *args: Any, **kwargs: Any) -> gpytorch.distributions.base_distributions.Normal:
        """Individual response with unit weight: ``N(f, τ)``."""
        return torch.distributions.Normal(function_samples, self.noise.sqrt())

    def extra_repr(self) -> str:
        return f"link='identity', noise={float(self.noise):.4g}"
