"""milgp.ct.series_check: how the InstanceNumber fallback is reported."""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pydicom

from milgp.ct.cache import CacheParams, build_cache
from milgp.ct.dicom import read_headers
from milgp.ct.generic_layout import index_generic
from milgp.ct.series_check import check_series
from milgp.ct.synthetic import write_generic_dataset


def test_instance_number_fallback_is_a_report_warning(tmp_path: Path) -> None:
    """A slice without ImagePositionPatient makes the series ordered by InstanceNumber: that must be one
    report warning naming the bag and the slice (in CheckedSeries.warnings, the index's warnings and
    skipped.json), not a raw Python UserWarning printed with a source line. Before, it was only a
    UserWarning and skipped.json did not mention it."""
    ds = write_generic_dataset(tmp_path / "gen", n_bags=2, slices=(4, 4), size=16, seed=1)
    flat = sorted(ds.scans[0].paths)[0]
    d = pydicom.dcmread(flat)
    del d.ImagePositionPatient
    d.save_as(flat)
    headers, _ = read_headers(ds.scans[0].paths)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no raw warning
        checked = check_series(headers, "scan_000")
        index = index_generic(ds.image_dir, ds.labels_csv, ds.slice_labels_csv)
        build_cache(index, tmp_path / "cache", CacheParams(size=8), progress=False)
    assert checked.ordering == "instance_number"
    (entry,) = checked.warnings
    assert entry.bag_id == "scan_000" and entry.path == flat and "ordered by InstanceNumber" in entry.reason
    assert "1 of 4 slices" in entry.reason and "\n" not in entry.reason
    assert [w.reason for w in index.warnings] == [entry.reason]
    report = json.loads((tmp_path / "cache" / "skipped.json").read_text())
    assert [(w["bag_id"], os.path.basename(w["path"])) for w in report["warnings"]] == [("scan_000", os.path.basename(flat))]
