"""Bag-level calibration: a monotone map from a bag rule's score to a calibrated probability.

A bag rule's output is a score on ``[0, 1]`` whose scale depends on the rule, the model and the
bag lengths: the noisy-OR of G-VGPMIL sits near 1 for every bag, the max rule of a well-ranked
model near ½ for the positives. :class:`BagCalibrator` fits Platt scaling (Platt, *Probabilistic
outputs for support vector machines and comparisons to regularized likelihood methods*, 1999)

    p_cal = σ(a · logit(s) + c),   a ≥ 0,

by maximum likelihood on held-out bag scores (the estimators use leave-one-bag-out scores of the
training bags, :mod:`milgp.variational.leave_bag_out`), with Platt's smoothed targets
``(N₊ + 1)/(N₊ + 2)`` and ``1/(N₋ + 2)`` so that separable scores give a finite slope. ``a ≥ 0``
keeps the ranking of the rule; a model whose held-out scores rank worse than chance gets
``a = 0`` (the base rate) rather than a reversed ranking. The standard deviation of a calibrated
probability is the delta-method transform of the score's: ``σ_cal = a · p_cal(1 − p_cal) /
(s(1 − s)) · σ_s``, at most ``sqrt(p_cal(1 − p_cal))``, the largest std of a quantity in ``[0, 1]``
with mean ``p_cal`` (the linearisation overshoots for a wide score near 0 or 1).

It is a ``torch.nn.Module`` whose parameters are buffers, so it travels in a checkpoint.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["BagCalibrator", "cap_probability_std", "cross_fitted_calibration", "stratified_folds"]

_EPS = 1e-9


def cap_probability_std(p: Tensor, std: Tensor) -> Tensor:
    """``std`` capped at ``sqrt(p(1 − p))``, the largest standard deviation of any quantity in
    ``[0, 1]`` with mean ``p`` (its variance is at most ``E[q] − E[q]² = p(1 − p)``, as ``q² ≤ q``
    there). A std carried through a probability map by a linearisation (the delta method of
    :class:`BagCalibrator`) or a finite difference (:class:`~milgp.prediction.InstanceCalibrator`)
    can overshoot it where the map is steep or the input std wide."""
    return torch.minimum(std, (p * (1 - p)).clamp_min(0).sqrt())


def _logit(p: Tensor) -> Tensor:
    p = p.clamp(_EPS, 1 - _EPS)
    return torch.log(p) - torch.log1p(-p)


class BagCalibrator(torch.nn.Module):
    """Platt scaling of bag scores, ``σ(a · logit(s) + c)`` with ``a ≥ 0``; identity until fitted."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("slope", torch.tensor(1.0, dtype=torch.float64))
        self.register_buffer("intercept", torch.tensor(0.0, dtype=torch.float64))
        self.register_buffer("fitted", torch.tensor(False))

    @torch.no_grad()
    def fit(self, scores: Tensor, labels: Tensor, max_iter: int = 100) -> "BagCalibrator":
        """Fit ``(a, c)`` on held-out scores ``(B,)`` in ``[0, 1]`` and labels ``(B,)`` in {0, 1} by
        Newton's method on the (concave) log-likelihood; raises ``ValueError`` naming the first
        non-finite score or label other than 0 and 1."""
        s = torch.as_tensor(scores, dtype=torch.float64).reshape(-1).cpu()
        y = torch.as_tensor(labels, dtype=torch.float64).reshape(-1).cpu()
        if s.shape != y.shape:
            raise ValueError(f"{s.numel()} scores for {y.numel()} labels")
        bad = torch.nonzero(~torch.isfinite(s)).flatten()
        if bad.numel():
            raise ValueError(f"bag {int(bad[0])} has a non-finite score ({float(s[bad[0]])}); cannot calibrate")
        bad = torch.nonzero((y != 0) & (y != 1)).flatten()
        if bad.numel():
            raise ValueError(f"bag {int(bad[0])} has label {float(y[bad[0]])}; bag calibration takes labels 0 or 1")
        n_pos, n_neg = float(y.sum()), float((1 - y).sum())
        if n_pos == 0 or n_neg == 0:
            raise ValueError("bag calibration needs positive and negative bags")
        t = torch.where(y > 0.5, torch.tensor((n_pos + 1) / (n_pos + 2)), torch.tensor(1 / (n_neg + 2)))
        z = _logit(s)
        X = torch.stack([z, torch.ones_like(z)], 1)
        w = torch.tensor([0.0, math.log((n_pos + 1) / (n_neg + 1))], dtype=torch.float64)
        for _ in range(max_iter):
            p = torch.sigmoid(X @ w)
            grad = X.mT @ (t - p)
            hess = (X * (p * (1 - p)).clamp_min(1e-12).unsqueeze(1)).mT @ X + 1e-10 * torch.eye(2, dtype=torch.float64)
            step = torch.linalg.solve(hess, grad)
            w = w + step
            if float(step.abs().max()) < 1e-10:
                break
        if w[0] < 0:  # worse than chance held out: keep the ranking, predict the base rate
            w = torch.tensor([0.0, math.log(float(t.mean()) / (1 - float(t.mean())))], dtype=torch.float64)
        self.slope.fill_(float(w[0]))
        self.intercept.fill_(float(w[1]))
        self.fitted.fill_(True)
        return self

    def forward(self, p: Tensor, std: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Calibrated probabilities (and their stds) for scores ``p`` ``(B,)``; unchanged until fitted.
        Computed in float64 (in float32 the clamp of a score of 1 to ``1 − 1e-9`` is a no-op: logit
        ∞, std 0/0) and returned in the dtypes of ``p`` and ``std``."""
        if not bool(self.fitted):
            return p, std
        s = p.to(torch.float64)
        a, c = self.slope.to(s), self.intercept.to(s)
        p_cal = torch.sigmoid(a * _logit(s) + c)
        if std is None:
            return p_cal.to(p.dtype), None
        sc = s.clamp(_EPS, 1 - _EPS)
        std_cal = cap_probability_std(p_cal, a * p_cal * (1 - p_cal) / (sc * (1 - sc)) * std.to(torch.float64))
        return p_cal.to(p.dtype), std_cal.to(std.dtype)

    def extra_repr(self) -> str:
        return f"slope={float(self.slope):.4g}, intercept={float(self.intercept):.4g}, fitted={bool(self.fitted)}"


def stratified_folds(labels: Tensor, folds: int) -> Tensor | None:
    """Fold ``0..folds-1`` of each of ``B`` bags ``(B,)`` (labels in {0, 1}), dealt in turn within
    each class so that every fold holds both; ``None`` when a class has fewer bags than folds.
    ``folds`` below 2 is refused: each fold is calibrated on the others."""
    if folds < 2:
        raise ValueError(f"folds must be at least 2 (each fold is calibrated on the others), got {folds}")
    y = torch.as_tensor(labels, dtype=torch.float64).reshape(-1).cpu()
    pos, neg = torch.nonzero(y > 0.5).flatten(), torch.nonzero(y <= 0.5).flatten()
    if min(len(pos), len(neg)) < folds:
        return None
    fold = torch.empty(len(y), dtype=torch.long)
    fold[pos], fold[neg] = torch.arange(len(pos)) % folds, torch.arange(len(neg)) % folds
    return fold


def cross_fitted_calibration(scores: Tensor, labels: Tensor, folds: int = 2) -> Tensor | None:
    """Out-of-fold calibrated probabilities ``(B,)`` of held-out bag scores: the bags are dealt into
    ``folds`` folds (:func:`stratified_folds`) and each fold is calibrated by a
    :class:`BagCalibrator` fitted on the others — an honest NLL of a calibration fitted on the same
    bags; ``None`` when a class has fewer bags than folds."""
    s = torch.as_tensor(scores, dtype=torch.float64).reshape(-1).cpu()
    y = torch.as_tensor(labels, dtype=torch.float64).reshape(-1).cpu()
    fold = stratified_folds(y, folds)
    if fold is None:
        return None
    out = torch.empty_like(s)
    for k in range(folds):
        held = fold == k
        out[held] = BagCalibrator().fit(s[~held], y[~held])(s[held])[0]
    return out
