"""Bad input in the Lightning path: one line naming the file, bag and field, before any heavy work."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_modules import BagArrayDataModule, GPMILModule
from lightning_modules.cli import main
from lightning_modules.features import FeatureTable, save_features
from lm_helpers import feature_bags, trainer_cfg, write_config


def _fit_status(tmp_path: Path, feature_file: str, capsys: pytest.CaptureFixture[str], run: str = "run") -> tuple[int, str]:
    cfg = {"trainer": trainer_cfg(tmp_path, run), "model": {"class_path": "lightning_modules.GPMILModule", "init_args": {"feature_dim": 4}},
           "data": {"class_path": "lightning_modules.FeatureDataModule", "init_args": {"path": str(tmp_path / feature_file)}}}
    status = main(["fit", "--config", write_config(tmp_path / "c.yaml", cfg)])
    return status, capsys.readouterr().err.strip()


def _save(tmp_path: Path, name: str, bags: dict, labels: list[float] | None = None) -> None:
    save_features(tmp_path / name, FeatureTable.from_bags(bags["bags"], [f"b{i:02d}" for i in range(len(bags["bags"]))],
                                                          labels or bags["bag_labels"], bags["instance_labels"]))


def test_nan_feature_is_one_line_naming_file_bag_and_field_before_kmeans(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN in features.npz stops `milgp-train fit` with exit status 2 and one line naming the file,
    the bag and the feature column, before the inducing points are placed.

    Today's code failed inside scikit-learn's k-means ("Input contains NaN") with no file or bag named."""
    import lightning_modules.gp_head as gp_head

    monkeypatch.setattr(gp_head, "kmeans_pp_inducing", lambda *a, **k: pytest.fail("k-means ran on bad data"))
    bags = feature_bags(num_bags=12)
    bags["bags"][5][1, 3] = np.nan
    _save(tmp_path, "f.npz", bags)
    status, err = _fit_status(tmp_path, "f.npz", capsys)
    assert status == 2 and len(err.splitlines()) == 1
    assert str(tmp_path / "f.npz") in err and "'b05'" in err and "f3" in err


def test_bag_label_outside_zero_one_is_refused_naming_bag_and_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A MIL bag label 2.0 is refused with the bag and the file named (it trained silently)."""
    bags = feature_bags(num_bags=12)
    _save(tmp_path, "f.csv", bags, labels=[2.0 if i == 7 else y for i, y in enumerate(bags["bag_labels"])])
    status, err = _fit_status(tmp_path, "f.csv", capsys)
    assert status == 2 and len(err.splitlines()) == 1 and "'b07'" in err and "label 2" in err and "f.csv" in err


def test_missing_feature_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing features file is one line on stderr, not jsonargparse's 84-line traceback."""
    status, err = _fit_status(tmp_path, "missing.npz", capsys)
    assert status == 2 and err == f"milgp-train: error: {tmp_path / 'missing.npz'}: no such feature file"


def test_run_folder_is_checked_before_the_data_are_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Arguments are checked before heavy work: a fit refused by its run folder says so before the
    (here broken) data are read, and a --ckpt_path that does not exist is named at once."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "last.ckpt").write_bytes(b"")
    bags = feature_bags(num_bags=12)
    bags["bags"][0][0, 0] = np.inf
    _save(tmp_path, "bad.npz", bags)
    status, err = _fit_status(tmp_path, "bad.npz", capsys)
    assert status == 2 and "holds a fit already" in err
    cfg = {"trainer": trainer_cfg(tmp_path, "fresh"), "model": {"class_path": "lightning_modules.GPMILModule", "init_args": {"feature_dim": 4}},
           "data": {"class_path": "lightning_modules.FeatureDataModule", "init_args": {"path": str(tmp_path / "bad.npz")}}}
    assert main(["test", "--config", write_config(tmp_path / "t.yaml", cfg), "--ckpt_path", "best"]) == 2
    assert "no checkpoint at" in capsys.readouterr().err


def test_non_finite_validation_prediction_raises_naming_the_bag() -> None:
    """A NaN bag probability in validation stops the run naming the bag; it was logged as metric 0.0
    (and a checkpoint monitor could then prefer it)."""
    data = feature_bags(num_bags=8)
    dm = BagArrayDataModule(**data, splits=["train"] * 6 + ["val"] * 2)
    dm.setup("validate")
    batch = next(iter(dm.val_dataloader()))
    model = GPMILModule(feature_dim=4, num_inducing=4)
    model._val_records = model.make_records(batch, torch.tensor([0.3, float("nan")]), None, torch.full((batch.num_instances,), 0.1), None)
    with pytest.raises(ValueError, match="validation bag 'bag_7'.*non-finite"):
        model.on_validation_epoch_end()


def test_two_bags_with_one_id_are_refused_naming_the_id() -> None:
    """In-memory bags given one id twice must stop before training: the split, the reports and the
    GP's per-bag locals are keyed by the id, so the two bags would share them."""
    from lightning_modules.input_error import InputError

    data = feature_bags(num_bags=8)
    dm = BagArrayDataModule(**data, bag_ids=[f"s{i}" for i in range(7)] + ["s3"], splits=["train"] * 6 + ["val"] * 2)
    with pytest.raises(InputError, match=r"in-memory bags: bag id 's3' is given to more than one bag"):
        dm.setup("fit")
