"""Each module runs fit/test (and AttCNN predict) through ``milgp-train`` on tiny synthetic data."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lightning_modules.cli import main, run_cli
from lightning_modules.features import FeatureTable, load_features, save_features
from lm_helpers import feature_bags, report, trainer_cfg, write_config

SMALL_CNN = {"class_path": "lightning_modules.SmallCNN", "init_args": {"feature_dim": 8, "widths": [4, 8]}}
REQUIRED = ("bag_auc", "bag_accuracy", "bag_f1", "bag_ece", "bag_nll")


def test_attcnn_fit_test_predict_through_cli(tiny_cache: str, tmp_path: Path) -> None:
    """AttCNN fit → test → predict via the CLI on a real (synthetic DICOM) cache.

    If this fails, the `milgp-train` entry point, the CT data module or the attention module is
    broken end to end: no metrics JSON/plots after test, or no feature file after predict.
    """
    cfg = {
        "seed_everything": 0,
        "trainer": trainer_cfg(tmp_path, "attcnn"),
        "model": {"class_path": "lightning_modules.AttentionMILModule", "init_args": {"extractor": SMALL_CNN, "attention_dim": 8}},
        "data": {"class_path": "lightning_modules.CTCacheDataModule", "init_args": {"cache_dir": tiny_cache, "batch_size": 3}},
    }
    path = write_config(tmp_path / "attcnn.yaml", cfg)
    cli = run_cli(["fit", "--config", path])
    run = tmp_path / "attcnn"
    assert (run / "checkpoints" / "last.ckpt").is_file() and cli.trainer.current_epoch == 1
    run_cli(["test", "--config", path, "--ckpt_path", "last"])
    m = report(run)["metrics"]
    for k in REQUIRED + ("instance_auc",):
        assert k in m
    assert 0.0 <= m["bag_accuracy"] <= 1.0
    assert (run / "test" / "version_0" / "calibration.png").stat().st_size > 1000
    assert list((run / "test" / "version_0" / "scans").glob("*.png"))
    assert (run / "fit" / "version_0" / "training_curves.png").is_file()
    extract = write_config(tmp_path / "extract.yaml", {
        "trainer": {"callbacks": [{"class_path": "lightning_modules.FeatureWriter", "init_args": {"output_path": str(tmp_path / "f.npz")}}]},
        "data": {"init_args": {"predict_split": "all"}},
    })
    run_cli(["predict", "--config", path, "--config", extract, "--ckpt_path", "last"])
    table = load_features(tmp_path / "f.npz")
    assert table.num_bags == 12 and table.feature_dim == 8
    assert set(table.splits) == {"train", "val", "test"}
    assert not np.isnan(table.instance_labels).any()  # RSNA has slice labels


def test_print_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--print_config` prints the full resolved YAML (class_path/init_args) and exits 0.

    If this fails, the CLI cannot introspect the modules' typed __init__ signatures."""
    save_features(tmp_path / "x.npz", FeatureTable.from_bags([np.zeros((2, 4))], ["a"], [0.0]))
    cfg = {"trainer": {"default_root_dir": str(tmp_path / "run")},
           "model": {"class_path": "lightning_modules.GPMILModule", "init_args": {"feature_dim": 4}},
           "data": {"class_path": "lightning_modules.FeatureDataModule", "init_args": {"path": str(tmp_path / "x.npz")}}}
    path = write_config(tmp_path / "c.yaml", cfg)
    with pytest.raises(SystemExit) as err:
        run_cli(["fit", "--config", path, "--print_config"])
    assert err.value.code in (0, None)
    out = capsys.readouterr().out
    assert "lightning_modules.GPMILModule" in out and "num_inducing" in out
    assert "monitor: val/bag_nll" in out  # model selection by a proper score
    assert not (tmp_path / "run").exists()


def test_gp_two_stage_through_cli(tmp_path: Path) -> None:
    """Two-stage GP on a feature file: fit (full-batch natural updates) then test via the CLI.

    The features are strongly informative, so a working GP head separates the test bags; a low
    AUC means the natural step, the locals or the predictions are wrong."""
    data = feature_bags(num_bags=30, dim=4, seed=1)
    table = FeatureTable.from_bags(data["bags"], [f"b{i:02d}" for i in range(30)], data["bag_labels"], data["instance_labels"])
    save_features(tmp_path / "feat.csv", table)  # CSV this time; patient split made by the data module
    cfg = {
        "seed_everything": 0,
        "trainer": trainer_cfg(tmp_path, "gp2", max_epochs=8),
        "model": {"class_path": "lightning_modules.GPMILModule",
                  "init_args": {"mode": "two_stage", "feature_dim": 4, "num_inducing": 12, "warmup_epochs": 2}},
        "data": {"class_path": "lightning_modules.FeatureDataModule", "init_args": {"path": str(tmp_path / "feat.csv")}},
    }
    path = write_config(tmp_path / "gp2.yaml", cfg)
    run_cli(["fit", "--config", path])
    run_cli(["test", "--config", path, "--ckpt_path", "last"])
    m = report(tmp_path / "gp2")["metrics"]
    assert m["bag_auc"] >= 0.8, m
    assert m["instance_auc"] >= 0.8, m
    preds = json.loads((tmp_path / "gp2" / "test" / "version_0" / "predictions.json").read_text())
    assert all(0 <= p["bag_prob"] <= 1 and p["bag_std"] >= 0 for p in preds)


