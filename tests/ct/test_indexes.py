"""Bag indexes: RSNA, CQ500 and generic layouts, label files, save/load and patient splits."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np
import pydicom
import pytest

from milgp.ct.cq500 import SeriesSummary, choose_series, cq500_number, index_cq500, is_contrast_series
from milgp.ct.index import BagIndex, BagRecord, split_by_patient
from milgp.ct.generic_layout import index_generic
from milgp.ct.rsna import index_rsna, read_rsna_labels
from milgp.ct.series_policy import SeriesPolicy
from milgp.ct.synthetic import SyntheticDataset, write_cq500_dataset, write_generic_dataset


def test_rsna_index_matches_ground_truth(rsna_synth: SyntheticDataset) -> None:
    """One bag per series with slices in anatomical order, slice labels = 'any', bag label = max, patient
    from PatientID. Failing means ordering, grouping or labelling is wrong."""
    index = index_rsna(rsna_synth.image_dir, rsna_synth.labels_csv)
    assert len(index) == len(rsna_synth.scans) and not index.skipped
    for bag in index.bags:
        truth = rsna_synth.scan(bag.bag_id)
        assert bag.slice_paths == truth.paths
        assert bag.slice_labels == truth.slice_labels
        assert bag.bag_label == truth.bag_label == max(truth.slice_labels)
        assert bag.patient_id == truth.patient_id and bag.ordering == "geometry"


def _write_labels(path: Path, rows: list[str]) -> Path:
    path.write_text("ID,Label\n" + "".join(r + "\n" for r in rows))
    return path


def test_rsna_duplicate_identical_rows_are_accepted(tmp_path: Path) -> None:
    """Identical duplicate rows (present in the real file) must be merged silently."""
    rows = [f"ID_abc_{s},0" for s in ("epidural", "subdural", "any")]
    labels, invalid, unattributed = read_rsna_labels(_write_labels(tmp_path / "l.csv", rows + rows[:2]))
    assert labels == {"ID_abc": {"epidural": 0, "subdural": 0, "any": 0}} and not invalid and not unattributed


def test_rsna_conflicting_duplicate_rows_name_the_image(tmp_path: Path) -> None:
    """Two rows for the same image/subtype with different labels must make that image invalid, the reason naming
    the image and both lines; the other image stays valid."""
    path = _write_labels(tmp_path / "l.csv", ["ID_abc_any,0", "ID_def_any,1", "ID_abc_any,1"])
    labels, invalid, _ = read_rsna_labels(path)
    assert labels == {"ID_def": {"any": 1}}
    assert re.search(r"conflicting duplicate rows for image ID_abc, subtype any.*line 2.*line 4", invalid["ID_abc"])


def test_rsna_missing_any_row_names_the_image(tmp_path: Path) -> None:
    """An image with subtype rows but no 'any' row has no slice label: it must be invalid, the reason naming it."""
    path = _write_labels(tmp_path / "l.csv", ["ID_abc_any,0", "ID_def_epidural,1"])
    labels, invalid, _ = read_rsna_labels(path)
    assert list(labels) == ["ID_abc"] and "image ID_def has no 'ID_def_any' row" in invalid["ID_def"]


def test_rsna_malformed_label_files(tmp_path: Path) -> None:
    """A file without the ID/Label columns is refused whole naming the file; an unknown subtype or a label other
    than 0/1 invalidates only that image, with the line named; a malformed ID is reported as unattributed."""
    bad_header = tmp_path / "h.csv"
    bad_header.write_text("Image,Target\nID_a_any,0\n")
    with pytest.raises(ValueError, match=r"h\.csv: missing columns \['ID', 'Label'\]"):
        read_rsna_labels(bad_header)
    _, invalid, _ = read_rsna_labels(_write_labels(tmp_path / "s.csv", ["ID_a_foo,0"]))
    assert "line 2: unknown subtype 'foo'" in invalid["ID_a"]
    labels, invalid, unattributed = read_rsna_labels(_write_labels(tmp_path / "v.csv", ["ID_a_any,0", "ID_b_any,2", "junk,1"]))
    assert list(labels) == ["ID_a"] and "line 3: ID_b_any: label '2'" in invalid["ID_b"]
    assert unattributed and "line 4: ID 'junk'" in unattributed[0]


def test_rsna_image_without_label_rows_refuses_its_series(rsna_copy: SyntheticDataset) -> None:
    """A .dcm file absent from the label file must leave its whole series out (its bag label is unknown), the
    reason naming the image; every other series is indexed."""
    shutil.copy(rsna_copy.scans[0].paths[0], Path(rsna_copy.image_dir) / "ID_ffffffff0.dcm")
    index = index_rsna(rsna_copy.image_dir, rsna_copy.labels_csv)
    assert sorted(index.bag_ids) == sorted(s.bag_id for s in rsna_copy.scans[1:])
    [refused] = index.refused
    assert refused.bag_id == rsna_copy.scans[0].bag_id and "image ID_ffffffff0 has no rows in the label file" in refused.reason


def test_rsna_corrupt_file_is_skipped_and_reported(rsna_copy: SyntheticDataset) -> None:
    """A corrupt slice must be left out of its bag and listed in index.skipped with its path; the bag stays."""
    victim = rsna_copy.scans[0].paths[1]
    Path(victim).write_text("garbage")
    index = index_rsna(rsna_copy.image_dir, rsna_copy.labels_csv)
    assert [e.path for e in index.skipped] == [victim]
    bag = next(b for b in index.bags if b.bag_id == rsna_copy.scans[0].bag_id)
    assert victim not in bag.slice_paths and len(bag.slice_paths) == len(rsna_copy.scans[0].paths) - 1


def test_rsna_empty_folder_is_an_error(tmp_path: Path) -> None:
    """An empty image folder must raise a clear error rather than produce an empty index."""
    (tmp_path / "imgs").mkdir()
    labels = _write_labels(tmp_path / "l.csv", ["ID_a_any,0"])
    with pytest.raises(ValueError, match="no ID_\\*.dcm files"):
        index_rsna(tmp_path / "imgs", labels)


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_index_save_load_round_trip(rsna_synth: SyntheticDataset, tmp_path: Path, suffix: str) -> None:
    """Saving and loading (JSON or CSV) must give back the same bags, and leave no temporary files; a relative
    slice path (a hand-written index) loads as the absolute path it names from the working directory."""
    index = index_rsna(rsna_synth.image_dir, rsna_synth.labels_csv)
    index.bags.append(BagRecord("no-labels", "p", 1.0, ("a.dcm", "/data/b.dcm")))
    path = tmp_path / f"index{suffix}"
    index.save(path)
    loaded = BagIndex.load(path)
    assert loaded.bags[:-1] == index.bags[:-1] and loaded.bags[-1].slice_paths == (os.path.abspath("a.dcm"), "/data/b.dcm")
    assert os.listdir(tmp_path) == [path.name]
    with pytest.raises(ValueError, match="must end in .json or .csv"):
        index.save(tmp_path / "index.txt")


def test_index_rejects_duplicate_bag_ids_and_bad_records() -> None:
    """Duplicate bag ids or label/slice count mismatches must be refused, naming the bag."""
    rec = BagRecord("b1", "p", 0.0, ("x",))
    with pytest.raises(ValueError, match="'b1' appears twice"):
        BagIndex([rec, rec])
    with pytest.raises(ValueError, match="bag 'b2': 1 slice labels for 2 slices"):
        BagRecord("b2", "p", 0.0, ("x", "y"), (1,))


def test_split_by_patient_groups_and_stratifies(rsna_synth: SyntheticDataset) -> None:
    """No patient may appear in two splits, every bag lands in exactly one split, the split is reproducible
    and each stratum is dealt proportionally. Failing leaks patients between train and test."""
    index = index_rsna(rsna_synth.image_dir, rsna_synth.labels_csv)
    splits = split_by_patient(index, (0.5, 0.25, 0.25), seed=3)
    patients = [{b.patient_id for b in s.bags} for s in splits.values()]
    assert all(not (a & b) for i, a in enumerate(patients) for b in patients[i + 1:])
    assert sorted(b for s in splits.values() for b in s.bag_ids) == sorted(index.bag_ids)
    again = split_by_patient(index, (0.5, 0.25, 0.25), seed=3)
    assert {k: v.bag_ids for k, v in again.items()} == {k: v.bag_ids for k, v in splits.items()}
    assert any(b.bag_label == 1 for b in splits["train"].bags) and any(b.bag_label == 0 for b in splits["train"].bags)


def test_split_by_patient_tiny_dataset_and_bad_fractions() -> None:
    """Two patients must still split (one split may be empty); fractions not summing to 1 are refused."""
    index = BagIndex([BagRecord("a", "p1", 1.0, ("x",)), BagRecord("b", "p1", 0.0, ("y",)), BagRecord("c", "p2", 0.0, ("z",))])
    splits = split_by_patient(index, seed=0)
    assert sum(len(s) for s in splits.values()) == 3
    assert sum(1 for s in splits.values() if {"a", "b"} <= set(s.bag_ids)) == 1
    with pytest.raises(ValueError, match="sum to 1"):
        split_by_patient(index, (0.5, 0.2, 0.2))


def test_cq500_picks_the_plain_5mm_series_and_majority_label(tmp_path: Path) -> None:
    """Among plain 5 mm, thin, post-contrast and bone-kernel series the rule must pick the plain 5 mm one
    (the others have more slices), order it by geometry, and label the study by the readers' majority."""
    ds = write_cq500_dataset(tmp_path / "cq500", n_studies=3, slices=(4, 5), size=16, seed=2)
    index = index_cq500(ds.image_dir, ds.labels_csv)
    assert [b.bag_id for b in index.bags] == [s.bag_id for s in ds.scans] and not index.skipped
    for bag in index.bags:
        truth = ds.scan(bag.bag_id)
        assert bag.series_uid == truth.series_uid and bag.slice_paths == truth.paths
        assert bag.bag_label == truth.bag_label and bag.slice_labels is None and bag.patient_id == bag.bag_id


