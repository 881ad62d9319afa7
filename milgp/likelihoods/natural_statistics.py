"""The additive sufficient statistics a bag likelihood hands to the closed-form natural step.

A likelihood whose (augmented) expected log-likelihood is quadratic in ``f`` reports it through
``h = Σ_n A_n (b_n − λ_n mean_n)`` and ``G = Σ_n λ_n A_n A_nᵀ``; the variational layer
(:mod:`milgp.variational.natural_update`) turns them into the optimal whitened ``q(v)``; chunks and
DDP ranks add them up. It lives beside the likelihoods so that none imports the variational layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["NaturalStatistics"]


@dataclass
class NaturalStatistics:
    """Additive sufficient statistics of a quadratic expected log-likelihood.

    Attributes:
        h: ``(M,)`` ``Σ_n A_n (b_n − λ_n mean_n)``.
        G: ``(M, M)`` ``Σ_n λ_n A_n A_nᵀ``.
    """

    h: Tensor
    G: Tensor

    def __add__(self, other: "NaturalStatistics") -> "NaturalStatistics":
        return NaturalStatistics(self.h + other.h, self.G + other.G)

    def targets(self, scale: float = 1.0) -> tuple[Tensor, Tensor]:
        """``(η̂₁, P̂) = (s·h, I + s·G)``, the optimum of q(v) given these statistics."""
        M = self.h.shape[0]
        eye = torch.eye(M, dtype=self.G.dtype, device=self.G.device)
        return scale * self.h, eye + scale * self.G
