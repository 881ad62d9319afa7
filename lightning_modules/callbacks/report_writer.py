"""Write test metrics (JSON), per-bag predictions and PNG plots after ``test``; training curves after ``fit``."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities import rank_zero_only

from milgp.data.atomic import atomic_write_json, atomic_write_text
from milgp.metrics import json_safe
from milgp.plots import plot_calibration, plot_scan_predictions, plot_training_curves, read_csv_log

__all__ = ["ReportWriter"]


class ReportWriter(Callback):
    """Outputs of a run, written by rank 0 into ``output_dir`` (default: the trainer's log dir):

    Files are prefixed with ``name`` so several models can share one folder; the JSON files are
    written atomically (a crash leaves the previous file, never a truncated one):

    * after ``test``: ``<name>_metrics.json`` (``{"model": name, "metrics": {bag_auc, bag_accuracy, bag_f1,
      bag_ece, instance_auc, ...}}``), ``<name>_predictions.json`` (per bag: id, label, probability ± std,
      slice probabilities ± std, slice labels), ``<name>_calibration.png`` (bag level) and
      ``<name>_scan_<k>.png`` for up to ``num_scan_plots`` test scans (positives with slice labels first;
      seed 000 Fig. 10); for aggregate-output likelihoods (``pl_module.is_aggregate``) only the two
      JSON files, whose ``bag_prob`` / ``slice_probs`` then hold predicted aggregates and rates;
    * after ``fit``: ``<name>_training_curves.png`` from the CSV logger's ``metrics.csv``, when there is one.

    Args:
        output_dir: folder (created).
        name: model name recorded in ``metrics.json``.
        num_scan_plots: how many per-scan plots to draw.
        n_bins: calibration bins.
    """

    def __init__(self, output_dir: str | None = None, name: str = "model", num_scan_plots: int = 4, n_bins: int = 10):
        super().__init__()
        self.output_dir = output_dir
        self.name = name
        self.num_scan_plots = num_scan_plots
        self.n_bins = n_bins

    def _dir(self, trainer: pl.Trainer) -> Path:
        d = Path(self.output_dir or trainer.log_dir or trainer.default_root_dir)
        d.mkdir(parents=True, exist_ok=True)
        return d

    @rank_zero_only
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        logger = trainer.logger
        log_dir = getattr(logger, "log_dir", None) if logger is not None else None
        csv_path = os.path.join(log_dir, "metrics.csv") if log_dir else None
        if csv_path and os.path.isfile(csv_path):
            curves = read_csv_log(csv_path)
            if curves:
                plot_training_curves(self._dir(trainer) / f"{self.name}_training_curves.png", curves, title=f"{self.name}: training curves")

    @rank_zero_only
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        records: list[dict[str, Any]] = getattr(pl_module, "test_records", [])
        metrics = getattr(pl_module, "test_metrics", {})
        out = self._dir(trainer)
        summary = {"model": self.name, "metrics": metrics, "num_bags": len(records)}
        atomic_write_json(out / f"{self.name}_metrics.json", json_safe(summary))
        keep = ("bag_id", "bag_label", "bag_prob", "bag_std", "slice_probs", "slice_stds", "slice_labels", "slice_scores")
        per_bag = json_safe([{k: r.get(k) for k in keep} for r in records])
        atomic_write_text(out / f"{self.name}_predictions.json", json.dumps(per_bag))
        if not records or getattr(pl_module, "is_aggregate", False):
            return  # aggregate targets are counts/totals, not probabilities: no calibration or slice-probability plots
        p = np.array([r["bag_prob"] for r in records])
        y = np.array([r["bag_label"] for r in records])
        plot_calibration(out / f"{self.name}_calibration.png", p, y, self.n_bins, title=f"{self.name}: bag calibration (test)")
        ranked = sorted(records, key=lambda r: (r.get("slice_labels") is None, -r["bag_label"], r["bag_id"]))
        for k, r in enumerate(ranked[: self.num_scan_plots]):
            std = r.get("bag_std")
            plot_scan_predictions(
                out / f"{self.name}_scan_{k}.png", r["slice_probs"], r.get("slice_stds"), r.get("slice_labels"), r["bag_label"],
                r["bag_prob"], None if std is None or not np.isfinite(std) else std, title=f"{self.name}: {r['bag_id'][:40]}",
            )