def test_cq500_unlabelled_study_is_reported(tmp_path: Path) -> None:
    """A study folder with no reads.csv row must be listed in skipped, not indexed with a made-up label."""
    ds = write_cq500_dataset(tmp_path / "cq500", n_studies=2, slices=(3, 3), size=16, seed=0)
    Path(ds.labels_csv).write_text("\n".join(Path(ds.labels_csv).read_text().splitlines()[:2]) + "\n")
    index = index_cq500(ds.image_dir, ds.labels_csv)
    assert [b.bag_id for b in index.bags] == ["CQ500-CT-0"]
    assert index.refused[0].bag_id == "CQ500-CT-1" and "CQ500-CT-1 has no row" in index.refused[0].reason


def test_cq500_name_mapping_and_series_rule() -> None:
    """Folder and reads.csv spellings must map to one study number; contrast wording must be recognised
    including negations ('PRE CONTRAST' is plain); bone kernels lose to soft kernels."""
    assert cq500_number("CQ500CT1 CQ500CT1") == cq500_number("CQ500-CT-1") == 1
    assert cq500_number("cq500_ct_427") == 427
    with pytest.raises(ValueError, match="not a CQ500 study name"):
        cq500_number("study7")
    assert is_contrast_series("CT POST CONTRAST", "") and is_contrast_series("HEAD C+", "")
    assert is_contrast_series("CT 5mm", "IOHEXOL") and not is_contrast_series("CT 5mm", "NONE")
    assert not is_contrast_series("CT PRE CONTRAST 5MM STD", "") and not is_contrast_series("CT PLAIN THIN", "")
    soft = SeriesSummary("1", "CT 5mm", "", "H30s", 5.0, 30, True)
    bone = SeriesSummary("2", "CT 5mm BONE", "", "H70h", 5.0, 40, True)
    thin = SeriesSummary("3", "CT 0.625mm", "", "STANDARD", 0.625, 240, True)
    sagittal = SeriesSummary("4", "CT SAG", "", "STANDARD", 5.0, 90, False)
    assert choose_series([bone, thin, soft, sagittal]) == soft
    assert choose_series([sagittal]) is None


