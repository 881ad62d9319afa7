"""One run folder: every output under trainer.default_root_dir, versioned per subcommand, never mixed."""
from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from lightning_modules.cli import main, run_cli
from lightning_modules.features import FeatureTable, save_features
from lightning_modules.input_error import InputError
from lm_helpers import feature_bags, report, trainer_cfg, write_config


def _gp_config(tmp_path: Path, name: str = "gp", epochs: int = 3, data: str = "feat.npz", seed: int = 1) -> str:
    """A two-stage GP config on a feature file (written once per data name)."""
    if not (tmp_path / data).exists():
        bags = feature_bags(num_bags=30, dim=4, seed=seed)
        save_features(tmp_path / data, FeatureTable.from_bags(bags["bags"], [f"b{i:02d}" for i in range(30)], bags["bag_labels"],
                                                              bags["instance_labels"]))
    cfg = {"seed_everything": 0, "trainer": trainer_cfg(tmp_path, name, max_epochs=epochs),
           "model": {"class_path": "lightning_modules.GPMILModule", "init_args": {"feature_dim": 4, "num_inducing": 8, "warmup_epochs": 1}},
           "data": {"class_path": "lightning_modules.FeatureDataModule", "init_args": {"path": str(tmp_path / data)}}}
    return write_config(tmp_path / f"{name}.yaml", cfg)


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_each_subcommand_writes_its_own_versioned_logs(tmp_path: Path) -> None:
    """fit, test, predict, a second test and validate each write their own version folder, and none
    touches another's: the fit's metrics.csv keeps every training epoch after the others ran.

    On the shipped configs every subcommand logged to one pinned `logs/fit` folder: a test replaced
    the fit's metrics.csv by one test row and predict deleted it."""
    path = _gp_config(tmp_path)
    run = tmp_path / "gp"
    run_cli(["fit", "--config", path])
    fit_log = run / "fit" / "version_0" / "metrics.csv"
    before = fit_log.read_text()
    assert {int(r["epoch"]) for r in _rows(fit_log)} == {0, 1, 2}
    run_cli(["test", "--config", path, "--ckpt_path", "best"])
    run_cli(["predict", "--config", path, "--ckpt_path", "best"])
    run_cli(["test", "--config", path, "--ckpt_path", "last"])
    run_cli(["validate", "--config", path, "--ckpt_path", "best"])
    assert fit_log.read_text() == before
    assert report(run, "validate")["data"]["split"] == "val" and (run / "validate" / "version_0" / "predictions.csv").is_file()
    assert (run / "test" / "version_0" / "metrics.csv").is_file() and (run / "test" / "version_1" / "metrics.csv").is_file()
    assert (run / "predict" / "version_0" / "predictions.csv").is_file()
    assert report(run, version=0)["checkpoint"].endswith("best.ckpt") and report(run, version=1)["checkpoint"].endswith("last.ckpt")


def test_resumed_fit_continues_its_history(tmp_path: Path) -> None:
    """A fit resumed from the folder's last.ckpt writes a new fit version whose metrics.csv holds
    the earlier epochs followed by the new ones (the training-curve plot shows the whole run), and
    the earlier version is left as it was.

    Resuming into the pinned `logs/fit` folder kept only the epochs after the checkpoint."""
    path = _gp_config(tmp_path, epochs=2)
    run = tmp_path / "gp"
    run_cli(["fit", "--config", path])
    first = (run / "fit" / "version_0" / "metrics.csv").read_text()
    run_cli(["fit", "--config", path, "--ckpt_path", "last", "--trainer.max_epochs", "4"])
    assert (run / "fit" / "version_0" / "metrics.csv").read_text() == first
    epochs = [int(r["epoch"]) for r in _rows(run / "fit" / "version_1" / "metrics.csv")]
    assert sorted(set(epochs)) == [0, 1, 2, 3] and epochs == sorted(epochs)
    assert (run / "fit" / "version_1" / "training_curves.png").is_file()
    # no more epochs than the checkpoint has: one line, before a fit/version_2 with a copied history is made
    for epochs in ("3", "4"):
        with pytest.raises(InputError, match=f"--trainer.max_epochs {epochs}: .*last.ckpt has trained 4 epochs already"):
            run_cli(["fit", "--config", path, "--ckpt_path", "last", "--trainer.max_epochs", epochs])
    assert not (run / "fit" / "version_2").exists()


