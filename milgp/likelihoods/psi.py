"""Gaussian-scale-mixture densities ψ for ψ-VGPMIL (Castro-Macías et al.,
*Hyperbolic secant representation of the logistic function: application to probabilistic multiple
instance learning for CT intracranial hemorrhage detection*, Artificial Intelligence 2024, Sections
3–5, Appendix A).

ψ-VGPMIL replaces the hyperbolic secant density φ hidden in the logistic likelihood (Castro-Macías et al. 2024
Eq. 15) by any differentiable density with a Gaussian-scale-mixture (GSM) representation
``ψ(x) = ∫ N(x | 0, 1/ω) ψ̂(ω) dω`` (Eq. 39). Inference only needs two things of ψ:

* ``log_psi(x)``: the log-density, used in the ELBO through the closed-form bound
  ``E_q[log ψ(f)] ≥ log ψ(c)`` at ``c = sqrt(E_q[f²])`` (tangent bound of the GSM: ``log ψ(√t)``
  is convex in ``t``);
* ``theta(c) = −ψ'(c) / (c ψ(c))`` (Eq. 28, 64): the expectation of the augmenting precision
  ``ω`` under its optimal variational factor.

A new model is one small subclass of :class:`GSMDensity` implementing those two methods.
"""
from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod

import torch
from torch import Tensor

__all__ = ["GSMDensity", "HyperbolicSecantPsi", "GammaPsi"]


class GSMDensity(torch.nn.Module, ABC):
    """Interface of a Gaussian-scale-mixture density ψ (Castro-Macías et al. 2024, §4)."""

    @abstractmethod
    def log_psi(self, x: Tensor) -> Tensor:
        """``log ψ(x)``, elementwise, normalised as a density on ℝ."""

    @abstractmethod
    def theta(self, c: Tensor) -> Tensor:
        """``θ(c) = −ψ'(c) / (c ψ(c))`` (Castro-Macías et al. 2024, Eq. 28), elementwise, finite at ``c = 0``."""

    def forward(self, x: Tensor) -> Tensor:
        return self.log_psi(x)


class HyperbolicSecantPsi(GSMDensity):
    """ψ = φ, the hyperbolic secant density ``φ(x) = (2π cosh(x/2))⁻¹`` (Castro-Macías et al. 2024, Eq. 15).

    This gives VGPMIL ≡ PG-VGPMIL (Castro-Macías et al. 2024, §3.1): ``θ(c) = tanh(c/2) / (2c)`` (Eq. 14), the mean
    of ``PG(1, c)``, with limit 1/4 at ``c → 0`` (a Taylor series is used for small ``c``).
    """

    def log_psi(self, x: Tensor) -> Tensor:
        a = x.abs() / 2
        # log cosh(a) = a + log1p(exp(-2a)) - log 2, stable for large |x|
        log_cosh = a + torch.log1p(torch.exp(-2 * a)) - math.log(2.0)
        return -math.log(2 * math.pi) - log_cosh

    def theta(self, c: Tensor) -> Tensor:
        c = c.abs()
        small = c < 1e-3
        safe = torch.where(small, torch.ones_like(c), c)
        exact = torch.tanh(safe / 2) / (2 * safe)
        # tanh(c/2)/(2c) = 1/4 - c²/48 + c⁴/480 - ...
        c2 = c * c
        series = 0.25 - c2 / 48 + c2 * c2 / 480
        return torch.where(small, series, exact)


class GammaPsi(GSMDensity):
    """G-VGPMIL: ``ψ(x) = Z(α, β)⁻¹ (β + x²/2)^(−α)`` (Castro-Macías et al. 2024, Eq. 37), mixing density Gamma(α, β).

    ``θ(c) = α / (β + c²/2)`` exactly (Castro-Macías et al. 2024, §5). The normaliser, needed only for the ELBO's
    value, is ``Z(α, β) = √(2π) β^(½−α) Γ(α−½) / Γ(α)`` for ``α > ½``.

    A warning is issued for ``β > 2α²``: there the stationary point of ``(π − ½) f − ½ θ(f) f²``,
    ``f = (π − ½)(β + f²/2)/α``, has no real root for a confidently labelled instance (``π → 1``).

    Defaults ``α = 1, β = 1``: inside the paper's grid (α ∈ {0.5, 1}, β ∈ {1, 2.5, 4}) and the only
    point of it that satisfies ``β ≤ 2α²``.
    """

    def __init__(self, alpha: float = 1.0, beta: float = 1.0):
        super().__init__()
        if not alpha > 0.5:
            raise ValueError(f"GammaPsi needs alpha > 0.5 for a normalisable density, got alpha={alpha}")
        if not beta > 0:
            raise ValueError(f"GammaPsi needs beta > 0, got beta={beta}")
        if beta > 2 * alpha * alpha:
            warnings.warn(
                f"GammaPsi(alpha={alpha}, beta={beta}) has beta > 2*alpha**2: confidently labelled instances "
                "have no finite optimum and the latent function can grow without bound; use beta <= 2*alpha**2",
                RuntimeWarning,
                stacklevel=2,
            )
        self.alpha = float(alpha)
        self.beta = float(beta)

    def log_normalizer(self) -> float:
        """``log Z(α, β)`` of Eq. 37."""
        a, b = self.alpha, self.beta
        return 0.5 * math.log(2 * math.pi) + (0.5 - a) * math.log(b) + math.lgamma(a - 0.5) - math.lgamma(a)

    def log_psi(self, x: Tensor) -> Tensor:
        return -self.alpha * torch.log(self.beta + x * x / 2) - self.log_normalizer()

    def theta(self, c: Tensor) -> Tensor:
        return self.alpha / (self.beta + c * c / 2)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, beta={self.beta}"
