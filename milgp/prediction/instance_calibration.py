"""Instance probabilities calibrated to the MIL fits' posterior instance labels.

Single-instance learning's instance probability estimates the label of the instance's *bag*. The
MIL fits (the largest-other-π rule, the MIL probit model) hold a posterior ``q(y_n = 1)`` over each
training instance's own label given its bag's label (``π`` for VGPMIL; 0 in every negative bag),
but their own ``E_q[p(y = 1 | f)]`` ignores the bag labels (docs/core.md, "Instance probabilities").

:class:`InstanceCalibrator` keeps the averaged score ``s(x)`` for the ranking and maps it to the
average posterior label of the training instances with that score, by isotonic regression over
the training instances — no instance label is needed:

    p̃(s) = E[q(y_n = 1) | s(x_n) = s],   fitted as the non-decreasing least-squares fit of q(y) on s,

which is ``E[y | s]`` when ``q(y_n = 1) = P(y_n = 1 | x_n, T)`` (``E[y | s] = E[E[y | x, T] | s]``).
Isotonic calibration of scores: Zadrozny & Elkan, *Transforming classifier scores into accurate
multiclass probability estimates*, KDD 2002.

A standard deviation ``σ`` of the score (the std of ``p(y = 1 | f*)`` under ``q(f*)``, averaged
like the score) is carried through the map as its half spread over ``s ± σ``,
``(p̃(s + σ) − p̃(s − σ)) / 2``, capped at ``sqrt(p̃(s)(1 − p̃(s)))``, the largest std of any
quantity in ``[0, 1]`` with mean ``p̃(s)`` (:func:`~milgp.prediction.calibration.cap_probability_std`,
the cap of the bag calibration too). The half spread is a finite difference, not a std of a
probability with mean ``p̃(s)``: where ``p̃`` rises steeply between ``s − σ`` and ``s + σ`` away
from ``s`` it exceeds that bound.
"""
from __future__ import annotations

import numpy as np
import torch
from sklearn.isotonic import IsotonicRegression
from torch import Tensor

from milgp.prediction.calibration import cap_probability_std

__all__ = ["InstanceCalibrator"]


class InstanceCalibrator:
    """The non-decreasing map ``p̃`` from an instance score in [0, 1] to a target probability (module
    docstring), piecewise linear between its knots and constant beyond them."""

    def fit(self, score: Tensor, target: Tensor) -> "InstanceCalibrator":
        """Fit on training instances' scores ``(N,)`` and target probabilities ``(N,)``."""
        s = score.detach().to(torch.float64).cpu().numpy()
        t = target.detach().to(torch.float64).cpu().numpy()
        if s.shape != t.shape or s.ndim != 1 or len(s) == 0:
            raise ValueError(f"score and target must be equal-length non-empty vectors, got {s.shape} and {t.shape}")
        iso = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip").fit(s, t)
        self.knots_ = torch.as_tensor(np.asarray(iso.X_thresholds_, dtype=np.float64))
        self.values_ = torch.as_tensor(np.asarray(iso.y_thresholds_, dtype=np.float64))
        return self

    def transform(self, score: Tensor) -> Tensor:
        """``p̃(score)`` for scores of any shape, in their dtype and on their device."""
        knots = self.knots_.to(device=score.device, dtype=score.dtype)
        values = self.values_.to(device=score.device, dtype=score.dtype)
        if len(knots) == 1:
            return values.expand_as(score).clone()
        s = score.clamp(knots[0], knots[-1])
        right = torch.searchsorted(knots, s.contiguous(), right=True).clamp(1, len(knots) - 1)
        x0, x1, y0, y1 = knots[right - 1], knots[right], values[right - 1], values[right]
        width = x1 - x0  # knots distinct in float64 may coincide in the scores' dtype
        return y0 + torch.where(width > 0, (s - x0) / width.clamp_min(torch.finfo(s.dtype).tiny), 0.0) * (y1 - y0)

    def __call__(self, score: Tensor, std: Tensor) -> tuple[Tensor, Tensor]:
        """Mapped probability ``p̃(s)`` and standard deviation ``(N,)`` from a score and its std ``(N,)``:
        the map's half spread over ``s ± σ``, at most ``sqrt(p̃(s)(1 − p̃(s)))`` (module docstring)
        (``ValueError`` naming the first std that is not ``>= 0``)."""
        bad = torch.nonzero(~(std >= 0)).flatten()
        if bad.numel():
            raise ValueError(f"instance {int(bad[0])} has std {float(std[bad[0]])}; a standard deviation must be >= 0")
        upper = self.transform((score + std).clamp(max=1.0))
        lower = self.transform((score - std).clamp(min=0.0))
        p = self.transform(score)
        return p, cap_probability_std(p, 0.5 * (upper - lower))