def test_every_output_lies_under_the_run_folder_and_folders_are_never_mixed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With only trainer.default_root_dir set, checkpoints, logs and reports all land under it; a
    second fit into the same folder is refused with one line (it would have left last.ckpt of the
    first run beside last-v1.ckpt of the second), a fit from another run's checkpoint into it too,
    and a resumed fit keeps exactly best.ckpt and last.ckpt.

    The shipped configs hard-coded five or six paths each and ignored --trainer.default_root_dir."""
    path = _gp_config(tmp_path)
    run_cli(["fit", "--config", path, "--trainer.default_root_dir", str(tmp_path / "elsewhere")])
    run_cli(["test", "--config", path, "--trainer.default_root_dir", str(tmp_path / "elsewhere"), "--ckpt_path", "best"])
    assert not (tmp_path / "gp").exists()
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["checkpoints", "fit", "test"]
    assert main(["fit", "--config", path, "--trainer.default_root_dir", str(tmp_path / "elsewhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds a fit already" in err and "--ckpt_path last" in err
    run_cli(["fit", "--config", _gp_config(tmp_path, name="other", epochs=1)])
    with pytest.raises(InputError, match="mix two runs"):
        run_cli(["fit", "--config", path, "--trainer.default_root_dir", str(tmp_path / "elsewhere"),
                 "--ckpt_path", str(tmp_path / "other" / "checkpoints" / "last.ckpt")])
    run_cli(["fit", "--config", path, "--trainer.default_root_dir", str(tmp_path / "elsewhere"), "--ckpt_path", "last",
             "--trainer.max_epochs", "5"])
    assert sorted(p.name for p in (tmp_path / "elsewhere" / "checkpoints").iterdir()) == ["best.ckpt", "last.ckpt"]


@pytest.mark.parametrize("subcommand", ["test", "validate", "predict"])
def test_evaluating_without_a_checkpoint_is_refused(tmp_path: Path, subcommand: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`milgp-train test` (validate, predict) without --ckpt_path evaluated the config's untrained
    model (bag NLL ln 2, AUC 0.5, the GP head never set up) and wrote that report beside the run's
    checkpoints with exit status 0; it must be one line naming the checkpoints to give, and write nothing."""
    path = _gp_config(tmp_path, epochs=1)
    run_cli(["fit", "--config", path])
    assert main([subcommand, "--config", path]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "untrained model" in err and "--ckpt_path best|last" in err
    assert not (tmp_path / "gp" / subcommand).exists()


def test_reports_name_model_checkpoint_and_data(tmp_path: Path) -> None:
    """Two models tested on the same external data write two reports, each in its own run folder,
    each naming its model, its checkpoint and the data it was computed on.

    With `cq500_test.yaml` both wrote one `cq500_metrics.json` that recorded `model: cq500`."""
    external = write_config(tmp_path / "external.yaml", {"data": {"init_args": {"path": str(tmp_path / "ext.npz"), "predict_split": "all"}}})
    for name, seed in (("a", 1), ("b", 2)):
        path = _gp_config(tmp_path, name=name, data=f"{name}.npz", seed=seed)
        run_cli(["fit", "--config", path])
        _gp_config(tmp_path, name="unused", data="ext.npz", seed=3)
        run_cli(["test", "--config", path, "--config", external, "--ckpt_path", "best"])
    for name in ("a", "b"):
        r = report(tmp_path / name)
        assert r["checkpoint"] == str(tmp_path / name / "checkpoints" / "best.ckpt")
        assert r["data"]["path"] == str(tmp_path / "ext.npz") and r["data"]["split"] == "test"
        assert r["model"]["class"].endswith("GPMILModule") and r["model"]["bag_decision"]["bag_rule"] in ("max", "top_k_mean", "mean")
    assert report(tmp_path / "a")["metrics"] != report(tmp_path / "b")["metrics"]


def test_commands_running_at_once_get_their_own_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two commands started together into one run folder (parallel `milgp-predict` jobs, two fits)
    each get their own version folder, made when claimed; and a version made by another job between
    listing the folder and creating it is skipped, not shared.

    Before, each picked max(versions) + 1 when its logger was built and made the folder later: both
    wrote into `predict/version_0`, the last job's files replacing the others', and every job said it
    had succeeded (or a fit stopped in Lightning's SaveConfigCallback)."""
    from lightning_modules.run_folder import RunFolder

    folder = RunFolder(tmp_path / "run")
    first, second = folder.logger("predict"), folder.logger("predict")
    assert Path(first.log_dir) != Path(second.log_dir)
    assert Path(first.log_dir).is_dir() and Path(second.log_dir).is_dir()
    monkeypatch.setattr(RunFolder, "versions", lambda self, subcommand: [])  # a listing made before the others claimed
    assert Path(folder.logger("predict").log_dir).name == "version_2"


@pytest.mark.parametrize("where", ["predict", "run"])
def test_a_file_where_the_run_needs_a_folder_is_one_line(tmp_path: Path, where: str) -> None:
    """A file named like the subcommand's folder (`<run>/predict`), or a run folder that is a file
    below `--out`: one InputError naming the file. Before, `claim_version` took mkdir's
    FileExistsError for a taken version and counted up for ever at 100 % CPU (milgp-predict and
    milgp-train test hung), and a file higher up gave a NotADirectoryError traceback."""
    from lightning_modules.input_error import InputError
    from lightning_modules.run_folder import RunFolder

    (tmp_path / "run").mkdir()
    blocker = tmp_path / "run" / "predict" if where == "predict" else tmp_path / "run" / "sub"
    blocker.write_text("not a folder")
    root = tmp_path / "run" if where == "predict" else blocker / "deeper"
    with pytest.raises(InputError, match=rf"^{re.escape(str(blocker))} is a file, not a folder"):
        RunFolder(root).claim_version("predict")
    assert blocker.read_text() == "not a folder"


def test_a_refused_resume_leaves_no_version_with_its_copied_history(tmp_path: Path) -> None:
    """A resume refused over its data (a cache with other windows) fails after the logger copied the
    earlier metrics.csv into the new version: that version must go, as a refused fit's does, so
    the next resume is not `version_2` continuing a copy. A version with a row of its own stays."""
    from lightning_modules.run_folder import RunFolder

    folder = RunFolder(tmp_path / "run")
    history = tmp_path / "metrics.csv"
    history.write_text("epoch,step,train/loss\n0,3,0.5\n1,7,0.4\n")
    logger = folder.logger("fit", history, until_epoch=1)
    (Path(logger.log_dir) / "config.yaml").write_text("model: {}\n")
    assert (Path(logger.experiment.metrics_file_path)).read_text().count("\n") == 3
    logger.discard_unwritten()
    assert not (tmp_path / "run").exists()
    kept = folder.logger("fit", history, until_epoch=1)
    kept.log_metrics({"train/loss": 0.3}, step=11)
    kept.save()
    kept.discard_unwritten()
    assert (Path(kept.log_dir) / "metrics.csv").is_file()
