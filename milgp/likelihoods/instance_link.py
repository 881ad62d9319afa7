"""Instance links of the MIL likelihoods: ``p(y_n = 1 | f_n)`` and its moments under ``q(f_n)``.

A bag rule (:mod:`milgp.prediction.bag_rules`) turns the instance posterior of a bag into a bag
probability; all it needs of the likelihood is its instance link:

* :class:`LogisticLink` — ``σ(f)``, the ψ-VGPMIL family (Castro-Macías et al., *Hyperbolic secant
  representation of the logistic function: application to probabilistic multiple instance
  learning for CT intracranial hemorrhage detection*, Artificial Intelligence 2024, Eqs. 31–33);
* :class:`ProbitLink` — ``Φ(f)``, the MIL probit model (Wang & Pinar, *The Multiple Instance
  Learning Gaussian Process Probit Model*, AISTATS 2021, §3.4).

Shapes: ``mean``, ``var``, ``f`` are elementwise (any shape).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

from milgp.likelihoods.quadrature import gauss_hermite_expectation

__all__ = ["InstanceLink", "LogisticLink", "ProbitLink"]


class InstanceLink(ABC):
    """``p(y = 1 | f)`` of one instance, pointwise and in expectation under ``f ~ N(mean, var)``."""

    name: str

    @abstractmethod
    def prob(self, f: Tensor) -> Tensor:
        """``p(y = 1 | f)`` elementwise."""

    @abstractmethod
    def log_prob_negative(self, f: Tensor) -> Tensor:
        """``log p(y = 0 | f)`` elementwise, accurate for large ``|f|``."""

    @abstractmethod
    def moments(self, mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor]:
        """``E[p(y=1|f)]`` and ``std[p(y=1|f)]`` under ``f ~ N(mean, var)``."""

    def log_expected_negative(self, mean: Tensor, var: Tensor, num_points: int = 40) -> Tensor:
        """``log E[p(y=0|f)]``, computed from ``p(y=0|f)`` directly (not as ``1 − E[p(y=1|f)]``, which
        loses every digit when the instance is almost surely positive), by Gauss–Hermite quadrature."""
        e = gauss_hermite_expectation(lambda f: torch.exp(self.log_prob_negative(f)), mean, var, num_points)
        return torch.log(e.clamp(torch.finfo(mean.dtype).tiny, 1.0))  # a probability, whatever the rounding

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class LogisticLink(InstanceLink):
    """``p(y = 1 | f) = σ(f)``; moments by 40-node Gauss–Hermite quadrature (error ≪ 1e-6)."""

    name = "logistic"

    def prob(self, f: Tensor) -> Tensor:
        return torch.sigmoid(f)

    def log_prob_negative(self, f: Tensor) -> Tensor:
        return torch.nn.functional.logsigmoid(-f)

    def moments(self, mean: Tensor, var: Tensor, num_points: int = 40) -> tuple[Tensor, Tensor]:
        p, p2 = gauss_hermite_expectation(_sigmoid_and_square, mean, var, num_points)
        # the weights sum to 1 only up to rounding: E[σ(f)] of a sure positive came out 1 + 2e-16
        return p.clamp(0.0, 1.0), (p2 - p * p).clamp_min(0).sqrt()


def _sigmoid_and_square(f: Tensor) -> Tensor:
    """``(σ(f), σ(f)²)`` stacked ``(2, ...)``: both moments from one evaluation of the sigmoid."""
    s = torch.sigmoid(f)
    return torch.stack((s, s * s))


@lru_cache(maxsize=4)
def _gauss_legendre(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.polynomial.legendre.leggauss(n)


class ProbitLink(InstanceLink):
    """``p(y = 1 | f) = Φ(f)`` (the augmentation ``m ~ N(f, 1)``, ``y = 1[m > 0]``).

    ``E[Φ(f)] = Φ(h)``, ``h = μ/sqrt(1 + σ²)``, exactly. ``E[Φ(f)²] = Φ₂(h, h; ρ)``, ``ρ = σ²/(1 + σ²)``,
    a bivariate normal CDF, by Sheppard's formula ``Φ(h)² + (2π)⁻¹ ∫_0^{asin ρ} exp(−h²/(1 + sin t)) dt``
    with 32-node Gauss–Legendre quadrature (~1e-15).
    """

    name = "probit"

    def prob(self, f: Tensor) -> Tensor:
        return torch.special.ndtr(f)

    def log_prob_negative(self, f: Tensor) -> Tensor:
        return torch.special.log_ndtr(-f)

    def moments(self, mean: Tensor, var: Tensor, num_points: int = 32) -> tuple[Tensor, Tensor]:
        h = mean / torch.sqrt(1.0 + var)
        p = torch.special.ndtr(h)
        top = torch.asin((var / (1.0 + var)).clamp(0.0, 1.0))
        x, w = _gauss_legendre(num_points)
        x = torch.as_tensor(x, dtype=mean.dtype, device=mean.device)
        w = torch.as_tensor(w, dtype=mean.dtype, device=mean.device)
        t = 0.5 * top.unsqueeze(-1) * (x + 1.0)
        integrand = torch.exp(-(h * h).unsqueeze(-1) / (1.0 + torch.sin(t)))
        second = p * p + 0.5 * top * (integrand * w).sum(-1) / (2.0 * math.pi)
        return p, (second - p * p).clamp_min(0.0).sqrt()

    def log_expected_negative(self, mean: Tensor, var: Tensor, num_points: int = 40) -> Tensor:
        """``log E[Φ(−f)] = log Φ(−h)`` exactly."""
        return torch.special.log_ndtr(-mean / torch.sqrt(1.0 + var))
