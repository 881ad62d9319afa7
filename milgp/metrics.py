"""Bag- and instance-level classification metrics (library side: no Lightning).

Every function takes probabilities (or scores) and binary labels as NumPy arrays or tensors, and
refuses a non-finite score or probability (``nan``, ``±inf``) and a label other than 0/1 with a
``ValueError`` naming the index of the first bad entry: a NaN prediction means something upstream
broke, and a metric computed around it (or with it silently turned into 0) would hide that.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from scipy.stats import rankdata

__all__ = [
    "accuracy",
    "auroc",
    "calibrated_ece",
    "calibration_curve",
    "classification_metrics",
    "expected_calibration_error",
    "f1_score",
    "json_safe",
    "log_loss",
]


def _vector(values: Any) -> np.ndarray:
    """``values`` (array-like or tensor) flattened to a float64 NumPy vector."""
    values = values.detach().cpu() if isinstance(values, torch.Tensor) else values
    return np.asarray(values, dtype=np.float64).reshape(-1)


def _as_arrays(probs: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(N,)`` float64 scores and labels, checked: same length, finite scores, labels 0/1 (a
    ``ValueError`` names the first bad entry's index, in flattened order)."""
    p, y = _vector(probs), _vector(labels)
    if p.shape != y.shape:
        raise ValueError(f"{p.shape[0]} predictions for {y.shape[0]} labels")
    bad = np.flatnonzero(~np.isfinite(p))
    if bad.size:
        raise ValueError(f"score {int(bad[0])} is {p[bad[0]]} ({bad.size} of {p.size} scores are not finite); metrics need finite scores")
    bad = np.flatnonzero(~np.isin(y, (0.0, 1.0)))
    if bad.size:
        raise ValueError(f"label {int(bad[0])} is {y[bad[0]]} ({bad.size} of {y.size} labels are not 0 or 1); labels must be 0 or 1")
    return p, y


def auroc(scores: Any, labels: Any) -> float:
    """Area under the ROC curve of raw scores (any finite reals: only their order counts), as the
    Mann–Whitney statistic ``(Σ ranks of positives − n₊(n₊+1)/2) / (n₊ n₋)`` with tied scores at
    their average rank, in float64; ``nan`` when the labels hold one class only (or are empty)."""
    s, y = _as_arrays(scores, labels)
    positives = int(y.sum())
    negatives = y.size - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    rank_sum = float(rankdata(s)[y == 1].sum())
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def accuracy(probs: Any, labels: Any, threshold: float = 0.5) -> float:
    """Fraction of correct decisions ``1[p > threshold]`` (``nan`` when empty)."""
    p, y = _as_arrays(probs, labels)
    if p.size == 0:
        return float("nan")
    return float(np.mean((p > threshold) == (y == 1)))


def f1_score(probs: Any, labels: Any, threshold: float = 0.5) -> float:
    """F1 of the positive class for decisions ``1[p > threshold]`` (0 when nothing is predicted
    or labelled positive, as scikit-learn's ``zero_division=0``; ``nan`` when empty)."""
    p, y = _as_arrays(probs, labels)
    if p.size == 0:
        return float("nan")
    predicted, actual = p > threshold, y == 1
    true_positives = int(np.sum(predicted & actual))
    denominator = int(predicted.sum()) + int(actual.sum())
    return 2 * true_positives / denominator if denominator else 0.0


def log_loss(probs: Any, labels: Any, eps: float = 1e-7) -> float:
    """Mean negative log-likelihood (binary cross-entropy) of the labels, probabilities clipped to
    ``[eps, 1 − eps]`` (``nan`` when empty)."""
    p, y = _as_arrays(probs, labels)
    if p.size == 0:
        return float("nan")
    p = np.clip(p, eps, 1 - eps)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def _bin_ids(p: np.ndarray, n_bins: int) -> np.ndarray:
    if n_bins < 1:
        raise ValueError(f"n_bins must be at least 1, got {n_bins}")
    # bin k holds (k/K, (k+1)/K]; p = 0 goes to bin 0
    return np.clip(np.ceil(np.clip(p, 0.0, 1.0) * n_bins).astype(np.int64) - 1, 0, n_bins - 1)


