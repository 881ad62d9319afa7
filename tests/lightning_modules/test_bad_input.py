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


def test_a_float64_feature_beyond_float32_is_one_line_naming_file_bag_and_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`milgp-train fit` on a float64 .npz holding 1e40 stops with exit status 2 and one line naming
    the file, the bag and the field. It ended in a CholeskyError traceback."""
    bags = feature_bags(num_bags=12)
    _save(tmp_path, "f.npz", bags)
    arrays = dict(np.load(tmp_path / "f.npz"))
    arrays["features"] = arrays["features"].astype(np.float64)
    arrays["features"][7, 1] = 1e40
    np.savez(tmp_path / "f.npz", **arrays)
    status, err = _fit_status(tmp_path, "f.npz", capsys)
    assert status == 2 and len(err.splitlines()) == 1, err
    assert str(tmp_path / "f.npz") in err and "bag 'b" in err and "f1 = 1e+40 is beyond float32" in err


@pytest.mark.parametrize("fault", ["empty file", "float bag_index", "1-d features"])
def test_a_malformed_npz_is_one_line_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str], fault: str) -> None:
    """`milgp-train fit` on an empty .npz, one with a float bag_index or 1-d features stops with exit
    status 2 and one line naming the file and the array; each was a traceback (EOFError, TypeError,
    and for 1-d features a ValueError only once training had begun)."""
    _save(tmp_path, "f.npz", feature_bags(num_bags=12))
    arrays = dict(np.load(tmp_path / "f.npz"))
    if fault == "empty file":
        (tmp_path / "f.npz").write_bytes(b"")
    else:
        key = "bag_index" if fault == "float bag_index" else "features"
        arrays[key] = arrays[key].astype(np.float64) if key == "bag_index" else arrays[key].reshape(-1)
        np.savez(tmp_path / "f.npz", **arrays)
    status, err = _fit_status(tmp_path, "f.npz", capsys)
    assert status == 2 and len(err.splitlines()) == 1, err
    assert str(tmp_path / "f.npz") in err and ("empty file" if fault == "empty file" else f"array '{key}'") in err


def test_a_refused_command_leaves_no_new_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bad data found once the command runs leave the run folder as it was: a refused fit into a new
    folder leaves no folder, a refused `test` no `test/version_0` (the next real test is version_0),
    a refused `milgp-predict` no `predict/` nor a new `--out` folder. Before, the fit left
    `fit/version_0`, the test an empty `test/version_0` (the real one became version_1), the
    prediction an empty `predict/` or `--out DIR/predict/`."""
    from lightning_modules.predict import main as predict_main

    _save(tmp_path, "good.npz", feature_bags(num_bags=12))
    (tmp_path / "bad.npz").write_bytes(b"")
    assert _fit_status(tmp_path, "bad.npz", capsys, run="refused")[0] == 2
    assert not (tmp_path / "refused").exists()
    assert _fit_status(tmp_path, "good.npz", capsys)[0] == 0
    run = tmp_path / "run"
    before = sorted(run.rglob("*"))

    def test_status(data: str) -> int:
        cfg = {"trainer": trainer_cfg(tmp_path, "run"), "model": {"class_path": "lightning_modules.GPMILModule", "init_args": {"feature_dim": 4}},
               "data": {"class_path": "lightning_modules.FeatureDataModule", "init_args": {"path": str(tmp_path / data)}}}
        return main(["test", "--config", write_config(tmp_path / "t.yaml", cfg), "--ckpt_path", "best"])

    assert test_status("bad.npz") == 2
    assert predict_main([str(run / "checkpoints" / "best.ckpt"), str(tmp_path / "bad.npz"), "--no-plots"]) == 2
    assert predict_main([str(run / "checkpoints" / "best.ckpt"), str(tmp_path / "bad.npz"), "--no-plots", "--out", str(tmp_path / "out")]) == 2
    assert sorted(run.rglob("*")) == before and not (tmp_path / "out").exists()
    assert test_status("good.npz") == 0 and (run / "test" / "version_0" / "metrics.json").is_file()


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


@pytest.mark.parametrize("fault, message", [
    ("population 0", "bag 'v1' has weight/population 0.0"),
    ("population -3", "bag 'v1' has weight/population -3.0"),
    ("count -2", "bag 'v1' has count -2.0"),
])
def test_aggregate_targets_and_populations_of_every_split_are_checked_before_training(tmp_path: Path, fault: str, message: str) -> None:
    """Only the training bags' counts and populations were checked: a validation bag's population 0
    or −3 was predicted as if fine, and its count −2 made val/bag_nll NaN after a whole epoch, then a
    Lightning traceback and no checkpoint. Each must stop `fit` at setup in one line naming the bag."""
    from lightning_modules.input_error import InputError
    from milgp.likelihoods import PoissonAggregateLikelihood
    import pytorch_lightning as pl

    rng = np.random.default_rng(0)
    bags = [np.column_stack([rng.normal(size=(4, 2)), np.ones(4)]) for _ in range(10)]
    counts = [float(rng.poisson(4.0)) for _ in range(10)]
    ids = [f"t{i}" for i in range(8)] + ["v0", "v1"]
    if fault.startswith("population"):
        bags[9][2, 2] = float(fault.split()[1])
    else:
        counts[9] = float(fault.split()[1])
    dm = BagArrayDataModule(bags, counts, bag_ids=ids, splits=["train"] * 8 + ["val"] * 2)
    model = GPMILModule(feature_dim=3, population_column=-1, likelihood=PoissonAggregateLikelihood("exp"), num_inducing=4)
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, default_root_dir=str(tmp_path))
    with pytest.raises(InputError, match=f"in-memory bags: {message}"):
        trainer.fit(model, dm)
    assert trainer.global_step == 0


