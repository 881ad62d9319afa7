"""Reports a clinician reads: true positives, confident false alarms and misses, legends, full ids, bin counts."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from matplotlib.figure import Figure

import milgp.plots as plots
from lightning_modules import ReportWriter

UID = "1.2.826.0.1.3680043.8.498.10098447218953862335219148470187543210"


def _record(bag_id: str, label: float, prob: float, slice_labels: list[int] | None) -> dict:
    n = 5
    return {"bag_id": bag_id, "bag_label": label, "bag_prob": prob, "bag_std": 0.05, "slice_probs": [prob / 2] * n,
            "slice_stds": [0.1] * n, "slice_scores": [prob / 2] * n, "slice_labels": slice_labels}


def _writer_run(tmp_path: Path, records: list[dict]) -> tuple[Path, list[Figure]]:
    trainer = SimpleNamespace(loggers=[], default_root_dir=str(tmp_path), datamodule=None, ckpt_path=str(tmp_path / "best.ckpt"),
                              state=SimpleNamespace(fn="test"))
    module = SimpleNamespace(test_records=records, test_metrics={"bag_auc": 0.7}, describe=lambda: {"class": "Model"})
    figures: list[Figure] = []
    saved = plots._save
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plots, "_save", lambda fig, path: figures.append(fig) or saved(fig, path))
        ReportWriter(name="gp", plots_per_kind=2).on_test_end(trainer, module)
    return tmp_path, figures


def test_scan_plots_show_hits_confident_false_alarms_and_misses_with_legends_and_full_ids(tmp_path: Path) -> None:
    """The report draws true positives, the most confident false positives and the most confident
    false negatives (by bag label, so also for a CQ500-style set without slice labels), each titled
    with the outcome and the full series UID, with a legend, and a calibration plot that shows how
    many scans each bin holds.

    Before, it drew the first 4 scans, always positives with slice labels (no misses, no false
    alarms, no plot at all for an external set without slice labels), cut the UID at 40 characters,
    and coloured bars by the label with no legend; the calibration plot had no bin counts."""
    records = [
        _record(UID, 1.0, 0.95, None), _record("tp_weak", 1.0, 0.6, None),
        _record("fp_confident", 0.0, 0.93, None), _record("fp_mild", 0.0, 0.55, None), _record("fp_least", 0.0, 0.52, None),
        _record("fn_confident", 1.0, 0.05, None), _record("fn_mild", 1.0, 0.4, None),
        _record("tn", 0.0, 0.1, None),
    ]
    out, figures = _writer_run(tmp_path, records)
    names = sorted(p.name for p in (out / "scans").iterdir())
    kinds = [n.split("_")[0] + "_" + n.split("_")[1] for n in names]
    assert kinds.count("true_positive") == 2 and kinds.count("false_positive") == 2 and kinds.count("false_negative") == 2
    assert any("fp_confident" in n for n in names) and any("fn_confident" in n for n in names) and not any("fp_least" in n for n in names)
    scan_figures = [f for f in figures if len(f.axes) == 1]
    titles = [f.axes[0].get_title().replace("\n", "") for f in scan_figures]
    assert any(UID in t and "true positive" in t for t in titles)
    assert all(f.axes[0].get_legend() is not None for f in scan_figures)
    calibration = next(f for f in figures if len(f.axes) == 2)
    counts = sorted(int(t.get_text()) for t in calibration.axes[1].texts)
    assert sum(counts) == len(records)
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["outcomes"] == {"true positive": 2, "false positive": 3, "false negative": 2, "true negative": 1}
    assert summary["checkpoint"].endswith("best.ckpt") and summary["model"] == {"class": "Model"}
    rows = (out / "predictions.csv").read_text().splitlines()
    assert rows[0].startswith("bag_id,bag_label,probability,std,decision,outcome") and len(rows) == 1 + len(records)