def test_gp_end_to_end_through_cli_with_gamma_psi(tiny_cache: str, tmp_path: Path) -> None:
    """End-to-end CNN + G-VGPMIL (likelihood chosen by class_path) fit/test through the CLI.

    If this fails, the likelihood cannot be configured from YAML or the joint training step
    (natural step + Adam through the ELBO) breaks on real CT batches."""
    lik = {"class_path": "milgp.likelihoods.MILBernoulliLikelihood",
           "init_args": {"psi": {"class_path": "milgp.likelihoods.GammaPsi", "init_args": {"alpha": 1.0, "beta": 4.0}}}}
    cfg = {
        "seed_everything": 0,
        "trainer": trainer_cfg(tmp_path, "e2e", max_epochs=1),
        "model": {"class_path": "lightning_modules.GPMILModule",
                  "init_args": {"mode": "end_to_end", "extractor": SMALL_CNN, "num_inducing": 8, "warmup_epochs": 0, "likelihood": lik}},
        "data": {"class_path": "lightning_modules.CTCacheDataModule", "init_args": {"cache_dir": tiny_cache, "batch_size": 3}},
    }
    path = write_config(tmp_path / "e2e.yaml", cfg)
    cli = run_cli(["fit", "--config", path])
    assert type(cli.model.gp.likelihood.psi).__name__ == "GammaPsi"
    run_cli(["test", "--config", path, "--ckpt_path", "last"])
    m = report(tmp_path / "e2e")["metrics"]
    for k in REQUIRED + ("instance_auc",):
        assert k in m
    assert list((tmp_path / "e2e" / "test" / "version_0" / "scans").glob("*.png"))


def test_a_checkpoint_of_another_model_than_the_configs_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`test` with an AttCNN config and a GP checkpoint, and a resumed `fit` whose config has the other
    GP mode, stop with exit status 2 and one line naming both models, before anything is written.
    If this fails, Lightning builds the checkpoint's model in place of the config's without a word:
    a GP report filed under the AttCNN's name, or the run resumed as the checkpoint's model on the
    config's data."""
    bags = feature_bags(num_bags=12)
    save_features(tmp_path / "f.npz", FeatureTable.from_bags(bags["bags"], [f"b{i:02d}" for i in range(12)], bags["bag_labels"],
                                                            bags["instance_labels"]))
    data = {"class_path": "lightning_modules.FeatureDataModule", "init_args": {"path": str(tmp_path / "f.npz")}}
    gp = {"class_path": "lightning_modules.GPMILModule", "init_args": {"feature_dim": 4, "num_inducing": 4, "warmup_epochs": 0}}
    assert main(["fit", "--config", write_config(tmp_path / "gp.yaml", {"trainer": trainer_cfg(tmp_path, "gp"), "model": gp, "data": data})]) == 0
    capsys.readouterr()
    ckpt = str(tmp_path / "gp" / "checkpoints" / "last.ckpt")
    att = write_config(tmp_path / "att.yaml", {"trainer": trainer_cfg(tmp_path, "att"), "data": data,
                                               "model": {"class_path": "lightning_modules.AttentionMILModule"}})
    assert main(["test", "--config", att, "--ckpt_path", ckpt]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the checkpoint's model is GPMILModule, the config's is AttentionMILModule" in err, err
    assert not (tmp_path / "att").exists()
    e2e = {"class_path": "lightning_modules.GPMILModule",
           "init_args": {"mode": "end_to_end", "extractor": {"class_path": "lightning_modules.SmallCNN", "init_args": {"feature_dim": 4}}}}
    resume = write_config(tmp_path / "e2e.yaml", {"trainer": trainer_cfg(tmp_path, "gp", max_epochs=3), "model": e2e, "data": data})
    assert main(["fit", "--config", resume, "--ckpt_path", "last"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model is GPMILModule (mode two_stage), the config's is GPMILModule (mode end_to_end)" in err, err
    assert sorted(p.name for p in (tmp_path / "gp" / "fit").iterdir()) == ["version_0"]
