"""PNG plots of predictions (library side; matplotlib's Agg canvas, no global backend change).

* :func:`plot_scan_predictions` — one scan: per-slice probability with ±1 std bars, the true slice
  labels, and the bag prediction in the title (seed 000 Fig. 10);
* :func:`plot_calibration` — reliability diagram with the expected calibration error;
* :func:`plot_training_curves` — metrics logged during training (e.g. Lightning's CSV log).

Every function writes ``path`` (parent folders created) and returns it.
"""
from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from milgp.metrics import calibration_curve, expected_calibration_error

__all__ = ["plot_calibration", "plot_scan_predictions", "plot_training_curves", "read_csv_log"]


def _save(fig: Figure, path: str | os.PathLike[str]) -> str:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return str(path)


def plot_scan_predictions(
    path: str | os.PathLike[str],
    slice_probs: Sequence[float],
    slice_stds: Sequence[float] | None = None,
    slice_labels: Sequence[float] | None = None,
    bag_label: float | None = None,
    bag_prob: float | None = None,
    bag_std: float | None = None,
    title: str = "",
    score_name: str = "P(slice positive)",
) -> str:
    """Per-slice predictions of one scan as bars with ±1 std error bars; slices whose true label
    is positive are drawn red with a marker along the top (seed 000 Fig. 10)."""
    p = np.asarray(slice_probs, dtype=float)
    s = None if slice_stds is None else np.asarray(slice_stds, dtype=float)
    k = np.arange(len(p))
    fig = Figure(figsize=(max(5.0, 0.22 * len(p) + 2.0), 3.2))
    ax = fig.add_subplot(1, 1, 1)
    colors = ["tab:blue"] * len(p)
    if slice_labels is not None:
        lab = np.asarray(slice_labels, dtype=float)
        colors = ["tab:red" if v > 0.5 else "tab:blue" for v in lab]
        pos = k[lab > 0.5]
        if len(pos):
            ax.scatter(pos, np.full(len(pos), 1.04), marker="v", color="tab:red", s=18, label="true positive slice", clip_on=False)
    ax.bar(k, p, color=colors, alpha=0.75, yerr=s, capsize=2, error_kw={"elinewidth": 0.8})
    ax.set_ylim(0, 1.08)
    ax.set_xlim(-0.7, len(p) - 0.3)
    ax.set_xlabel("slice (scan order)")
    ax.set_ylabel(score_name)
    head = []
    if bag_label is not None:
        head.append(f"true scan label: {int(bag_label)}")
    if bag_prob is not None:
        head.append(f"predicted: {bag_prob:.2f}" + ("" if bag_std is None else f" ± {bag_std:.2f}"))
    ax.set_title((title + "\n" if title else "") + "   ".join(head), fontsize=9)
    if slice_labels is not None and (np.asarray(slice_labels) > 0.5).any():
        ax.legend(loc="upper left", fontsize=7, frameon=False)
    return _save(fig, path)


def plot_calibration(
    path: str | os.PathLike[str], probs: Any, labels: Any, n_bins: int = 10, title: str = "", curves: Mapping[str, tuple[Any, Any]] | None = None
) -> str:
    """Reliability diagram (fraction positive vs mean predicted probability per bin) with the ECE.

    ``curves`` optionally adds more named ``(probs, labels)`` pairs to the same axes.
    """
    fig = Figure(figsize=(4.2, 4.0))
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([0, 1], [0, 1], ls="--", color="grey", lw=1, label="perfect")
    series = {"model": (probs, labels)} if probs is not None else {}
    series.update(curves or {})
    for name, (p, y) in series.items():
        c = calibration_curve(p, y, n_bins)
        ece = expected_calibration_error(p, y, n_bins)
        ax.plot(c["mean_predicted"], c["fraction_positive"], marker="o", label=f"{name} (ECE {ece:.3f})")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("mean predicted probability")
    ax.set_ylabel("fraction positive")
    ax.set_title(title or "calibration", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    return _save(fig, path)


def read_csv_log(path: str | os.PathLike[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Lightning ``CSVLogger`` ``metrics.csv`` → ``{metric: (steps, values)}`` (empty cells dropped)."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    with open(path, newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            step = row.get("step", "")
            for key, value in row.items():
                if key in ("step", "epoch") or value in ("", None):
                    continue
                try:
                    v = float(value)
                    st = float(step) if step not in ("", None) else float(len(series.get(key, ([], []))[0]))
                except ValueError:
                    continue
                xs, ys = series.setdefault(key, ([], []))
                xs.append(st)
                ys.append(v)
    return {k: (np.asarray(x), np.asarray(y)) for k, (x, y) in series.items()}


def plot_training_curves(
    path: str | os.PathLike[str], curves: Mapping[str, tuple[Sequence[float], Sequence[float]]], title: str = "training curves"
) -> str:
    """One small panel per metric (``{name: (steps, values)}``), e.g. from :func:`read_csv_log`."""
    names = sorted(curves)
    if not names:
        names = []
    cols = min(3, max(1, len(names)))
    rows = max(1, math.ceil(len(names) / cols))
    fig = Figure(figsize=(4.0 * cols, 2.8 * rows))
    for i, name in enumerate(names):
        ax = fig.add_subplot(rows, cols, i + 1)
        x, y = curves[name]
        ax.plot(np.asarray(x), np.asarray(y), marker="." if len(y) < 50 else None, lw=1)
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("step", fontsize=7)
        ax.tick_params(labelsize=7)
    if not names:
        ax = fig.add_subplot(1, 1, 1)
        ax.text(0.5, 0.5, "no metrics logged", ha="center", va="center")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return _save(fig, path)