def test_generic_layout_matches_ground_truth(tmp_path: Path) -> None:
    """Folder-per-bag data with bag and slice label CSVs must index to the written truth, in anatomical order."""
    ds = write_generic_dataset(tmp_path / "gen", n_bags=3, slices=(4, 6), size=16, n_patients=2, seed=4)
    index = index_generic(ds.image_dir, ds.labels_csv, ds.slice_labels_csv)
    assert [b.bag_id for b in index.bags] == [s.bag_id for s in ds.scans]
    for bag in index.bags:
        truth = ds.scan(bag.bag_id)
        assert bag.slice_paths == truth.paths and bag.slice_labels == truth.slice_labels
        assert bag.bag_label == truth.bag_label and bag.patient_id == truth.patient_id
    no_slices = index_generic(ds.image_dir, ds.labels_csv)
    assert all(b.slice_labels is None for b in no_slices.bags)


def test_generic_layout_errors_name_the_bag_or_slice(tmp_path: Path) -> None:
    """A missing slice-label row, a listed bag without folder, and an unlisted folder must each be reported
    with the bag/slice named, and never stop the other bags from being indexed."""
    ds = write_generic_dataset(tmp_path / "gen", n_bags=2, slices=(3, 3), size=16, seed=4)
    lines = Path(ds.slice_labels_csv).read_text().splitlines()
    short = tmp_path / "short.csv"
    short.write_text("\n".join(lines[:-1]) + "\n")
    missing_name = Path(lines[-1].split(",")[1]).name
    index = index_generic(ds.image_dir, ds.labels_csv, short)
    assert index.bag_ids == ["scan_000"]
    assert index.refused[0].bag_id == "scan_001" and f"{missing_name} has no slice label" in index.refused[0].reason
    extra = tmp_path / "extra.csv"
    extra.write_text(Path(ds.labels_csv).read_text() + "ghost,1,p\n")
    index = index_generic(ds.image_dir, extra)
    assert index.bag_ids == ["scan_000", "scan_001"]
    assert [(e.bag_id, "but not a folder" in e.reason) for e in index.refused] == [("ghost", True)]
    (Path(ds.image_dir) / "unlisted").mkdir()
    index = index_generic(ds.image_dir, ds.labels_csv)
    assert any("'unlisted' is not listed" in e.reason for e in index.skipped)


