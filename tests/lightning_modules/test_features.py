"""The feature-file format round-trips in both encodings, reads CSV feature columns by name, and
refuses files whose bags cannot be told apart; an external file can be tested whole."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lightning_modules.features import FeatureTable, load_features, save_features


@pytest.mark.parametrize("suffix", [".npz", ".csv"])
def test_feature_file_round_trip(tmp_path: Path, suffix: str) -> None:
    """Features, bag structure, labels (unknown = NaN), patients and splits survive save/load.

    If this fails, the two-stage GP would train on features attached to the wrong bags/labels."""
    rng = np.random.default_rng(0)
    bags = [rng.standard_normal((n, 3)).astype(np.float32) for n in (1, 4, 2)]
    table = FeatureTable.from_bags(bags, ["a", "b/c", "d"], [0.0, 1.0, 1.0], [np.zeros(1), None, np.array([0, 1])],
                                   ["p1", "p2", ""], ["train", "test", "val"])
    save_features(tmp_path / f"f{suffix}", table)
    back = load_features(tmp_path / f"f{suffix}")
    assert back.bag_ids == table.bag_ids and back.splits == table.splits and back.patient_ids == table.patient_ids
    np.testing.assert_allclose(back.bag_labels, table.bag_labels)
    for r1, r2 in zip(back.bag_rows(), table.bag_rows()):
        np.testing.assert_allclose(back.features[r1], table.features[r2], rtol=1e-6)
        np.testing.assert_array_equal(np.isnan(back.instance_labels[r1]), np.isnan(table.instance_labels[r2]))


def _table() -> FeatureTable:
    rng = np.random.default_rng(1)
    return FeatureTable.from_bags([rng.standard_normal((n, 3)).astype(np.float32) for n in (3, 4, 2)], ["a", "b", "c"], [0.0, 1.0, 0.0])


def _csv_rows(tmp_path: Path) -> list[list[str]]:
    save_features(tmp_path / "f.csv", _table())
    return [line.split(",") for line in (tmp_path / "f.csv").read_text().splitlines()]


def _write(path: Path, rows: list[list[str]]) -> Path:
    path.write_text("\n".join(",".join(r) for r in rows) + "\n")
    return path


def test_csv_feature_columns_are_read_by_name_and_must_be_f0_to_fd(tmp_path: Path) -> None:
    """Columns ``f2,f1,f0`` (each with its own values) read as the same features; a header with a
    column missing or misnumbered is refused naming the file. Read by position, the reordered file
    was accepted with every feature in the wrong place (all positive scans called negative)."""
    rows = _csv_rows(tmp_path)
    order = list(range(6)) + [8, 7, 6]
    back = load_features(_write(tmp_path / "rev.csv", [[r[i] for i in order] for r in rows]))
    np.testing.assert_array_equal(back.features, load_features(tmp_path / "f.csv").features)
    rows[0][8] = "f4"
    with pytest.raises(ValueError, match=r"gap\.csv: the feature columns must be f0 … f2"):
        load_features(_write(tmp_path / "gap.csv", rows))


def test_bags_that_cannot_be_told_apart_are_refused_naming_the_file_and_bag(tmp_path: Path) -> None:
    """Two scans given one id must not be merged into one bag (a CSV bag whose rows come back after
    other bags, or that repeats a slice index) nor lose one of them (an ``.npz`` bag id given
    twice); a bag id without rows is refused too. Before, the CSV merged the scans (a negative scan
    reported at 0.99) and the ``.npz`` dropped one."""
    rows = _csv_rows(tmp_path)
    apart = [r[:] for r in rows]
    apart[-1][0] = "a"
    with pytest.raises(ValueError, match=r"apart\.csv: line 10: bag 'a' again after other bags"):
        load_features(_write(tmp_path / "apart.csv", apart))
    twice = [r[:] for r in rows]
    twice[2][4] = twice[1][4]
    with pytest.raises(ValueError, match=r"twice\.csv: bag 'a' has slice_index 0 twice"):
        load_features(_write(tmp_path / "twice.csv", twice))
    table = _table()
    table.bag_ids = ["a", "b", "a"]
    save_features(tmp_path / "dup.npz", table)
    with pytest.raises(ValueError, match=r"dup\.npz: bag id 'a' is given to 2 bags"):
        load_features(tmp_path / "dup.npz")
    table = _table()
    table.bag_index = np.where(table.bag_index == 2, 1, table.bag_index)
    save_features(tmp_path / "empty.npz", table)
    with pytest.raises(ValueError, match=r"empty\.npz: bag 'c' has no rows"):
        load_features(tmp_path / "empty.npz")


def test_a_csv_value_beyond_float32_is_named_not_called_infinite(tmp_path: Path) -> None:
    """Features are kept in float32: a finite 1e39 must be reported as such, with its bag and field."""
    rows = _csv_rows(tmp_path)
    rows[1][7] = "1e39"
    with pytest.raises(ValueError, match=r"big\.csv: line 2: bag 'a' field f1 = 1e\+39 is beyond float32"):
        load_features(_write(tmp_path / "big.csv", rows))


def test_an_npz_value_beyond_float32_is_named_and_float64_features_are_kept_exactly(tmp_path: Path) -> None:
    """An ``.npz`` may hold float64 features; a finite 1e40 there must stop the load naming the file,
    bag, slice and field, as in a CSV. Before, it passed every check: `milgp-train fit` ended in a
    CholeskyError traceback and `milgp-predict` gave the scan p = 0.5 without a word. Valid float64
    features come back as stored: rounded to float32, a model trained on them (or its checkpoint's
    standardisation) would see other values than before."""
    table = _table()
    table.features = table.features.astype(np.float64)
    save = dict(np.load(_npz(tmp_path / "ok.npz", table)))
    save["features"] = table.features
    np.savez(tmp_path / "f64.npz", **save)
    loaded = load_features(tmp_path / "f64.npz").features
    assert loaded.dtype == np.float64 and np.array_equal(loaded, table.features)
    save["features"] = table.features.copy()
    save["features"][4, 2] = 1e40
    np.savez(tmp_path / "big.npz", **save)
    with pytest.raises(ValueError, match=r"big\.npz: bag 'b', slice_index 1, field f2 = 1e\+40 is beyond float32"):
        load_features(tmp_path / "big.npz")


@pytest.mark.parametrize("fault, message", [
    ("empty", r"empty file \(0 bytes\)"),
    ("truncated", r"not an \.npz feature file \(not a zip archive"),
    ("corrupt member", r"array 'features' cannot be read \(BadZipFile: Bad CRC-32"),
    ("float bag_index", r"array 'bag_index' is float64 of shape \(9,\); the format has int64 \(N,\)"),
    ("1-d features", r"array 'features' is float32 of shape \(27,\); the format has float32 \(N, D\)"),
    ("missing array", r"array 'splits' is missing"),
    ("2-d bag_ids", r"array 'bag_ids' is <U1 of shape \(3, 1\)"),
])
def test_a_malformed_npz_is_one_error_naming_the_file_and_the_array(tmp_path: Path, fault: str, message: str) -> None:
    """Each of these was a traceback of another kind (EOFError, BadZipFile, a TypeError in
    ``bag_rows``, a ValueError of the dataset once training had begun); each must be a
    ``ValueError`` naming the file and, where one is at fault, the array."""
    good = _npz(tmp_path / "good.npz", _table())
    arrays = dict(np.load(good))
    path = tmp_path / "bad.npz"
    if fault == "empty":
        path.write_bytes(b"")
    elif fault == "truncated":
        path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif fault == "corrupt member":
        data = bytearray(good.read_bytes())
        at = data.index(arrays["features"].tobytes()[:16])
        data[at: at + 8] = bytes(8)
        path.write_bytes(bytes(data))
    else:
        if fault == "float bag_index":
            arrays["bag_index"] = arrays["bag_index"].astype(np.float64)
        elif fault == "1-d features":
            arrays["features"] = arrays["features"].reshape(-1)
        elif fault == "missing array":
            del arrays["splits"]
        else:
            arrays["bag_ids"] = arrays["bag_ids"].reshape(-1, 1)
        np.savez(path, **arrays)
    with pytest.raises(ValueError, match=r"^" + str(tmp_path / "bad.npz").replace(".", r"\.") + ": " + message) as err:
        load_features(path)
    assert "\n" not in str(err.value)


def _npz(path: Path, table: FeatureTable) -> Path:
    save_features(path, table)
    return path


@pytest.mark.parametrize("fault, message", [
    ("empty cell", r"line 3: bag 'a' column f1 is empty; it needs a number"),
    ("short row", r"line 3: bag 'a' column f1 is missing: the row ends before it \(the header has 9 columns\)"),
    ("label yes", r"line 3: bag 'a' column bag_label = 'yes' is not a number"),
    ("other label", r"line 3: bag 'a' column bag_label = 1, but 0 on line 2; a bag has one label"),
    ("slice 1.5", r"line 3: bag 'a' column slice_index = '1\.5' is not a whole number"),
    ("instance label x", r"line 3: bag 'a' column instance_label = 'x' is not a number"),
    ("header only", r"no data rows \(a header only\)"),
    ("other split", r"line 3: bag 'a' column split = 'test', but '' on line 2; a bag has one split"),
    ("other patient", r"line 3: bag 'a' column patient_id = 'p2', but '' on line 2; a bag has one patient_id"),
])
def test_a_bad_csv_value_is_one_error_naming_the_file_line_and_column(tmp_path: Path, fault: str, message: str) -> None:
    """Each of these named the file alone with Python's own words ("could not convert string to
    float: ''", "invalid literal for int()", "need at least one array to concatenate"); a later
    row's bag label was not read at all."""
    rows = _csv_rows(tmp_path)
    if fault == "empty cell":
        rows[2][7] = ""
    elif fault == "short row":
        rows[2] = rows[2][:7]
    elif fault in ("label yes", "other label"):
        rows[2][3] = "yes" if fault == "label yes" else "1.0"
    elif fault == "slice 1.5":
        rows[2][4] = "1.5"
    elif fault == "instance label x":
        rows[2][5] = "x"
    elif fault in ("other split", "other patient"):  # the first row's value was taken silently
        rows[2][2 if fault == "other split" else 1] = "test" if fault == "other split" else "p2"
    else:
        rows = rows[:1]
    with pytest.raises(ValueError, match=r"^" + str(tmp_path / "bad.csv").replace(".", r"\.") + ": " + message) as err:
        load_features(_write(tmp_path / "bad.csv", rows))
    assert "\n" not in str(err.value)


