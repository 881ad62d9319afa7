"""Predictions for new, unlabelled scans: per scan and per slice, CSV + JSON + one PNG per scan."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.encaps import encapsulate
from pydicom.uid import JPEGLSLossless

from lightning_modules.cli import run_cli
from lightning_modules.predict import main as predict_main
from milgp.ct.dataset import uniform_subsample
from milgp.ct.synthetic import write_rsna_dataset
from lm_helpers import trainer_cfg, write_config

SMALL_CNN = {"class_path": "lightning_modules.SmallCNN", "init_args": {"feature_dim": 6, "widths": [4, 8]}}


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture(scope="module")
def gp_run(tiny_cache: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An end-to-end GP fitted for one epoch on the tiny CT cache through milgp-train."""
    root = tmp_path_factory.mktemp("gp_run")
    cfg = {"seed_everything": 0, "trainer": trainer_cfg(root, "run", max_epochs=1),
           "model": {"class_path": "lightning_modules.GPMILModule",
                     "init_args": {"mode": "end_to_end", "extractor": SMALL_CNN, "num_inducing": 4, "warmup_epochs": 0}},
           "data": {"class_path": "lightning_modules.CTCacheDataModule", "init_args": {"cache_dir": tiny_cache, "batch_size": 3}}}
    run_cli(["fit", "--config", write_config(root / "gp.yaml", cfg)])
    return root / "run"


def test_milgp_train_predict_writes_scan_and_slice_predictions(gp_run: Path) -> None:
    """`milgp-train predict` on a GP model writes, in its own version folder, one row per scan
    (probability ± std, decision at ½) and one per slice in scan order, JSON and one PNG per scan.

    It ran with a progress bar and wrote nothing."""
    run_cli(["predict", "--config", str(gp_run.parent / "gp.yaml"), "--ckpt_path", "last", "--data.init_args.predict_split", "test"])
    out = gp_run / "predict" / "version_0"
    scans = _rows(out / "predictions.csv")
    assert scans and set(scans[0]) == {"bag_id", "num_slices", "probability", "std", "decision", "bag_label", "outside_training"}
    for s in scans:
        assert 0 <= float(s["probability"]) <= 1 and float(s["std"]) >= 0 and s["decision"] == str(int(float(s["probability"]) > 0.5))
    slices = _rows(out / "slices.csv")
    assert len(slices) == sum(int(s["num_slices"]) for s in scans)
    summary = json.loads((out / "predictions.json").read_text())
    assert summary["checkpoint"].endswith("last.ckpt") and summary["data"]["cache_dir"] and summary["threshold"] == 0.5
    assert len(list((out / "scans").glob("*.png"))) == len(scans)


def test_milgp_predict_on_new_dicom_from_the_checkpoint_alone(gp_run: Path, tmp_path: Path) -> None:
    """`milgp-predict CHECKPOINT DICOM_FOLDER` predicts new, unlabelled scans with nothing but the
    checkpoint (the CT windows and slice size of the training cache, the extractor and the bag
    decision come from it): per slice probabilities in geometric order with their positions in
    mm along the scan axis, into a new predict version of the checkpoint's run folder."""
    new = write_rsna_dataset(tmp_path / "new", n_scans=2, slices=(3, 4), size=48, seed=9, slice_factor=2)
    assert predict_main([str(gp_run / "checkpoints" / "best.ckpt"), new.image_dir, "--no-plots"]) == 0
    out = max((gp_run / "predict").iterdir())
    scans = {s["bag_id"]: s for s in _rows(out / "predictions.csv")}
    assert set(scans) == {s.series_uid for s in new.scans} and all(s["bag_label"] == "" for s in scans.values())
    slices = _rows(out / "slices.csv")
    for truth in new.scans:
        rows = [r for r in slices if r["bag_id"] == truth.series_uid]
        positions = [float(r["position"]) for r in rows]
        assert len(rows) == len(truth.paths) == int(scans[truth.series_uid]["num_slices"])
        np.testing.assert_allclose(positions, truth.z_mm, atol=1e-3)  # ascending, 2.5 mm apart: geometric order
    summary = json.loads((out / "predictions.json").read_text())
    assert summary["scans"][0]["position_axis"].startswith("position along the scan axis (mm)")
    assert summary["data"]["inputs"] == [new.image_dir] and summary["checkpoint"].endswith("best.ckpt")


def _undecodable(path: str) -> None:
    """Make a slice's pixel data undecodable (JPEG-LS junk): its header stays readable."""
    ds = pydicom.dcmread(path)
    ds.file_meta.TransferSyntaxUID = JPEGLSLossless
    ds.PixelData = encapsulate([b"\xff\xd8junk\xff\xd9"])
    ds["PixelData"].VR = "OB"
    ds.save_as(path)