def test_cq500_series_rule_uses_the_same_tilt_limit_and_option_as_every_layout(tmp_path: Path) -> None:
    """A study acquired with a 30 degree gantry tilt is axial for the generic and RSNA layouts (limit 40
    degrees); CQ500 must index it too instead of refusing the study, and --allow-non-axial must reach
    its series rule (a non-axial series then ranks after every axial one)."""
    ds = write_cq500_dataset(tmp_path / "cq500", n_studies=2, slices=(4, 4), size=16, seed=3)
    c, s_ = np.cos(np.radians(30)), np.sin(np.radians(30))
    study = Path(ds.scan("CQ500-CT-0").paths[0]).parents[2]
    for path in sorted(study.rglob("*.dcm")):
        dcm = pydicom.dcmread(path)
        z = float(dcm.ImagePositionPatient[2])
        dcm.ImageOrientationPatient = [1, 0, 0, 0, c, -s_]
        dcm.ImagePositionPatient = [-125, -125 + z * s_, z * c]
        dcm.save_as(path)
    index = index_cq500(ds.image_dir, ds.labels_csv)
    assert index.bag_ids == ["CQ500-CT-0", "CQ500-CT-1"] and not index.refused
    assert index.bags[0].series_uid == ds.scan("CQ500-CT-0").series_uid
    sagittal = SeriesSummary("4", "CT SAG", "", "STANDARD", 5.0, 90, False)
    bone = SeriesSummary("2", "CT 5mm BONE", "", "H70h", 5.0, 40, True)
    assert choose_series([sagittal], allow_non_axial=True) == sagittal
    assert choose_series([sagittal, bone], allow_non_axial=True) == bone
    assert choose_series([sagittal], allow_non_axial=False) is None
    assert SeriesPolicy().max_tilt_deg >= 30