def test_split_names_and_instance_labels_are_checked_at_setup(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A misspelt split (`Train`) left its bags out of training without a word, and an instance label
    2 crashed after a whole epoch naming its position among all instances: each must be one line
    naming the file and the bag at setup. Bags without a split beside bags with one are announced."""
    bags = feature_bags(num_bags=12)
    ids = [f"b{i:02d}" for i in range(12)]
    splits = ["train"] * 8 + ["val"] * 4
    save_features(tmp_path / "typo.npz", FeatureTable.from_bags(bags["bags"], ids, bags["bag_labels"], bags["instance_labels"],
                                                                splits=["Train" if i == 3 else s for i, s in enumerate(splits)]))
    status, err = _fit_status(tmp_path, "typo.npz", capsys, run="typo")
    assert status == 2 and len(err.splitlines()) == 1 and "bag 'b03' has split 'Train'" in err and "did you mean 'train'" in err
    labels = [y.copy() for y in bags["instance_labels"]]
    labels[5][1] = 2.0
    save_features(tmp_path / "inst.npz", FeatureTable.from_bags(bags["bags"], ids, bags["bag_labels"], labels, splits=splits))
    status, err = _fit_status(tmp_path, "inst.npz", capsys, run="inst")
    assert status == 2 and len(err.splitlines()) == 1 and "bag 'b05', slice 1 has instance label 2" in err
    with pytest.warns(UserWarning, match="2 bags have no split while the others do"):
        BagArrayDataModule(bags["bags"], bags["bag_labels"], splits=["train"] * 6 + ["val"] * 4 + ["", ""])


@pytest.mark.parametrize("setting, message", [
    ({"model": {"num_inducing": 0}}, "num_inducing must be at least 1, got 0"),
    ({"model": {"hyper_steps": -2}}, "hyper_steps must be at least 0, got -2"),
    ({"model": {"warmup_epochs": -1}}, "warmup_epochs must be at least 0, got -1"),
    ({"model": {"lr_gp": float("nan")}}, "lr_gp must be a finite number > 0"),
    ({"model": {"bag_rule": "orthant"}}, "bag_rule 'orthant' is the MIL probit model's"),
    ({"data": {"batch_size": 0}}, "batch_size must be at least 1"),
])
def test_settings_out_of_range_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], setting: dict, message: str) -> None:
    """Each of these was a traceback (a sampler's, k-means', a Cholesky failure an epoch later, the
    orthant rule's at the first validation, with a bare version folder left) or was accepted and
    silently never learned the kernel (negative hyper_steps)."""
    _save(tmp_path, "f.npz", feature_bags(num_bags=12))
    cfg = {"trainer": trainer_cfg(tmp_path, "run"),
           "model": {"class_path": "lightning_modules.GPMILModule", "init_args": {"feature_dim": 4, **setting.get("model", {})}},
           "data": {"class_path": "lightning_modules.FeatureDataModule", "init_args": {"path": str(tmp_path / "f.npz"), **setting.get("data", {})}}}
    assert main(["fit", "--config", write_config(tmp_path / "c.yaml", cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("setting, message", [
    ({"H": -5}, "H must be a finite number > 1 (bag labels more likely right than wrong), got -5.0"),
    ({"psi": "bogus"}, "unknown psi 'bogus'"),
])
def test_a_nested_constructor_check_is_reported_with_its_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                setting: dict, message: str) -> None:
    """The likelihood's own check (a class argument inside the model) is the one line printed. If
    this fails, the user gets jsonargparse's "Does not validate against any of the Union subtypes"
    and no word of which value is wrong (the reason sits one level deeper in its error text)."""
    _save(tmp_path, "f.npz", feature_bags(num_bags=12))
    likelihood = {"class_path": "milgp.likelihoods.MILBernoulliLikelihood", "init_args": {"psi": "pg", "H": 100.0, **setting}}
    cfg = {"trainer": trainer_cfg(tmp_path, "run"),
           "model": {"class_path": "lightning_modules.GPMILModule", "init_args": {"feature_dim": 4, "likelihood": likelihood}},
           "data": {"class_path": "lightning_modules.FeatureDataModule", "init_args": {"path": str(tmp_path / "f.npz")}}}
    assert main(["fit", "--config", write_config(tmp_path / "c.yaml", cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("dim", [4, 32])
def test_a_feature_only_model_given_ct_slices_is_one_line(tiny_cache: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], dim: int) -> None:
    """A GP trained on feature files (no extractor) tested on a CT cache stops with exit status 2 and
    one line naming the cache and saying the model takes feature files only. If this fails, the
    32×32 slices were read as 32 features per instance: a message about feature widths (dim 4) or,
    when the widths coincide (dim 32), a RuntimeError traceback from the GP's solver."""
    _save(tmp_path, "f.npz", feature_bags(num_bags=12, dim=dim))
    model = {"class_path": "lightning_modules.GPMILModule", "init_args": {"feature_dim": dim, "num_inducing": 4, "warmup_epochs": 0}}
    fit = {"trainer": trainer_cfg(tmp_path, "run"), "model": model,
           "data": {"class_path": "lightning_modules.FeatureDataModule", "init_args": {"path": str(tmp_path / "f.npz")}}}
    assert main(["fit", "--config", write_config(tmp_path / "fit.yaml", fit)]) == 0
    capsys.readouterr()
    test = {**fit, "data": {"class_path": "lightning_modules.CTCacheDataModule", "init_args": {"cache_dir": tiny_cache, "test_split": "all"}}}
    assert main(["test", "--config", write_config(tmp_path / "test.yaml", test), "--ckpt_path", "last"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{tiny_cache}: the inputs are slices" in err and "takes feature files only" in err, err