def calibration_curve(probs: Any, labels: Any, n_bins: int = 10) -> dict[str, np.ndarray]:
    """Reliability-diagram points of the non-empty bins.

    Returns:
        ``{"mean_predicted", "fraction_positive", "count", "bin_lower", "bin_upper"}``, each
        ``(K',)`` for the ``K'`` non-empty bins.
    """
    p, y = _as_arrays(probs, labels)
    ids = _bin_ids(p, n_bins)
    count = np.bincount(ids, minlength=n_bins)
    sum_p = np.bincount(ids, weights=p, minlength=n_bins)
    sum_y = np.bincount(ids, weights=y, minlength=n_bins)
    keep = count > 0
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    return {
        "mean_predicted": sum_p[keep] / count[keep],
        "fraction_positive": sum_y[keep] / count[keep],
        "count": count[keep],
        "bin_lower": edges[:-1][keep],
        "bin_upper": edges[1:][keep],
    }


def expected_calibration_error(probs: Any, labels: Any, n_bins: int = 10) -> float:
    """``Σ_k (n_k / n) |mean(y)_k − mean(p)_k|`` over the ``n_bins`` equal-width bins ``[0, 1/K],
    (1/K, 2/K], …`` of the predicted positive probability (``nan`` when empty)."""
    curve = calibration_curve(probs, labels, n_bins)
    n = curve["count"].sum()
    if n == 0:
        return float("nan")
    return float(np.sum(curve["count"] / n * np.abs(curve["fraction_positive"] - curve["mean_predicted"])))


def calibrated_ece(probs: Any, n_bins: int = 10, draws: int = 1000, seed: int = 0) -> float:
    """Mean ECE when the labels are drawn from ``probs`` themselves (consistency resampling:
    Bröcker & Smith, "Increasing the reliability of reliability diagrams", Weather and Forecasting
    2007, §3).

    A perfectly calibrated forecaster still shows a positive ECE on a finite sample, roughly
    ``√(p(1−p) / n_k)`` per bin; on a few dozen bags that floor is several hundredths. An ECE near
    this value is what calibration can achieve on that many samples; one well above it is
    miscalibration. ``draws`` label vectors are drawn with a private generator seeded by ``seed``
    (global RNG untouched).
    """
    p = _vector(probs)
    if not np.isfinite(p).all() or ((p < 0) | (p > 1)).any():
        bad = int(np.flatnonzero(~(np.isfinite(p) & (p >= 0) & (p <= 1)))[0])
        raise ValueError(f"probability {bad} is {p[bad]}; calibrated_ece needs probabilities in [0, 1]")
    if p.size == 0:
        return float("nan")
    ids = _bin_ids(p, n_bins)
    sum_p = np.bincount(ids, weights=p, minlength=n_bins)
    labels = np.random.default_rng(seed).random((draws, p.size)) < p  # (draws, N)
    # per-draw positives per bin: (draws, n_bins) by one scatter-add over the flattened draws
    flat = (np.arange(draws)[:, None] * n_bins + ids[None, :]).reshape(-1)
    sum_y = np.bincount(flat, weights=labels.reshape(-1), minlength=draws * n_bins).reshape(draws, n_bins)
    return float(np.mean(np.abs(sum_y - sum_p).sum(1)) / p.size)


def classification_metrics(
    probs: Any, labels: Any, prefix: str = "", threshold: float = 0.5, n_bins: int = 10
) -> dict[str, float]:
    """``{prefix}auc``, ``{prefix}accuracy``, ``{prefix}f1``, ``{prefix}ece``, ``{prefix}nll`` and ``{prefix}count``:
    the format of the ``metrics.json`` files the training system writes (:func:`json_safe`).

    ``probs`` should be probabilities for accuracy/F1/ECE to mean anything; AUROC only needs scores.
    """
    p, y = _as_arrays(probs, labels)
    return {
        f"{prefix}auc": auroc(p, y),
        f"{prefix}accuracy": accuracy(p, y, threshold),
        f"{prefix}f1": f1_score(p, y, threshold),
        f"{prefix}ece": expected_calibration_error(p, y, n_bins),
        f"{prefix}nll": log_loss(p, y),
        f"{prefix}count": int(p.size),
    }


def json_safe(obj: Any) -> Any:
    """Recursively turn NumPy/torch scalars into Python numbers and ``nan``/``inf`` into ``None``."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return json_safe(obj.item() if obj.numel() == 1 else obj.tolist())
    if isinstance(obj, np.ndarray):
        return json_safe(obj.tolist())
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