def test_csv_index_refuses_a_damaged_bag_and_keeps_the_others(rsna_synth: SyntheticDataset, tmp_path: Path) -> None:
    """A damaged bag in a saved CSV index (a slice label edited to 2, a slice_index that is not a number)
    must be refused with the file, the line and the reason, and every other bag loaded unchanged, as
    a JSON index does (docs: 'a damaged bag entry is left out'). Before, one damaged bag failed the
    whole load."""
    index = index_rsna(rsna_synth.image_dir, rsna_synth.labels_csv)
    path = tmp_path / "index.csv"
    index.save(path)
    lines = path.read_text().splitlines()
    header = lines[0].split(",")
    damaged = {index.bags[0].bag_id: ("slice_label", "2"), index.bags[1].bag_id: ("slice_index", "x")}
    for k, line in enumerate(lines[1:], start=1):
        cells = line.split(",")
        if cells[0] in damaged:
            column, value = damaged.pop(cells[0])
            cells[header.index(column)] = value
            lines[k] = ",".join(cells)
    path.write_text("\n".join(lines) + "\n")
    loaded = BagIndex.load(path)
    assert loaded.bags == index.bags[2:]  # label_from_slices and the rest round-trip
    assert [e.bag_id for e in loaded.refused] == index.bag_ids[:2]
    assert all(e.path == str(path) and "left out" in e.reason and "from line" in e.reason for e in loaded.refused)
    assert "slice label 2 is not 0 or 1" in loaded.refused[0].reason


def test_generic_slice_labels_follow_the_label_rule(tmp_path: Path) -> None:
    """Slice labels must be read by the same rule as bag labels: with --label-map yes=1,no=0 'yes'/'no'
    slice labels index (and '1.0' reads as 1). Before, only the text '0'/'1' was accepted for slices,
    so every bag was refused while its bag label was accepted."""
    from milgp.ct.label_rule import LabelRule

    ds = write_generic_dataset(tmp_path / "gen", n_bags=2, slices=(3, 4), size=16, seed=4)
    truth = {s.bag_id: s for s in ds.scans}
    words = {"1": "YES", "0": "no"}
    bags = tmp_path / "labels_yes.csv"
    bags.write_text("".join(l[:-1] + words[l[-1]] + "\n" if l[-1] in words else l + "\n" for l in Path(ds.labels_csv).read_text().splitlines()))
    rows = Path(ds.slice_labels_csv).read_text().splitlines()
    slices = tmp_path / "slices_yes.csv"
    slices.write_text(rows[0] + "\n" + "".join(r[:-1] + words[r[-1]] + "\n" for r in rows[1:]))
    index = index_generic(ds.image_dir, bags, slices, rule=LabelRule("binary", {"yes": 1, "no": 0}))
    assert not index.refused and len(index) == 2
    for bag in index.bags:
        assert bag.slice_labels == truth[bag.bag_id].slice_labels and bag.bag_label == truth[bag.bag_id].bag_label
    floats = tmp_path / "slices_float.csv"
    floats.write_text(rows[0] + "\n" + "".join(r + ".0\n" for r in rows[1:]))
    assert len(index_generic(ds.image_dir, ds.labels_csv, floats)) == 2
    bad = tmp_path / "slices_bad.csv"
    bad.write_text(rows[0] + "\n" + "".join(r[:-1] + "2\n" for r in rows[1:]))
    refused = index_generic(ds.image_dir, ds.labels_csv, bad).refused
    assert len(refused) == 2 and all("slices_bad.csv, line" in e.reason and "'2'" in e.reason for e in refused)


