"""Predictions for new scans from ``predict``: per scan and per slice, CSV + JSON + one PNG per scan."""
from __future__ import annotations

import sys
from typing import Any, Sequence

import pytorch_lightning as pl
from pytorch_lightning.callbacks import BasePredictionWriter

from lightning_modules.bag_module_base import BagModuleBase
from lightning_modules.callbacks.run_metadata import csv_text, finite_or_none, output_folder, run_metadata, slice_positions
from lightning_modules.input_error import InputError
from milgp.data.atomic import atomic_write_json, atomic_write_text
from milgp.ct.cache_bag import bag_file_stem
from milgp.metrics import json_safe
from milgp.plots import plot_scan_predictions

__all__ = ["PredictionWriter", "flatten_records"]


def flatten_records(predictions: Any) -> list[dict]:
    """The per-bag records of ``trainer.predict``'s nested outputs (per dataloader, per batch)."""
    if isinstance(predictions, dict):
        return [predictions]
    return [r for item in predictions for r in flatten_records(item)]


class PredictionWriter(BasePredictionWriter):
    """At the end of ``predict``, writes ``predictions.csv`` (per scan), ``slices.csv`` (per slice),
    ``predictions.json`` and ``scans/<id>.png`` into the run's version folder
    (``<run>/predict/version_<n>``; docs/lightning.md, "Outputs and metrics").

    Aggregate-output models write their predicted aggregate (``prediction``) instead of a
    probability and no decision. GP heads add ``outside_training``, the share of a scan's slices
    the training data say nothing about (:meth:`~lightning_modules.gp_head.GPHead.outside_training`),
    and a scan at 50 % or more is named in one line on stderr. Under DDP the ranks' scans are gathered and rank 0 writes.

    What the data module left out is listed in ``predictions.json`` under ``skipped`` (``{"what",
    "reason"}``): files and series refused when set up and series none of whose slices could be read
    (its ``record_predicted``), and slices left out of a predicted scan (its ``left_out``, looked up
    on the rank that served the scan).

    Args:
        threshold: decision threshold of the scan probability.
        plots: draw one PNG per scan.
    """

    def __init__(self, threshold: float = 0.5, plots: bool = True):
        super().__init__(write_interval="epoch")
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"the decision threshold must lie in (0, 1), got {threshold}")
        self.threshold = threshold
        self.plots = plots

    def write_on_epoch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, predictions: Sequence[Any], batch_indices: Sequence[Any]
    ) -> None:
        # the slice positions are looked up on the rank that served the scan (the slices it was given)
        dm = getattr(trainer, "datamodule", None)
        left_out = getattr(dm, "left_out", lambda bag_id: [])
        records = BagModuleBase.gather_records([{**r, "positions": slice_positions(trainer, r["bag_id"], len(r["slice_probs"])),
                                                 "left_out": left_out(r["bag_id"])} for r in flatten_records(predictions)])
        if not records:
            raise InputError("no scan could be predicted: every input was skipped (the lines above say why)")
        if trainer.global_rank != 0:
            return
        record_predicted = getattr(dm, "record_predicted", lambda predicted: [])
        skipped = record_predicted([r["bag_id"] for r in records])
        skipped += [{"what": path, "reason": reason} for r in records for path, reason in r["left_out"]]
        out = output_folder(trainer)
        aggregate = bool(getattr(pl_module, "is_aggregate", False))
        value = "prediction" if aggregate else "probability"
        scans, slice_rows = [], []
        for r in records:
            positions, axis = r["positions"]
            stds = r.get("slice_stds") or [None] * len(r["slice_probs"])
            labels = r.get("slice_labels") or [None] * len(r["slice_probs"])
            scan = {"bag_id": r["bag_id"], "num_slices": len(r["slice_probs"]), value: float(r["bag_prob"]),
                    "std": finite_or_none(r.get("bag_std")), "bag_label": finite_or_none(r["bag_label"]), "position_axis": axis}
            if not aggregate:
                scan["decision"] = int(r["bag_prob"] > self.threshold)
            if "outside_training" in r:
                scan["outside_training"] = float(r["outside_training"])
            scan["slices"] = [{"slice": k, "position": float(x), value: float(pk), "std": finite_or_none(sk), "label": lk}
                              for k, (x, pk, sk, lk) in enumerate(zip(positions, r["slice_probs"], stds, labels))]
            scans.append(scan)
            slice_rows += [[r["bag_id"], s["slice"], s["position"], s[value], s["std"], s["label"]] for s in scan["slices"]]
            if self.plots:
                plot_scan_predictions(
                    out / "scans" / f"{bag_file_stem(r['bag_id'])}.png", r["slice_probs"], r.get("slice_stds"), r.get("slice_labels"),
                    r["bag_label"], r["bag_prob"], finite_or_none(r.get("bag_std")), title=r["bag_id"], positions=positions, position_label=axis,
                    threshold=None if aggregate else self.threshold, score_name="E[rate]" if aggregate else "P(slice positive)",
                )
        header = ["bag_id", "num_slices", value, "std"] + ([] if aggregate else ["decision"]) + ["bag_label"]
        header += ["outside_training"] if any("outside_training" in s for s in scans) else []
        atomic_write_text(out / "predictions.csv", csv_text(header, [[s.get(k) for k in header] for s in scans]))
        atomic_write_text(out / "slices.csv", csv_text(["bag_id", "slice", "position", value, "std", "label"], slice_rows))
        meta = run_metadata(trainer, pl_module, "predict")
        atomic_write_json(out / "predictions.json", json_safe({**meta, "threshold": None if aggregate else self.threshold, "skipped": skipped,
                                                            "scans": scans}))
        for s in scans:
            if s.get("outside_training", 0.0) >= 0.5:
                print(f"milgp: scan {s['bag_id']}: {s['outside_training']:.0%} of its slices lie outside the training data (the GP knows "
                      f"nothing about them, its posterior there is the prior): its {value} is not evidence", file=sys.stderr)
        called = sum(s.get("decision", 0) for s in scans)
        print(f"wrote predictions of {len(scans)} scans to {out}" + ("" if aggregate else f" ({called} above the threshold {self.threshold:g})"))
