"""PNG plots of predictions (library side; matplotlib's Agg canvas, no global backend change).

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

__all__ = ["plot_calibration", "plot_rule_comparison", "plot_scan_predictions", "plot_training_curves", "read_csv_log"]


def _save(fig: Figure, path: str | os.PathLike[str]) -> str:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return str(path)


def _wrap(text: str, width: int = 64) -> str:
    """Break a long id (a DICOM UID) into lines of ``width`` characters, losing nothing."""
    return "\n".join(text[i : i + width] for i in range(0, len(text), width))


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
    positions: Sequence[float] | None = None,
    position_label: str = "slice (scan order)",
    threshold: float | None = 0.5,
    heading: str = "",
) -> str:
    """Per-slice predictions of one scan (as Fig. 10 of Castro-Macías et al., *Hyperbolic secant
    representation of the logistic function: application to probabilistic multiple instance
    learning for CT intracranial hemorrhage detection*, Artificial Intelligence 2024): bars with ±1
    std error bars at the slice positions (scan order), lesion slices marked along the top when
    labels are known, the decision threshold as a dashed line, a legend, and in the title
    ``heading`` (e.g. "false positive"), the full scan id ``title`` and the scan's label and
    predicted probability ± std."""
    p = np.asarray(slice_probs, dtype=float)
    s = None if slice_stds is None else np.asarray(slice_stds, dtype=float)
    x = np.arange(len(p), dtype=float) if positions is None else np.asarray(positions, dtype=float)
    step = float(np.min(np.diff(np.sort(x)))) if len(x) > 1 else 1.0
    step = step if step > 0 else 1.0
    fig = Figure(figsize=(min(14.0, max(5.5, 0.18 * len(p) + 2.5)), 3.6))
    ax = fig.add_subplot(1, 1, 1)
    ax.bar(x, p, width=0.8 * step, color="tab:blue", alpha=0.8, yerr=s, capsize=2 if len(p) <= 60 else 0,
           error_kw={"elinewidth": 0.8, "ecolor": "0.25"}, label=f"{score_name}" + (" ± 1 std" if s is not None else ""))
    if slice_labels is not None:
        pos = x[np.asarray(slice_labels, dtype=float) > 0.5]
        ax.scatter(pos, np.full(len(pos), 1.04), marker="v", color="tab:red", s=18, clip_on=False,
                   label=f"lesion slice (ground truth, {len(pos)})")
    if threshold is not None:
        ax.axhline(threshold, ls="--", lw=0.8, color="0.4", label=f"decision threshold {threshold:g}")
    ax.set(ylim=(0, 1.08), xlim=(float(x.min()) - 0.7 * step, float(x.max()) + 0.7 * step))
    ax.set(xlabel=position_label, ylabel=score_name)
    head = []
    if bag_label is not None and np.isfinite(bag_label):
        head.append(f"scan label {int(bag_label)}")
    if bag_prob is not None:
        head.append(f"P(scan positive) = {bag_prob:.3f}" + ("" if bag_std is None or not np.isfinite(bag_std) else f" ± {bag_std:.3f}"))
    ax.set_title("\n".join(line for line in (heading, _wrap(title), "   ".join(head)) if line), fontsize=8)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    return _save(fig, path)


def plot_calibration(
    path: str | os.PathLike[str], probs: Any, labels: Any, n_bins: int = 10, title: str = "", curves: Mapping[str, tuple[Any, Any]] | None = None
) -> str:
    """Reliability diagram (fraction positive vs mean predicted probability per bin) with the ECE,
    and below it the number of bags in each bin (a point of a near-empty bin means little).

    ``curves`` optionally adds more named ``(probs, labels)`` pairs to the same axes.
    """
    fig = Figure(figsize=(4.6, 5.4))
    grid = fig.add_gridspec(2, 1, height_ratios=[3, 1.2], hspace=0.08)
    ax = fig.add_subplot(grid[0])
    counts_ax = fig.add_subplot(grid[1], sharex=ax)
    ax.plot([0, 1], [0, 1], ls="--", color="grey", lw=1, label="perfect calibration")
    series = {"model": (probs, labels)} if probs is not None else {}
    series.update(curves or {})
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    width = (edges[1] - edges[0]) / max(1, len(series))
    for k, (name, (p, y)) in enumerate(series.items()):
        c = calibration_curve(p, y, n_bins)
        ece = expected_calibration_error(p, y, n_bins)
        line = ax.plot(c["mean_predicted"], c["fraction_positive"], marker="o", label=f"{name} (ECE {ece:.3f}, {len(np.asarray(p))} bags)")
        counts_ax.bar(c["bin_lower"] + (k + 0.5) * width, c["count"], width=0.9 * width, color=line[0].get_color())
        for lower, n in zip(c["bin_lower"], c["count"]):
            counts_ax.text(lower + (k + 0.5) * width, n, str(int(n)), ha="center", va="bottom", fontsize=6)
    ax.set(xlim=(0, 1), ylim=(0, 1), ylabel="fraction positive")
    ax.set_title(title or "calibration", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.tick_params(labelbottom=False)
    counts_ax.set_xlabel(f"predicted probability ({n_bins} bins)")
    counts_ax.set_ylabel("bags in bin", fontsize=8)
    counts_ax.margins(y=0.25)
    return _save(fig, path)


def plot_rule_comparison(
    path: str | os.PathLike[str], rules: Mapping[str, tuple[Any, Any]], threshold: float = 0.5, title: str = ""
) -> str:
    """``{rule name: (bag probabilities, bag labels)}`` as columns of points (negatives left, blue;
    positives right, red; jittered), the decision threshold, and per column how many negatives and
    positives lie above it."""
    fig = Figure(figsize=(max(5.0, 1.9 * len(rules) + 1.5), 4.2))
    ax = fig.add_subplot(1, 1, 1)
    rng = np.random.default_rng(0)
    for k, (name, (p, y)) in enumerate(rules.items()):
        p, y = np.asarray(p, dtype=float), np.asarray(y, dtype=float)
        for label, offset, colour, text in ((0.0, -0.15, "tab:blue", "negative scans"), (1.0, 0.15, "tab:red", "positive scans")):
            sel = p[y == label]
            ax.scatter(k + offset + rng.uniform(-0.08, 0.08, len(sel)), sel, s=12, alpha=0.7, color=colour, label=text if k == 0 else None)
        above_neg, above_pos = int(((p > threshold) & (y == 0)).sum()), int(((p > threshold) & (y == 1)).sum())
        ax.text(k, 1.04, f"> {threshold:g}: {above_neg}/{int((y == 0).sum())} neg, {above_pos}/{int((y == 1).sum())} pos",
                ha="center", va="bottom", fontsize=7)
    ax.axhline(threshold, ls="--", lw=0.8, color="0.4", label=f"decision threshold {threshold:g}")
    ax.set_xticks(range(len(rules)), list(rules), fontsize=7)
    ax.set(ylim=(-0.02, 1.12), ylabel="P(scan positive)")
    ax.set_title(title or "bag rules", fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
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