@pytest.mark.parametrize("max_slices", [None, 3])
def test_milgp_predict_skips_what_cannot_be_decoded_and_places_the_slices_it_served(
    gp_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], max_slices: int | None
) -> None:
    """Pixels are read after the headers were checked, so an undecodable slice is found only then.
    A scan whose every slice is undecodable must be skipped and reported in one line, not abort the
    run; a scan with one undecodable slice is predicted without it, the slice named, and every served
    slice must carry its own position (with ``--max-slices`` too). Before, the first aborted the
    whole run with a traceback and the second dropped the slice silently and shifted the positions."""
    new = write_rsna_dataset(tmp_path / "new", n_scans=3, slices=(5, 5), size=32, seed=4)
    damaged, broken = new.scans[1], new.scans[2]
    _undecodable(damaged.paths[2])
    for p in broken.paths:
        _undecodable(p)
    capsys.readouterr()
    args = [str(gp_run / "checkpoints" / "best.ckpt"), new.image_dir, "--out", str(tmp_path / "out"), "--no-plots"]
    assert predict_main(args + ([] if max_slices is None else ["--max-slices", str(max_slices)])) == 0
    err = capsys.readouterr().err
    assert f"milgp: skipped {damaged.paths[2]}: " in err and "cannot be decoded" in err
    assert f"milgp: skipped series {broken.series_uid}:" in err and "every image failed to decode" in err
    out = tmp_path / "out" / "predict" / "version_0"
    assert {s["bag_id"] for s in _rows(out / "predictions.csv")} == {new.scans[0].series_uid, damaged.series_uid}
    served = [z for k, z in enumerate(damaged.z_mm) if k != 2]
    if max_slices is not None:
        served = [served[k] for k in uniform_subsample(len(served), max_slices)]
    positions = [float(r["position"]) for r in _rows(out / "slices.csv") if r["bag_id"] == damaged.series_uid]
    np.testing.assert_allclose(positions, served, atol=1e-3)


def test_milgp_predict_records_what_it_skipped(gp_run: Path, tmp_path: Path) -> None:
    """`predictions.json` lists every input left out, with its reason: a file that is not DICOM
    (found when the headers are read), a series none of whose slices decode and a slice that does
    not (found when the pixels are read); the series skipped is not listed among the data's series.
    Before, the skips went to stderr only and `data.series` named the skipped series as an input
    predicted, so the JSON alone could not tell that a scan was missing."""
    new = write_rsna_dataset(tmp_path / "new", n_scans=3, slices=(4, 4), size=32, seed=5)
    damaged, broken = new.scans[1], new.scans[2]
    _undecodable(damaged.paths[1])
    for p in broken.paths:
        _undecodable(p)
    notes = Path(new.image_dir) / "notes.txt"
    notes.write_text("not an image")
    args = [str(gp_run / "checkpoints" / "best.ckpt"), new.image_dir, "--out", str(tmp_path / "out"), "--no-plots"]
    assert predict_main(args) == 0
    summary = json.loads((tmp_path / "out" / "predict" / "version_0" / "predictions.json").read_text())
    skipped = {e["what"]: e["reason"] for e in summary["skipped"]}
    assert set(skipped) == {str(notes), f"series {broken.series_uid}", damaged.paths[1]}
    assert "every image failed to decode" in skipped[f"series {broken.series_uid}"] and "cannot be decoded" in skipped[damaged.paths[1]]
    assert set(summary["data"]["series"]) == {s["bag_id"] for s in summary["scans"]} == {new.scans[0].series_uid, damaged.series_uid}