def test_an_external_feature_file_is_tested_whole_with_test_split_all(tmp_path: Path) -> None:
    """A file without split names is split like a development set; ``test_split="all"`` scores
    every bag (before, ``milgp-train test`` on 20 external scans scored the 4 of its own split)."""
    from lightning_modules.data import FeatureDataModule

    rng = np.random.default_rng(2)
    bags = [rng.standard_normal((3, 2)).astype(np.float32) for _ in range(20)]
    save_features(tmp_path / "ext.npz", FeatureTable.from_bags(bags, [f"s{i}" for i in range(20)], [i % 2 for i in range(20)]))
    split = FeatureDataModule(str(tmp_path / "ext.npz"))
    whole = FeatureDataModule(str(tmp_path / "ext.npz"), test_split="all")
    for dm in (split, whole):
        dm.setup("predict")
    assert len(whole.dataset(whole.test_split)) == 20 and whole.describe("test")["bags"] == 20
    assert len(split.dataset(split.test_split)) == split.describe("test")["bags"] == 4


def test_feature_writer_never_overwrites_a_file_named_by_a_relative_path(tmp_path: Path) -> None:
    """A relative ``output_path`` that leaves the version folder (``../../f.npz``, into the run folder)
    naming an existing feature file is refused before predicting, naming the path, and the file is
    kept. Only absolute paths were checked: a second ``predict`` replaced the first one's features."""
    from types import SimpleNamespace

    from lightning_modules.callbacks import FeatureWriter
    from lightning_modules.input_error import InputError

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "f.npz").write_bytes(b"earlier features")
    trainer = SimpleNamespace(loggers=[], default_root_dir=str(tmp_path / "run" / "predict" / "version_1"))
    with pytest.raises(InputError, match=r"output_path \.\./\.\./f\.npz .*exists"):
        FeatureWriter("../../f.npz").setup(trainer, None, "predict")  # type: ignore[arg-type]
    assert (tmp_path / "run" / "f.npz").read_bytes() == b"earlier features"
    FeatureWriter("../../g.npz").setup(trainer, None, "predict")  # type: ignore[arg-type]