def test_generic_bag_label_0_with_a_positive_slice_is_refused(tmp_path: Path) -> None:
    """A bag labelled 0 whose slice labels hold a 1 contradicts itself (MIL: a bag with a positive
    instance is positive): it must be refused with one line naming the bag and a positive slice,
    the other bags indexed. Before, it was cached as a negative bag with positive slices."""
    ds = write_generic_dataset(tmp_path / "gen", n_bags=3, slices=(3, 4), size=16, seed=4, prevalence=0.4)
    positive = next(s for s in ds.scans if s.bag_label == 1)
    labels = tmp_path / "contra.csv"
    labels.write_text(Path(ds.labels_csv).read_text().replace(f"{positive.bag_id},1,", f"{positive.bag_id},0,"))
    index = index_generic(ds.image_dir, labels, ds.slice_labels_csv)
    assert positive.bag_id not in index.bag_ids and len(index) == 2
    (entry,) = index.refused
    assert entry.bag_id == positive.bag_id and "bag label 0 contradicts its slice labels" in entry.reason
    first = next(p for p, v in zip(positive.paths, positive.slice_labels) if v)
    assert os.path.basename(first) in entry.reason and "\n" not in entry.reason


def test_cq500_study_listed_twice_with_different_reads_is_refused(tmp_path: Path) -> None:
    """A study listed twice with different reads must be refused even when both rows give the same
    majority (docs: 'study listed twice with different reads: that study refused'); an identical
    repeated row is merged. Before, only a different majority was refused."""
    from milgp.ct.cq500 import read_cq500_labels

    reads = tmp_path / "reads.csv"
    reads.write_text("name,Category,R1:ICH,R2:ICH,R3:ICH\n"
                     "CQ500-CT-0,x,1,0,1\nCQ500-CT-0,x,1,1,1\n"      # same majority, different reads
                     "CQ500-CT-1,x,0,0,1\nCQ500-CT-1,x,0,0,1\n")     # identical rows
    labels, invalid, _ = read_cq500_labels(reads)
    assert labels == {1: ("CQ500-CT-1", 0.0)}
    assert set(invalid) == {0} and "listed twice with different reads (lines 2 and 3" in invalid[0]


def test_rsna_label_rows_without_an_image_are_reported(rsna_copy: SyntheticDataset) -> None:
    """Label rows whose ID names an image with no file must be reported (docs: 'a row whose ID names no
    image is reported'): one warning with their count and examples, nothing refused, every series
    indexed as before. Before, they were ignored without a word."""
    with open(rsna_copy.labels_csv, "a") as fh:
        fh.write("".join(f"ID_deadbeef{k}_any,1\nID_deadbeef{k}_epidural,1\n" for k in range(5)))
    index = index_rsna(rsna_copy.image_dir, rsna_copy.labels_csv)
    assert len(index) == len(rsna_copy.scans) and not index.refused and not index.skipped
    (entry,) = index.warnings
    assert entry.path == rsna_copy.labels_csv and entry.reason.startswith("5 images have rows in the label file but no file")
    assert "ID_deadbeef0, ID_deadbeef1, ID_deadbeef2 and 2 more" in entry.reason


def test_a_label_file_naming_a_column_twice_is_refused(tmp_path: Path) -> None:
    """`ID,Label,Label`: one of the two columns was read silently (the last), whichever the user meant."""
    path = tmp_path / "twice.csv"
    path.write_text("ID,Label,Label\nID_a_any,0,1\n")
    with pytest.raises(ValueError, match=r"twice\.csv: column 'Label' appears 2 times in the header"):
        read_rsna_labels(path)