def test_milgp_predict_on_a_cache_and_on_a_feature_file(gp_run: Path, tiny_cache: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same entry point serves a whole CT cache (slice positions: indices in the cached scan)
    and a feature file (its slice_index), each into a new version folder of --out; a feature file
    of another width is refused in one line naming it."""
    assert predict_main([str(gp_run / "checkpoints" / "last.ckpt"), tiny_cache, "--out", str(tmp_path / "cache_run"), "--no-plots"]) == 0
    scans = _rows(tmp_path / "cache_run" / "predict" / "version_0" / "predictions.csv")
    assert len(scans) == 12 and {s["bag_label"] for s in scans} <= {"0.0", "1.0"}
    from lightning_modules.features import FeatureTable, save_features
    from lm_helpers import feature_bags

    bags = feature_bags(num_bags=10, dim=4)
    save_features(tmp_path / "f.npz", FeatureTable.from_bags(bags["bags"], [f"b{i}" for i in range(10)], [float("nan")] * 10))
    cfg = {"trainer": trainer_cfg(tmp_path, "gp2", max_epochs=2),
           "model": {"class_path": "lightning_modules.GPMILModule", "init_args": {"feature_dim": 4, "num_inducing": 4}},
           "data": {"class_path": "lightning_modules.FeatureDataModule", "init_args": {"path": str(tmp_path / "train.npz")}}}
    train = feature_bags(num_bags=20, dim=4, seed=3)
    save_features(tmp_path / "train.npz", FeatureTable.from_bags(train["bags"], [f"t{i}" for i in range(20)], train["bag_labels"]))
    run_cli(["fit", "--config", write_config(tmp_path / "gp2.yaml", cfg)])
    assert predict_main([str(tmp_path / "gp2" / "checkpoints" / "last.ckpt"), str(tmp_path / "f.npz"), "--no-plots"]) == 0
    slices = _rows(tmp_path / "gp2" / "predict" / "version_0" / "slices.csv")
    assert len(slices) == sum(len(b) for b in bags["bags"]) and slices[0]["position"] == "0.0"
    wide = feature_bags(num_bags=4, dim=5)
    save_features(tmp_path / "wide.npz", FeatureTable.from_bags(wide["bags"], [f"w{i}" for i in range(4)], [float("nan")] * 4))
    capsys.readouterr()
    assert predict_main([str(tmp_path / "gp2" / "checkpoints" / "last.ckpt"), str(tmp_path / "wide.npz"), "--no-plots"]) == 2
    assert "wide.npz: the inputs have 5 features per instance, the GP head expects 4" in capsys.readouterr().err


def test_milgp_predict_reads_feature_suffixes_in_any_case_and_names_other_files(gp_run: Path, tmp_path: Path,
                                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``X.NPZ`` / ``X.CSV`` are feature files; any other existing file is named as neither a feature
    file nor a DICOM folder. Before, both were reported as "no such folder" (the file was there)."""
    from lightning_modules.data import FeatureDataModule
    from lightning_modules.features import FeatureTable, save_features
    from lightning_modules.input_error import InputError
    from lightning_modules.predict import data_module_for

    table = FeatureTable.from_bags([np.ones((2, 3), np.float32)], ["s0"], [float("nan")])
    for name in ("X.NPZ", "Y.Csv"):
        Path(save_features(tmp_path / f"f{Path(name).suffix.lower()}", table)).rename(tmp_path / name)
        data = data_module_for([str(tmp_path / name)])
        assert isinstance(data, FeatureDataModule)
        data.setup("predict")
        assert data.bag_ids == ["s0"]
    (tmp_path / "notes.txt").write_text("not features")
    with pytest.raises(InputError, match=r"notes\.txt: not a feature file \(\.npz or \.csv\) or a DICOM folder"):
        data_module_for([str(tmp_path / "notes.txt")])
    capsys.readouterr()
    assert predict_main([str(gp_run / "checkpoints" / "best.ckpt"), str(tmp_path / "notes.txt"), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == f"milgp-predict: error: {tmp_path / 'notes.txt'}: not a feature file (.npz or .csv) or a DICOM folder"


def test_a_scan_predicted_from_dicom_equals_the_same_scan_predicted_from_its_cache(gp_run: Path, tiny_cache: str, tmp_path: Path) -> None:
    """The DICOM path must serve the model exactly what the cache served it in training: the same
    windows and size and the same storage quantisation (uint8 steps of 1/255 of the window width).
    Predicting the tiny cache's own source scans from DICOM and from the cache must give the same
    scan probabilities; a difference means a train/predict preprocessing mismatch."""
    ckpt = str(gp_run / "checkpoints" / "last.ckpt")
    assert predict_main([ckpt, tiny_cache, "--out", str(tmp_path / "from_cache"), "--no-plots"]) == 0
    assert predict_main([ckpt, str(Path(tiny_cache).parent / "data"), "--out", str(tmp_path / "from_dicom"), "--no-plots"]) == 0
    # the RSNA layout's bag id is the series UID, the DICOM path's scan id
    cached = {s["bag_id"]: float(s["probability"]) for s in _rows(tmp_path / "from_cache" / "predict" / "version_0" / "predictions.csv")}
    dicom = {s["bag_id"]: float(s["probability"]) for s in _rows(tmp_path / "from_dicom" / "predict" / "version_0" / "predictions.csv")}
    assert set(dicom) == set(cached)
    np.testing.assert_allclose([dicom[k] for k in sorted(cached)], [cached[k] for k in sorted(cached)], rtol=0, atol=1e-7)


@pytest.mark.parametrize("option, value, message", [
    ("--threshold", "1.5", "--threshold must lie in (0, 1), got 1.5"),
    ("--max-slices", "0", "--max-slices must be at least 1"),
    ("--batch-size", "0", "--batch-size must be at least 1, got 0"),
    ("--out", "a_file", "a file, not a run folder"),
    ("--accelerator", "quantum", "--accelerator quantum: give cpu, gpu or auto"),
])
def test_milgp_predict_refuses_bad_options_before_writing_anything(
    gp_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, message: str
) -> None:
    """Each of these ended in a traceback (exit 1), --max-slices 0 only after prediction had started,
    and left an empty predict/version_<n> folder behind; each must be one line (exit 2), nothing written."""
    (tmp_path / "a_file").write_text("not a folder")
    value = str(tmp_path / value) if option == "--out" else value
    before = sorted((gp_run / "predict").iterdir()) if (gp_run / "predict").is_dir() else []
    capsys.readouterr()
    assert predict_main([str(gp_run / "checkpoints" / "best.ckpt"), str(tmp_path), "--no-plots", option, value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert (sorted((gp_run / "predict").iterdir()) if (gp_run / "predict").is_dir() else []) == before


def test_milgp_predict_on_gpu_without_one_is_one_line(gp_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`--accelerator gpu` on a machine without a GPU (here: torch sees none) is one line naming the
    option (exit 2), and nothing is written; it was Lightning's traceback (exit 1)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    capsys.readouterr()
    assert predict_main([str(gp_run / "checkpoints" / "best.ckpt"), str(tmp_path), "--no-plots", "--accelerator", "gpu", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--accelerator gpu: this machine has no GPU" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("case", ["empty folder", "every scan undecodable", "feature file of another width"])
def test_a_refused_milgp_predict_leaves_no_version_folder(gp_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    """Inputs found unusable once the model is in place (no series in the folder, no scan that can
    be decoded, features of another width than the model's) are refused (exit 2) and leave the run
    folder as it was. Before, each left a new `predict/version_<n>` holding only `hparams.yaml`."""
    from lightning_modules.features import FeatureTable, save_features

    if case == "empty folder":
        (tmp_path / "empty").mkdir()
        given = str(tmp_path / "empty")
    elif case == "every scan undecodable":
        new = write_rsna_dataset(tmp_path / "new", n_scans=1, slices=(3, 3), size=32, seed=4)
        for p in new.scans[0].paths:
            _undecodable(p)
        given = new.image_dir
    else:
        given = str(tmp_path / "wide.npz")
        save_features(given, FeatureTable.from_bags([np.zeros((2, 9), np.float32)], ["w0"], [float("nan")]))
    before = sorted((gp_run / "predict").rglob("*")) if (gp_run / "predict").is_dir() else []
    capsys.readouterr()
    assert predict_main([str(gp_run / "checkpoints" / "best.ckpt"), given, "--no-plots", "--accelerator", "cpu"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) >= 1
    assert (sorted((gp_run / "predict").rglob("*")) if (gp_run / "predict").is_dir() else []) == before


def test_milgp_predict_names_scans_that_lie_outside_the_training_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A scan whose slice features lie far from every training slice (here ×50) gets the GP prior at
    every slice, which the calibrated bag decision read as near-certain (0.9999 ± 6e-5, called
    positive, no word). Its `outside_training` share must be 1 and the scan named on stderr; the
    training scans themselves, and the same features again, must read (near) 0 and stay silent."""
    from lightning_modules.features import FeatureTable, save_features
    from lm_helpers import feature_bags

    train = feature_bags(num_bags=24, dim=4, seed=3)
    save_features(tmp_path / "train.npz", FeatureTable.from_bags(train["bags"], [f"t{i}" for i in range(24)], train["bag_labels"]))
    cfg = {"trainer": trainer_cfg(tmp_path, "gp", max_epochs=3),
           "model": {"class_path": "lightning_modules.GPMILModule", "init_args": {"feature_dim": 4, "num_inducing": 8}},
           "data": {"class_path": "lightning_modules.FeatureDataModule", "init_args": {"path": str(tmp_path / "train.npz")}}}
    run_cli(["fit", "--config", write_config(tmp_path / "gp.yaml", cfg)])
    new = [train["bags"][0], train["bags"][1], 50.0 * train["bags"][1]]
    save_features(tmp_path / "new.npz", FeatureTable.from_bags(new, ["same0", "same1", "far"], [float("nan")] * 3))
    capsys.readouterr()
    assert predict_main([str(tmp_path / "gp" / "checkpoints" / "last.ckpt"), str(tmp_path / "new.npz"), "--no-plots"]) == 0
    err = capsys.readouterr().err
    scans = {s["bag_id"]: s for s in _rows(tmp_path / "gp" / "predict" / "version_0" / "predictions.csv")}
    assert float(scans["far"]["outside_training"]) == 1.0
    assert float(scans["same0"]["outside_training"]) < 0.5 and float(scans["same1"]["outside_training"]) < 0.5
    assert "milgp: scan far: 100% of its slices lie outside the training data" in err and "scan same" not in err
