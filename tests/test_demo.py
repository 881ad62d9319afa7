"""`python -m milgp.demo` in its quick mode: every stage runs and writes metrics.json + plots."""
from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.slow
def test_quick_demo_writes_metrics_and_plots(tmp_path: Path) -> None:
    """The demo (synthetic DICOM → cache → AttCNN → features → two-stage GP → end-to-end GP) runs
    with tiny data and writes, for each model, the test metrics the README promises, the plots and
    a summary table.

    If this fails, `make demo` is broken on a fresh clone."""
    from milgp.demo import MODELS, main

    out = tmp_path / "demo"
    assert main(["--out", str(out), "--quick", "--no-progress"]) == 0
    result = json.loads((out / "metrics.json").read_text())
    for name in MODELS:
        for key in ("bag_auc", "bag_accuracy", "instance_auc", "ece"):
            assert key in result[name], (name, key)
        assert 0.0 <= result[name]["bag_accuracy"] <= 1.0
    assert result["run"]["quick"] is True and result["run"]["wall_time_s"] > 0
    for png in ("calibration.png", "attcnn_scan_0.png", "gp_two_stage_scan_0.png", "gp_end_to_end_calibration.png",
                "attcnn_training_curves.png"):
        assert (out / png).stat().st_size > 1000, png
    assert (out / "features.npz").is_file()
