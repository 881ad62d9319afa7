"""The demo (`make demo` = `python -m lightning_modules.demo`) in its quick mode, and the library's independence of Lightning."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_library_never_imports_lightning() -> None:
    """Importing every module of `milgp` leaves Lightning unimported: the demo, which drives the
    Lightning CLI, lives in `lightning_modules` (it was `milgp.demo`)."""
    code = ("import importlib, pkgutil, sys, milgp\n"
            "for m in pkgutil.walk_packages(milgp.__path__, 'milgp.'):\n"
            "    importlib.import_module(m.name)\n"
            "print(sorted(k for k in sys.modules if k.split('.')[0] in ('pytorch_lightning', 'lightning', 'lightning_modules')))")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow
def test_quick_demo_tests_both_sets_and_compares_the_bag_rules(tmp_path: Path) -> None:
    """The demo (synthetic DICOM → cache → AttCNN → features → two-stage GP → end-to-end GP →
    milgp-predict on new DICOM) runs with tiny data and writes, for each model, the metrics of the
    internal test set and of the external thin-slice set (scans re-sliced more finely than the
    training scans), the paper's noisy-OR beside the calibrated default on the same posterior, the
    plots, and every model's run folder; it never writes into a folder that is not empty.

    The earlier demo had one test set of 6–10-slice scans on which every model scored AUC 1.000."""
    from lightning_modules.demo import GP_MODELS, MODELS, QUICK, TEST_SETS, main

    out = tmp_path / "demo"
    assert main(["--out", str(out), "--quick"]) == 0
    result = json.loads((out / "metrics.json").read_text())
    for test_set in TEST_SETS:
        for name in MODELS:
            for key in ("bag_auc", "bag_accuracy", "bag_ece", "bag_nll", "instance_auc"):
                assert key in result[test_set][name], (test_set, name, key)
            assert Path(result[test_set][name]["report"]).is_dir()
    for name in GP_MODELS:
        rules = result["bag_rule_comparison"][name]["external_thin"]
        assert set(rules) == {"noisy_or (paper)", "calibrated default"}
        assert all(0 <= r["negatives_called_positive"] <= r["negatives"] for r in rules.values())
    data = result["run"]["data"]
    assert data["external_thin"]["slices"] >= QUICK.slice_factor * QUICK.slices[0] * data["external_thin"]["scans"]
    assert result["run"]["quick"] is True and result["run"]["wall_time_s"] > 0
    for png in ("calibration_internal.png", "calibration_external_thin.png", "bag_rules_external_thin.png"):
        assert (out / png).stat().st_size > 1000, png
    for name in MODELS:
        assert (out / name / "checkpoints" / "best.ckpt").is_file()
    assert (Path(result["predictions_new_dicom"]) / "predictions.csv").is_file()
    assert main(["--out", str(out), "--quick"]) == 2
