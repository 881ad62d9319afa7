"""Reports of ``test`` and ``validate`` (metrics, predictions, plots) and training curves after ``fit``."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities import rank_zero_only

from lightning_modules.callbacks.run_metadata import csv_text, finite_or_none, output_folder, run_metadata, slice_positions
from milgp.data.atomic import atomic_write_json, atomic_write_text
from milgp.ct.cache_bag import bag_file_stem
from milgp.metrics import json_safe
from milgp.plots import plot_calibration, plot_scan_predictions, plot_training_curves, read_csv_log

__all__ = ["ReportWriter"]

_KEEP = ("bag_id", "bag_label", "bag_prob", "bag_std", "slice_probs", "slice_stds", "slice_labels", "slice_scores")
OUTCOMES = ("true positive", "false positive", "false negative", "true negative")


def outcome(record: dict, threshold: float) -> str | None:
    """The decision's outcome for a labelled scan (``None`` without a bag label)."""
    label = float(record["bag_label"])
    if not math.isfinite(label):
        return None
    called = record["bag_prob"] > threshold
    if label > 0.5:
        return "true positive" if called else "false negative"
    return "false positive" if called else "true negative"


def scans_to_plot(records: list[dict], threshold: float, per_kind: int) -> list[tuple[str, dict]]:
    """Up to ``per_kind`` scans of each kind, most confident first: true positives (highest
    probability), false positives (highest probability: the most confident false alarms) and false
    negatives (lowest probability: the most confident misses); scans without labels are drawn
    as ``"unlabelled"``, the most probable first."""
    by_kind: dict[str, list[dict]] = {"true positive": [], "false positive": [], "false negative": [], "unlabelled": []}
    for r in records:
        kind = outcome(r, threshold) or "unlabelled"
        if kind in by_kind:
            by_kind[kind].append(r)
    chosen = []
    for kind, rs in by_kind.items():
        rs = sorted(rs, key=lambda r: (r["bag_prob"] if kind == "false negative" else -r["bag_prob"], r["bag_id"]))
        chosen += [(kind, r) for r in rs[:per_kind]]
    return chosen


class ReportWriter(Callback):
    """Writes, on rank 0, into the run's version folder (:func:`output_folder`, e.g. ``<run>/test/version_0``)
    the reports of docs/lightning.md ("Outputs and metrics"): after ``test`` and ``validate`` (the JSON
    files only for aggregate-output models, ``pl_module.is_aggregate``), and after ``fit``.

    Args:
        name: the model's name in the reports (default: its class name).
        plots_per_kind: scans drawn per outcome (true positive, false positive, false negative).
        n_bins: calibration bins.
        threshold: the decision threshold of the bag probability (the calibrated ½).
    """

    def __init__(self, name: str | None = None, plots_per_kind: int = 3, n_bins: int = 10, threshold: float = 0.5):
        super().__init__()
        if plots_per_kind < 0 or n_bins < 1 or not 0.0 < threshold < 1.0:
            raise ValueError(f"ReportWriter needs plots_per_kind >= 0, n_bins >= 1 and 0 < threshold < 1, got {plots_per_kind}, {n_bins}, {threshold}")
        self.name = name
        self.plots_per_kind = plots_per_kind
        self.n_bins = n_bins
        self.threshold = threshold

    def _name(self, pl_module: pl.LightningModule) -> str:
        return self.name or type(pl_module).__name__

    @rank_zero_only
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        log_dir = getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
        csv_path = Path(log_dir) / "metrics.csv" if log_dir else None
        if csv_path is not None and csv_path.is_file():
            curves = read_csv_log(csv_path)
            if curves:
                plot_training_curves(output_folder(trainer) / "training_curves.png", curves,
                                     title=f"{self._name(pl_module)}: training curves")

    @rank_zero_only
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write(trainer, pl_module, "test", getattr(pl_module, "test_records", []), getattr(pl_module, "test_metrics", {}))

    @rank_zero_only
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate":  # not the validation epochs of a fit
            self.write(trainer, pl_module, "validate", getattr(pl_module, "val_records", []), getattr(pl_module, "val_metrics", {}))

    def write(self, trainer: pl.Trainer, pl_module: pl.LightningModule, subcommand: str, records: list[dict[str, Any]],
              metrics: dict[str, float]) -> None:
        """Write the report of ``records`` and ``metrics`` (class docstring)."""
        out = output_folder(trainer)
        aggregate = bool(getattr(pl_module, "is_aggregate", False))
        counts = {k: sum(outcome(r, self.threshold) == k for r in records) for k in OUTCOMES} if not aggregate else {}
        summary = {"model_name": self._name(pl_module), **run_metadata(trainer, pl_module, subcommand), "metrics": metrics,
                   "num_bags": len(records)}
        if not aggregate:
            summary.update(threshold=self.threshold, outcomes=counts)
        atomic_write_json(out / "metrics.json", json_safe(summary))
        atomic_write_json(out / "predictions.json", json_safe([{k: r.get(k) for k in _KEEP} for r in records]))
        if aggregate or not records:
            return  # aggregate targets are counts/totals, not probabilities: no calibration or decision
        rows = [[r["bag_id"], float(r["bag_label"]), float(r["bag_prob"]), float(r["bag_std"]), int(r["bag_prob"] > self.threshold),
                 outcome(r, self.threshold), len(r["slice_probs"])] for r in records]
        atomic_write_text(out / "predictions.csv", csv_text(["bag_id", "bag_label", "probability", "std", "decision", "outcome", "num_slices"], rows))
        labelled = [r for r in records if math.isfinite(float(r["bag_label"]))]
        if labelled:
            plot_calibration(out / "calibration.png", [r["bag_prob"] for r in labelled], [r["bag_label"] for r in labelled], self.n_bins,
                             title=f"{self._name(pl_module)}: bag calibration ({subcommand})")
        for k, (kind, r) in enumerate(scans_to_plot(records, self.threshold, self.plots_per_kind)):
            positions, axis = slice_positions(trainer, r["bag_id"], len(r["slice_probs"]))
            plot_scan_predictions(
                out / "scans" / f"{kind.replace(' ', '_')}_{k}_{bag_file_stem(r['bag_id'])}.png", r["slice_probs"], r.get("slice_stds"),
                r.get("slice_labels"), r["bag_label"], r["bag_prob"], finite_or_none(r.get("bag_std")),
                title=r["bag_id"], positions=positions, position_label=axis, threshold=self.threshold,
                heading=f"{self._name(pl_module)}: {kind}",
            )
