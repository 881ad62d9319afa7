"""Fault injection: what a real archive and its users do to the CT data path, and what must happen.

Every fault is built with pydicom from the synthetic phantoms (milgp.ct.synthetic) or pydicom's bundled
files. The outcome is always one of: a clear one-line error naming the file or bag, or a skip/refusal listed
in the report with the bag, the file and the reason -- and nothing lost or served wrong (the other bags stay
byte-identical, a damaged bag is rebuilt equal to the original).
"""
from __future__ import annotations

import fcntl
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.data import get_testdata_file
from pydicom.dataelem import RawDataElement
from pydicom.datadict import dictionary_VR, tag_for_keyword
from pydicom.tag import Tag
from pydicom.uid import generate_uid

import milgp.ct.cache_bag as cache_bag
import milgp.ct.dicom as dicom
import milgp.ct.hounsfield as hounsfield
from milgp.ct.cache import CacheCorruptError, CTCache, build_cache
from milgp.ct.cache_bag import bag_file_stem
from milgp.ct.cache_cli import main
from milgp.ct.cache_lock import LOCK_FILE_NAME, CacheLock, CacheLockedError
from milgp.ct.cache_params import CacheParams
from milgp.ct.cache_verify import verify_cache
from milgp.ct.dataset import CTBagDataset
from milgp.ct.index import BagIndex
from milgp.ct.series import load_series
from milgp.ct.series_check import SeriesRefused
from milgp.ct.dicom import DicomReadError, read_headers, read_slice_header, walk_files
from milgp.ct.generic_layout import index_generic
from milgp.ct.hounsfield import read_hu, read_slice_values
from milgp.ct.label_rule import LabelRule, parse_label_map
from milgp.ct.rsna import index_rsna
from milgp.ct.cq500 import index_cq500
from milgp.ct.series_policy import SeriesPolicy
from milgp.ct.synthetic import SyntheticDataset, write_cq500_dataset, write_generic_dataset

SIZE = ["--size", "8"]
pytestmark = pytest.mark.filterwarnings("ignore:Invalid value for VR")  # pydicom on the malformed files built here


# -- helpers ---------------------------------------------------------------------------------------


def _generic(root: Path, n_bags: int = 3, slices: int = 4, seed: int = 0) -> SyntheticDataset:
    """A small folder-per-bag dataset: ``n_bags`` bags of ``slices`` 16x16 slices, 5 mm apart."""
    return write_generic_dataset(root, n_bags=n_bags, slices=(slices, slices), size=16, seed=seed)


def _cache(ds: SyntheticDataset, out: Path, *extra: str, slice_labels: bool = True) -> tuple[int, dict]:
    """Run ``milgp-cache generic`` on ``ds``; returns the exit status and the skipped.json report."""
    args = ["generic", "--root", ds.image_dir, "--labels", ds.labels_csv, "--out", str(out), "--no-progress", *SIZE, *extra]
    if slice_labels:
        args += ["--slice-labels", ds.slice_labels_csv]
    rc = main(args)
    report_path = out / "skipped.json"
    return rc, json.loads(report_path.read_text()) if report_path.is_file() else {}


def _arrays(out: Path) -> dict[str, np.ndarray]:
    cache = CTCache(out)
    return {b: np.asarray(cache.load(b, mmap=False)) for b in cache.bag_ids}


def _reasons(report: dict, key: str, bag_id: str | None = None) -> list[str]:
    return [e["reason"] for e in report.get(key, []) if bag_id is None or e["bag_id"] == bag_id]


def _npy(out: Path, bag_id: str) -> Path:
    return out / "bags" / f"{bag_file_stem(bag_id)}.npy"


def _rewrite(path: str | Path, **changes) -> None:
    """Change header elements of a DICOM file in place (``None`` deletes the element)."""
    ds = pydicom.dcmread(path)
    for key, value in changes.items():
        if value is None:
            if key in ds:
                delattr(ds, key)
        else:
            setattr(ds, key, value)
    ds.save_as(path)


def _rewrite_raw(path: str | Path, keyword: str, text: str) -> None:
    """Write a text-valued element (IS, DS) exactly as ``text``, however malformed (``NumberOfFrames = "1A"``)."""
    ds = pydicom.dcmread(path)
    tag = tag_for_keyword(keyword)
    value = text.encode("ascii") + (b" " if len(text) % 2 else b"")
    ds[tag] = RawDataElement(Tag(tag), dictionary_VR(tag), len(value), value, 0, False, True)
    ds.save_as(path)


def _bundled(name: str) -> str:
    path = get_testdata_file(name, download=False)
    if path is None:
        pytest.skip(f"pydicom's bundled {name} is not installed here")
    return str(path)


def _splits(out: Path) -> set[str]:
    return {b for ids in json.loads((out / "splits.json").read_text()).values() for b in ids}


# -- one input never stops a batch -----------------------------------------------------------------


def test_bad_vr_header_is_a_reported_skip_not_an_abort(tmp_path: Path) -> None:
    """A slice with NumberOfFrames = "1A" (pydicom's badVR.dcm has the same fault) used to raise a bare
    ValueError that aborted milgp-cache naming no file. Now: read_hu names the file and the tag, and a batch
    skips it -- at indexing and, when the header goes bad after indexing, at caching -- and caches the rest
    byte-identical to a clean build."""
    with pytest.raises(DicomReadError, match=r"badVR\.dcm.*NumberOfFrames"):
        read_hu(_bundled("badVR.dcm"))
    ds = _generic(tmp_path / "gen")
    assert _cache(ds, tmp_path / "clean")[0] == 0
    clean = _arrays(tmp_path / "clean")
    victim = ds.scans[1].paths[2]
    _rewrite_raw(victim, "NumberOfFrames", "1A")
    rc, report = _cache(ds, tmp_path / "faulty")
    assert rc == 0
    assert any(e["path"] == victim and "NumberOfFrames" in e["reason"] for e in report["skipped_files"])
    faulty = _arrays(tmp_path / "faulty")
    for scan in (ds.scans[0], ds.scans[2]):
        np.testing.assert_array_equal(faulty[scan.bag_id], clean[scan.bag_id])
    np.testing.assert_array_equal(faulty[ds.scans[1].bag_id], np.delete(clean[ds.scans[1].bag_id], 2, axis=0))
    # the same fault appearing after indexing is caught while caching
    index = index_generic(ds.image_dir, ds.labels_csv)
    _rewrite_raw(ds.scans[0].paths[0], "NumberOfFrames", "2B")
    report = build_cache(index, tmp_path / "late", CacheParams(size=8), workers=0, progress=False)
    assert any(e.path == ds.scans[0].paths[0] and "NumberOfFrames" in e.reason for e in report.skipped_files)
    assert len(report.done) == 3 and not report.failed


def test_directory_in_place_of_a_bag_file_fails_only_that_bag(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A directory where a bag's .npy should go (any per-bag OSError) used to abort the whole build. Now that bag
    is reported failed naming the path and the error, every other bag is cached, and a rerun says the same."""
    ds = _generic(tmp_path / "gen")
    out = tmp_path / "cache"
    blocked = ds.scans[0].bag_id
    _npy(out, blocked).mkdir(parents=True)
    for _ in range(2):
        rc, report = _cache(ds, out, "--splits", "0.34,0.33,0.33")
        assert rc == 0
        [failed] = report["failed_bags"]
        assert failed["bag_id"] == blocked and "Is a directory" in failed["reason"] and bag_file_stem(blocked) in failed["path"]
        assert sorted(CTCache(out).bag_ids) == sorted(s.bag_id for s in ds.scans[1:])
        assert blocked not in _splits(out)
        err = capsys.readouterr().err
        assert "2 bags cached" in err and "1 failed" in err and "skipped.json" in err


def test_unexpected_exception_in_one_bag_is_a_failed_bag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception of any type while processing one bag (here MemoryError while windowing) must make that bag
    a failed bag with the reason, not end the build."""
    ds = _generic(tmp_path / "gen")
    index = index_generic(ds.image_dir, ds.labels_csv)
    victim = ds.scans[1].bag_id
    real = cache_bag.ct_channels
    calls = []

    def windows(values, *args):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("simulated")
        return real(values, *args)

    monkeypatch.setattr(cache_bag, "ct_channels", windows)
    report = build_cache(index, tmp_path / "c", CacheParams(size=8), workers=0, progress=False)
    assert [(e.bag_id, e.reason) for e in report.failed] == [(victim, "MemoryError: simulated")]
    assert len(report.done) == 2


def test_worker_killed_by_a_signal_costs_only_its_bag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder that crashes its worker process (SIGKILL, as a segfault or the OOM killer would) breaks a process
    pool; that must cost only the bag being processed: it is reported failed, every other bag is cached."""
    ds = _generic(tmp_path / "gen", n_bags=4)
    index = index_generic(ds.image_dir, ds.labels_csv)
    deadly = ds.scans[2].paths[1]
    parent = os.getpid()
    real = hounsfield.read_slice_values

    def crash_on(path, allow_non_ct):
        if path == deadly and os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, allow_non_ct)

    monkeypatch.setattr(hounsfield, "read_slice_values", crash_on)
    report = build_cache(index, tmp_path / "c", CacheParams(size=8), workers=2, progress=False)
    assert [e.bag_id for e in report.failed] == [ds.scans[2].bag_id] and "worker process died" in report.failed[0].reason
    assert sorted(report.done) == sorted(s.bag_id for s in ds.scans if s is not ds.scans[2])
    # a bag a dying pool's other worker had already written (its result lost with the pool) is found
    # on the retry; it was built by this run, so it is reported as done, never as reused
    assert report.reused == []


def test_a_bag_written_just_before_its_pool_broke_is_reported_as_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that writes its bag and dies before reporting it (the pool breaks: its result is lost) leaves a
    complete bag on disk; the retry finds it verified. The report must say the bag was built by this run (``done``),
    not reused from an earlier one, and nothing may be reported failed. If this fails, a build's report misstates
    what it wrote (a bag counted as reused that no earlier build made)."""
    ds = _generic(tmp_path / "gen", n_bags=3)
    index = index_generic(ds.image_dir, ds.labels_csv)
    victim, parent, flag = ds.scans[1].bag_id, os.getpid(), tmp_path / "died-once"
    real = cache_bag.process_bag

    def write_then_die(record, cache_dir, params):
        result = real(record, cache_dir, params)
        if record.bag_id == victim and os.getpid() != parent and not flag.exists():
            flag.touch()
            os.kill(os.getpid(), signal.SIGKILL)  # the bag is on disk; its result never reaches the parent
        return result

    monkeypatch.setattr(cache_bag, "process_bag", write_then_die)
    report = build_cache(index, tmp_path / "c", CacheParams(size=8), workers=2, progress=False)
    assert flag.exists() and report.failed == [] and report.reused == []
    assert sorted(report.done) == sorted(s.bag_id for s in ds.scans)
    rerun = build_cache(index, tmp_path / "c", CacheParams(size=8), workers=2, progress=False)
    assert sorted(rerun.reused) == sorted(s.bag_id for s in ds.scans) and rerun.done == []


def test_header_read_that_kills_its_worker_costs_only_that_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parallel header reading (indexing with --workers) must survive a file whose reading kills the worker: that
    file is skipped with the reason, every other header is read, in the given order."""
    ds = _generic(tmp_path / "gen", n_bags=2)
    paths = [p for s in ds.scans for p in s.paths]
    deadly = paths[5]
    parent = os.getpid()
    real = dicom.read_slice_header

    def crash_on(path):
        if path == deadly and os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path)

    monkeypatch.setattr(dicom, "read_slice_header", crash_on)
    headers, skipped = read_headers(paths, workers=2)
    assert [h.path for h in headers] == [p for p in paths if p != deadly]
    assert skipped == [(deadly, "reading this file killed the worker process (a crash in pydicom or out of memory)")]


def test_unreadable_file_is_skipped_naming_permission(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slice without read permission must be skipped with 'permission denied' and its path (not called corrupt);
    the bag is indexed and cached without it. (Tests run as root here, where chmod 000 does not stop reads, so the
    denial is also injected at the open call.)"""
    ds = _generic(tmp_path / "gen")
    victim = ds.scans[0].paths[1]
    os.chmod(victim, 0)
    real_dcmread = pydicom.dcmread

    def dcmread(path, *args, **kwargs):
        if str(path) == victim:
            raise PermissionError(13, "Permission denied", victim)
        return real_dcmread(path, *args, **kwargs)

    monkeypatch.setattr(pydicom, "dcmread", dcmread)
    with pytest.raises(DicomReadError, match="permission denied"):
        read_slice_header(victim)
    rc, report = _cache(ds, tmp_path / "c")
    assert rc == 0 and [e["path"] for e in report["skipped_files"]] == [victim]
    assert CTCache(tmp_path / "c").entry(ds.scans[0].bag_id).num_slices == 3


def test_symlink_loop_and_dangling_link_are_reported(tmp_path: Path) -> None:
    """A link loop inside a bag folder must not hang or duplicate files, a dangling link must be reported rather
    than silently dropped, and the bag is still indexed with all its real slices."""
    ds = _generic(tmp_path / "gen")
    folder = Path(ds.image_dir) / ds.scans[0].bag_id
    (folder / "sub").mkdir()
    os.symlink(folder, folder / "sub" / "loop")
    os.symlink(folder / "gone.dcm", folder / "dangling.dcm")
    files, problems = walk_files(folder)
    assert sorted(files) == sorted(ds.scans[0].paths)
    kinds = sorted(p.reason.split(" ")[0] for p in problems)
    assert kinds == ["dangling", "link"]
    index = index_generic(ds.image_dir, ds.labels_csv, ds.slice_labels_csv)
    assert index.bag_ids == [s.bag_id for s in ds.scans]
    assert {e.path for e in index.skipped} == {str(folder / "sub" / "loop"), str(folder / "dangling.dcm")}


def test_non_utf8_file_name_is_indexed_cached_and_printed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A slice whose file name is not valid UTF-8 (old archives) must be indexed and cached like any other, the
    index must round-trip through JSON and CSV, and printing a report that names it must not crash."""
    ds = _generic(tmp_path / "gen")
    folder = os.fsencode(Path(ds.image_dir) / ds.scans[0].bag_id)
    odd = os.fsdecode(folder + b"/\xff\xfe-slice.dcm")
    os.rename(ds.scans[0].paths[0], odd)
    Path(ds.scans[0].paths[1]).write_bytes(b"junk")  # so that the odd name is printed next to a skip
    os.rename(ds.scans[0].paths[1], os.fsdecode(folder + b"/\xff-junk.dcm"))
    rc, report = _cache(ds, tmp_path / "c", slice_labels=False)
    assert rc == 0
    index = BagIndex.load(tmp_path / "c" / "index.json")
    assert odd in index.bags[0].slice_paths
    index.save(tmp_path / "index.csv")
    assert BagIndex.load(tmp_path / "index.csv").bags[0].slice_paths == index.bags[0].slice_paths
    assert CTCache(tmp_path / "c").entry(ds.scans[0].bag_id).num_slices == 3
    assert "\\xff-junk.dcm" in capsys.readouterr().out


@pytest.mark.parametrize("content", ["empty", "junk"])
def test_bag_folder_without_a_readable_slice_is_refused(tmp_path: Path, content: str) -> None:
    """A listed bag whose folder is empty or holds no readable DICOM must be refused and reported naming the bag
    (and a file), never in the manifest or splits; the other bags are cached."""
    ds = _generic(tmp_path / "gen")
    folder = Path(ds.image_dir) / ds.scans[1].bag_id
    shutil.rmtree(folder)
    folder.mkdir()
    if content == "junk":
        (folder / "a.dcm").write_bytes(b"\x00" * 200)
    rc, report = _cache(ds, tmp_path / "c", "--splits", "0.34,0.33,0.33", slice_labels=False)
    assert rc == 0
    [refused] = report["refused_bags"]
    assert refused["bag_id"] == ds.scans[1].bag_id and "no readable DICOM image" in refused["reason"]
    assert ds.scans[1].bag_id not in CTCache(tmp_path / "c").bag_ids and ds.scans[1].bag_id not in _splits(tmp_path / "c")


def test_mixed_image_sizes_refuse_the_bag_naming_both_files(tmp_path: Path) -> None:
    """A series with slices of different rows/columns must be refused naming a file of each size, not resized."""
    ds = _generic(tmp_path / "gen")
    odd = ds.scans[0].paths[3]
    _rewrite(odd, Rows=8, Columns=12, PixelData=np.zeros((8, 12), "<i2").tobytes())
    index = index_generic(ds.image_dir, ds.labels_csv)
    assert index.bag_ids == [s.bag_id for s in ds.scans[1:]]
    assert "inconsistent image sizes" in index.refused[0].reason and odd in index.refused[0].reason


def test_mixed_pixel_spacings_refuse_the_bag_naming_both_files(tmp_path: Path) -> None:
    """A slice of the same size but another PixelSpacing (another field of view) was accepted and
    resized with the others, showing the anatomy at two scales in one scan; it must be refused like
    mixed sizes, naming a file of each spacing (rounding in the last digits of the tag is no difference)."""
    ds = _generic(tmp_path / "gen")
    spacing = [float(v) for v in pydicom.dcmread(ds.scans[0].paths[0]).PixelSpacing]
    odd = ds.scans[0].paths[2]
    _rewrite(odd, PixelSpacing=[2 * spacing[0], 2 * spacing[1]])
    _rewrite(ds.scans[1].paths[1], PixelSpacing=[spacing[0] * (1 + 1e-6), spacing[1]])
    index = index_generic(ds.image_dir, ds.labels_csv)
    assert index.bag_ids == [s.bag_id for s in ds.scans[1:]]
    assert "inconsistent pixel spacing" in index.refused[0].reason and odd in index.refused[0].reason
    with pytest.raises(SeriesRefused, match="inconsistent pixel spacing"):
        load_series(Path(ds.image_dir) / ds.scans[0].bag_id)


def test_slices_without_a_series_uid_are_read_with_a_warning(tmp_path: Path) -> None:
    """Without SeriesInstanceUID (a required tag) two series in one folder cannot be told apart and
    were merged into one volume without a word; the series is still read, with one warning saying so."""
    ds = _generic(tmp_path / "gen")
    for p in ds.scans[0].paths:
        _rewrite(p, SeriesInstanceUID="")
    with pytest.warns(UserWarning, match=r"4 of 4 slices have no SeriesInstanceUID: taken as one series"):
        series = load_series(Path(ds.image_dir) / ds.scans[0].bag_id)
    assert series.paths == list(ds.scans[0].paths)


# -- labels ----------------------------------------------------------------------------------------


def _with_labels(ds: SyntheticDataset, labels: dict[str, str], path: Path) -> SyntheticDataset:
    rows = ["bag_id,label,patient_id"] + [f"{s.bag_id},{labels.get(s.bag_id, int(s.bag_label))},{s.patient_id}" for s in ds.scans]
    path.write_text("\n".join(rows) + "\n")
    return SyntheticDataset(ds.layout, ds.root, ds.image_dir, str(path), ds.scans, ds.slice_labels_csv)


@pytest.mark.parametrize("bad", ["2", "-1", "0.5", "nan", "inf", "yes", ""])
def test_invalid_mil_labels_are_refused_and_never_half_present(tmp_path: Path, bad: str) -> None:
    """Labels 2, -1, 0.5 used to be trained on, and 'nan' dropped the bag from the manifest but not from
    splits.json (KeyError in training). Now such a bag is refused at indexing, named with the file and line, and
    is in neither the manifest nor splits.json; the run succeeds for the others."""
    ds = _generic(tmp_path / "gen", n_bags=4)
    victim = ds.scans[2].bag_id
    ds = _with_labels(ds, {victim: bad}, tmp_path / "labels.csv")
    rc, report = _cache(ds, tmp_path / "c", "--splits", "0.5,0.25,0.25", slice_labels=False)
    assert rc == 0
    [refused] = report["refused_bags"]
    assert refused["bag_id"] == victim and "labels.csv, line 4" in refused["reason"]
    assert victim not in CTCache(tmp_path / "c").bag_ids and victim not in _splits(tmp_path / "c")
    assert _splits(tmp_path / "c") == set(CTCache(tmp_path / "c").bag_ids)
    for split in ("train", "val", "test"):
        CTBagDataset.from_split(tmp_path / "c", split)  # no KeyError


def test_label_map_and_aggregate_targets(tmp_path: Path) -> None:
    """--label-map yes=1,no=0 must accept that encoding (and still refuse 'maybe'); aggregate targets accept finite
    non-negative numbers (2.5) and refuse negative and infinite ones; a MIL map to 2 is refused up front."""
    ds = _generic(tmp_path / "gen", n_bags=3)
    ids = [s.bag_id for s in ds.scans]
    yes_no = _with_labels(ds, {ids[0]: "yes", ids[1]: "NO", ids[2]: "maybe"}, tmp_path / "yn.csv")
    index = index_generic(yes_no.image_dir, yes_no.labels_csv, rule=LabelRule(mapping=parse_label_map("yes=1,no=0")))
    assert [(b.bag_id, b.bag_label) for b in index.bags] == [(ids[0], 1.0), (ids[1], 0.0)]
    assert "'maybe' is not a number or one of ['no', 'yes']" in index.refused[0].reason
    counts = _with_labels(ds, {ids[0]: "2.5", ids[1]: "-1", ids[2]: "inf"}, tmp_path / "agg.csv")
    index = index_generic(counts.image_dir, counts.labels_csv, rule=LabelRule("aggregate"))
    assert [(b.bag_id, b.bag_label) for b in index.bags] == [(ids[0], 2.5)]
    assert ["non-negative" in index.refused[0].reason, "finite" in index.refused[1].reason] == [True, True]
    with pytest.raises(ValueError, match="must be 0 or 1"):
        LabelRule(mapping={"severe": 2})
    with pytest.raises(SystemExit):  # argparse: "label map item 'yes' is not TEXT=NUMBER"
        main(["generic", "--root", ds.image_dir, "--labels", ds.labels_csv, "--out", str(tmp_path / "x"), "--label-map", "yes"])


def test_label_csv_faults(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Duplicate bag rows: identical ones merge, conflicting ones refuse the bag naming both lines. A missing
    column or a non-UTF-8 file is a one-line error naming the file (exit 1, nothing written); an Excel BOM and
    spaces around column names are accepted; a short row refuses its bag ('empty label')."""
    ds = _generic(tmp_path / "gen", n_bags=3)
    ids = [s.bag_id for s in ds.scans]
    text = Path(ds.labels_csv).read_text().splitlines()
    dup = tmp_path / "dup.csv"
    dup.write_text("\n".join(text + [text[1], f"{ids[1]},{1 - int(ds.scans[1].bag_label)},{ds.scans[1].patient_id}"]) + "\n")
    index = index_generic(ds.image_dir, dup)
    assert index.bag_ids == [ids[0], ids[2]]
    assert "listed twice with different values (lines 3 and 6)" in index.refused[0].reason
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + " bag_id , label ,patient_id\n".encode() + "\n".join(text[1:-1] + [ids[2]]).encode() + b"\n")
    index = index_generic(ds.image_dir, bom)
    assert index.bag_ids == ids[:2] and "empty label" in index.refused[0].reason
    for name, content, message in [
        ("nolabel.csv", "bag_id,target\nscan_000,1\n", r"nolabel\.csv: missing columns \['label'\]"),
        ("latin1.csv", "bag_id,label\nscan_00\xe9,1\n".encode("latin-1"), r"latin1\.csv: not UTF-8 text"),
    ]:
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        assert main(["generic", "--root", ds.image_dir, "--labels", str(path), "--out", str(tmp_path / name[:-4]),
                     "--no-progress"]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and re.search(message, err), err
        assert not (tmp_path / name[:-4]).exists()


def test_rsna_and_cq500_invalid_labels_refuse_one_bag(tmp_path: Path, rsna_copy: SyntheticDataset) -> None:
    """An RSNA 'any' label of 2 refuses that image's series (named with the file and line), not the whole label
    file; a CQ500 read that is not 0/1 refuses that study. Every other bag is indexed."""
    lines = Path(rsna_copy.labels_csv).read_text().splitlines()
    image = Path(rsna_copy.scans[3].paths[0]).stem
    k = next(i for i, line in enumerate(lines) if line.startswith(f"{image}_any,"))
    lines[k] = f"{image}_any,2"
    Path(rsna_copy.labels_csv).write_text("\n".join(lines) + "\n")
    index = index_rsna(rsna_copy.image_dir, rsna_copy.labels_csv)
    assert sorted(index.bag_ids) == sorted(s.bag_id for s in rsna_copy.scans if s is not rsna_copy.scans[3])
    assert index.refused[0].bag_id == rsna_copy.scans[3].bag_id and f"line {k + 1}: {image}_any: label '2'" in index.refused[0].reason
    cq = write_cq500_dataset(tmp_path / "cq", n_studies=2, slices=(3, 3), size=16, seed=1)
    reads = Path(cq.labels_csv).read_text().splitlines()
    reads[2] = reads[2].replace(",0,", ",x,", 1).replace(",1,", ",x,", 1)
    Path(cq.labels_csv).write_text("\n".join(reads) + "\n")
    index = index_cq500(cq.image_dir, cq.labels_csv)
    assert index.bag_ids == ["CQ500-CT-0"] and index.refused[0].bag_id == "CQ500-CT-1" and "'x'" in index.refused[0].reason


# -- a cache that verifies itself ----------------------------------------------------------------------


@pytest.fixture
def built(tmp_path: Path) -> tuple[SyntheticDataset, Path, dict[str, np.ndarray]]:
    """A generic dataset of four 4-slice bags cached with splits, and the arrays of that clean build."""
    ds = _generic(tmp_path / "gen", n_bags=4)
    out = tmp_path / "cache"
    assert _cache(ds, out, "--splits", "0.5,0.25,0.25")[0] == 0
    return ds, out, _arrays(out)


def _mtimes(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (out / "bags").iterdir()}


def test_random_bytes_over_a_bag_are_detected_and_rebuilt(built, capsys: pytest.CaptureFixture) -> None:
    """Random bytes over a bag's pixels (same file size, header intact) used to be served and trained on. verify
    must report the checksum mismatch (exit 1); a rerun must rebuild that bag, report it as rebuilt, make it equal
    to the original, and leave every other bag's files untouched."""
    ds, out, clean = built
    victim = ds.scans[1].bag_id
    path = _npy(out, victim)
    data = bytearray(path.read_bytes())
    pixels = clean[victim].nbytes
    data[-pixels:] = np.random.default_rng(0).integers(0, 256, pixels, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))
    assert main(["verify", str(out)]) == 1
    assert "does not match its checksum" in capsys.readouterr().out
    before = _mtimes(out)
    rc, report = _cache(ds, out)
    assert rc == 0 and [e["bag_id"] for e in report["rebuilt_bags"]] == [victim]
    assert "checksum" in report["rebuilt_bags"][0]["reason"]
    after = _mtimes(out)
    assert {k for k in after if after[k] != before[k]} == {f"{bag_file_stem(victim)}.npy", f"{bag_file_stem(victim)}.json"}
    arrays = _arrays(out)
    assert all(np.array_equal(arrays[b], clean[b]) for b in clean)
    assert main(["verify", str(out)]) == 0


def test_swapped_truncated_and_emptied_arrays_are_named_at_training_and_rebuilt(built) -> None:
    """Another scan's array swapped in, a truncated and an emptied .npy used to crash training mid-epoch with
    'mmap length is greater than file size' (no path) and to be 'reused' by a rerun. Now opening such a bag raises
    CacheCorruptError naming the bag and the file, and a rerun rebuilds all three equal to the original."""
    ds, out, clean = built
    a, b, c, d = (s.bag_id for s in ds.scans)
    other = np.load(_npy(out, d))
    np.save(_npy(out, a), np.concatenate([other, other[:1]]))  # another scan's array (one slice more)
    _npy(out, b).write_bytes(_npy(out, b).read_bytes()[:-100])
    _npy(out, c).write_bytes(b"")
    dataset = CTBagDataset(out)
    for bag_id, message in [(a, "shape"), (b, "truncated"), (c, "empty file")]:
        with pytest.raises(CacheCorruptError, match=rf"cached bag '{bag_id}': .*{bag_file_stem(bag_id)}\.npy: .*{message}.*verify"):
            dataset[dataset.bag_ids.index(bag_id)]
    rc, report = _cache(ds, out)
    assert rc == 0 and sorted(e["bag_id"] for e in report["rebuilt_bags"]) == sorted([a, b, c])
    arrays = _arrays(out)
    assert all(np.array_equal(arrays[k], clean[k]) for k in clean)


def test_same_shape_swap_is_caught_by_the_checksum(built) -> None:
    """Another bag's array of the same shape passes every size check; the checksum must catch it: verify
    --repair rebuilds it equal to the original."""
    ds, out, clean = built
    a, b = ds.scans[0].bag_id, ds.scans[1].bag_id
    shutil.copy(_npy(out, b), _npy(out, a))
    report = verify_cache(out)
    assert [(e.bag_id, "checksum" in e.reason) for e in report.problems] == [(a, True)]
    repaired = verify_cache(out, repair=True)
    assert repaired.ok and any(a in line for line in repaired.actions)
    assert np.array_equal(_arrays(out)[a], clean[a])


def test_truncated_manifest_is_a_one_line_error_and_repairable(built, capsys: pytest.CaptureFixture) -> None:
    """A truncated manifest.json used to give a bare JSONDecodeError naming no file. Now opening the cache is a
    one-line CacheCorruptError naming the file and the repair command; verify --repair rewrites it from the
    recorded index, reusing every bag (nothing recomputed)."""
    ds, out, clean = built
    manifest = out / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    with pytest.raises(CacheCorruptError, match=r"manifest\.json: unreadable manifest .*milgp-cache verify"):
        CTBagDataset(out)
    assert main(["verify", str(out), "--repair"]) == 0
    assert "repaired" in capsys.readouterr().err
    assert sorted(CTCache(out).bag_ids) == sorted(clean) and all(np.array_equal(_arrays(out)[k], clean[k]) for k in clean)
    (out / "params.json").write_text("{")
    with pytest.raises(ValueError, match=r"params\.json: unreadable cache parameters"):
        CTCache(out)


def test_stale_source_is_rebuilt_and_gone_source_keeps_the_cached_copy(built) -> None:
    """A source DICOM changed after caching used to be reused silently. Now the rerun rebuilds that bag from the
    new file and says which file changed. A source that is gone is not a reason to drop the only copy left: the
    verified cached bag is kept, with a warning."""
    ds, out, clean = built
    changed = ds.scans[2].paths[1]
    ds_ = pydicom.dcmread(changed)
    ds_.PixelData = np.full((16, 16), 1024 + 60, "<i2").tobytes()  # 60 HU everywhere
    ds_.save_as(changed)
    rc, report = _cache(ds, out)
    [rebuilt] = report["rebuilt_bags"]
    assert rebuilt["bag_id"] == ds.scans[2].bag_id and rebuilt["path"] == changed and "changed since" in rebuilt["reason"]
    arrays = _arrays(out)
    assert not np.array_equal(arrays[ds.scans[2].bag_id], clean[ds.scans[2].bag_id])
    assert np.all(arrays[ds.scans[2].bag_id][1, 0] == 191)  # brain window (40, 80): 60 HU -> 0.75 -> 191 of 255
    os.unlink(ds.scans[3].paths[0])
    index = BagIndex.load(out / "index.json")
    report = build_cache(index, out, CacheParams(size=8), workers=0, progress=False)
    assert ds.scans[3].bag_id in report.reused and not report.rebuilt
    assert any(w.bag_id == ds.scans[3].bag_id and "cached copy" in w.reason for w in report.warnings)
    assert np.array_equal(_arrays(out)[ds.scans[3].bag_id], clean[ds.scans[3].bag_id])


def test_damaged_marker_is_rebuilt(built) -> None:
    """A truncated per-bag marker must make the bag be rebuilt (reported), not crash the rerun or be reused."""
    ds, out, clean = built
    marker = _npy(out, ds.scans[0].bag_id).with_suffix(".json")
    marker.write_text(marker.read_text()[:30])
    rc, report = _cache(ds, out)
    assert rc == 0 and [e["bag_id"] for e in report["rebuilt_bags"]] == [ds.scans[0].bag_id]
    assert "marker unreadable" in report["rebuilt_bags"][0]["reason"]
    assert np.array_equal(_arrays(out)[ds.scans[0].bag_id], clean[ds.scans[0].bag_id])


def test_verify_repair_drops_what_cannot_be_rebuilt_from_manifest_and_splits(built) -> None:
    """A corrupt bag whose sources are gone cannot be rebuilt: --repair must take it out of the manifest and
    splits.json (so training never sees it) and report it; a splits.json naming an unknown bag is fixed too."""
    ds, out, clean = built
    victim = ds.scans[0].bag_id
    _npy(out, victim).write_bytes(b"\x00" * 10)
    for p in ds.scans[0].paths:
        os.unlink(p)
    splits = json.loads((out / "splits.json").read_text())
    splits["train"].append("ghost")
    (out / "splits.json").write_text(json.dumps(splits))
    found = verify_cache(out)
    assert {e.bag_id for e in found.problems} == {victim, "ghost"} and not found.ok
    repaired = verify_cache(out, repair=True)
    assert repaired.ok, repaired.summary()
    assert victim not in CTCache(out).bag_ids and victim not in _splits(out) and "ghost" not in _splits(out)
    assert any("cannot be rebuilt" in a and victim in a for a in repaired.actions)


def test_verify_without_index_json_refuses_a_marker_that_lacks_a_field(built) -> None:
    """Without index.json, verify rebuilds its index from the per-bag markers. A marker that lacks one of the
    fields every marker writes (here the slice ordering) is damaged: it must be reported, not read with a
    guessed default, while the intact markers still give their bags."""
    ds, out, clean = built
    (out / "index.json").unlink()
    assert verify_cache(out).ok
    victim = ds.scans[1].bag_id
    marker = _npy(out, victim).with_suffix(".json")
    meta = json.loads(marker.read_text())
    del meta["ordering"]
    marker.write_text(json.dumps(meta))
    found = verify_cache(out)
    assert {e.bag_id for e in found.problems} == {victim} and not found.ok
    assert any("cannot be rebuilt" in e.reason and "ordering" in e.reason for e in found.problems)


def test_cache_outputs_respect_the_umask(tmp_path: Path) -> None:
    """Cache files (arrays, markers, manifest, report, index) must be created 0o666 & ~umask, not 0o600."""
    ds = _generic(tmp_path / "gen", n_bags=1)
    old = os.umask(0o002)
    try:
        assert _cache(ds, tmp_path / "c")[0] == 0
    finally:
        os.umask(old)
    files = [p for p in (tmp_path / "c").rglob("*") if p.is_file()]
    assert len(files) >= 6 and all(p.stat().st_mode & 0o777 == 0o664 for p in files), [oct(p.stat().st_mode) for p in files]


# -- one writer at a time; workers die with their parent ---------------------------------------------


_HOLD_LOCK = textwrap.dedent(
    """
    import sys, time
    from milgp.ct.cache_lock import CacheLock
    with CacheLock(sys.argv[1]):
        print("locked", flush=True)
        time.sleep(float(sys.argv[2]))
    """
)


def _python(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE, text=True, **kwargs)


def test_second_writer_is_refused_or_waits_and_a_stale_lock_is_taken_over(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A second build started while the first runs used to delete the first writer's temporary files. Now it is
    refused naming the lock file and the PID holding it (exit 1, nothing written), or waits with --wait; a lock
    left by a dead process is taken over and reported."""
    ds = _generic(tmp_path / "gen", n_bags=1)
    out = tmp_path / "cache"
    holder = _python("-c", _HOLD_LOCK, str(out), "2.5")
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CacheLockedError, match=rf"{LOCK_FILE_NAME}: the cache is being written by PID {holder.pid}"):
            build_cache(index_generic(ds.image_dir, ds.labels_csv), out, CacheParams(size=8), workers=0, progress=False)
        assert _cache(ds, out)[0] == 1
        assert f"PID {holder.pid}" in capsys.readouterr().err
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE_NAME]
        start = time.monotonic()
        assert _cache(ds, out, "--wait")[0] == 0
        assert time.monotonic() - start > 0.5 and f"waiting for PID {holder.pid}" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    dead = _python("-c", "pass")
    dead.wait()
    (out / LOCK_FILE_NAME).write_text(json.dumps({"pid": dead.pid, "host": "h", "started": "t"}))
    with CacheLock(out) as lock:
        assert f"left by PID {dead.pid}" in lock.took_over
        with CacheLock(out):  # re-entrant in the holding process
            pass
        assert (out / LOCK_FILE_NAME).exists()
    assert not (out / LOCK_FILE_NAME).exists()


_KILLED_PARENT = textwrap.dedent(
    """
    import os, sys, time
    import milgp.ct.hounsfield as hounsfield
    from milgp.ct.cache import CacheParams, build_cache
    from milgp.ct.generic_layout import index_generic

    def stall(path, allow_non_ct):
        open(os.path.join(sys.argv[3], str(os.getpid())), "w").close()
        time.sleep(120)

    hounsfield.read_slice_values = stall
    build_cache(index_generic(sys.argv[1], sys.argv[2]), sys.argv[4], CacheParams(size=8), workers=2, progress=False)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="checks /proc")
def test_pool_workers_die_with_a_killed_parent(tmp_path: Path) -> None:
    """After SIGKILL of a `--workers 2` build, both pool workers used to stay alive (and keep writing into a cache a
    rerun was about to rebuild). They must die with their parent."""
    ds = _generic(tmp_path / "gen", n_bags=2)
    pids = tmp_path / "pids"
    pids.mkdir()
    parent = _python("-c", _KILLED_PARENT, ds.image_dir, ds.labels_csv, str(pids), str(tmp_path / "cache"))
    try:
        deadline = time.monotonic() + 60
        while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.05)
        workers = [int(p.name) for p in pids.iterdir()]
        assert len(workers) == 2 and all(_alive(w) for w in workers)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(w) for w in workers)


# -- series sanity -----------------------------------------------------------------------------------


def _copy_at(src: str, dst: Path, **changes) -> str:
    shutil.copy(src, dst)
    if changes:
        _rewrite(dst, **changes)
    return str(dst)


def test_duplicate_slices_are_kept_once_and_reported(tmp_path: Path) -> None:
    """A byte-identical copy of a slice, and a re-sent slice with a new SOPInstanceUID but identical pixels, must be
    kept once and reported as duplicates; the cached bag equals the clean one."""
    ds = _generic(tmp_path / "gen")
    assert _cache(ds, tmp_path / "clean", slice_labels=False)[0] == 0
    folder = Path(ds.image_dir) / ds.scans[0].bag_id
    copy = _copy_at(ds.scans[0].paths[1], folder / "copy.dcm")
    resent = _copy_at(ds.scans[0].paths[2], folder / "resent.dcm", SOPInstanceUID=generate_uid())
    rc, report = _cache(ds, tmp_path / "c", slice_labels=False)
    assert rc == 0
    reasons = {e["path"]: e["reason"] for e in report["skipped_files"]}
    assert len(reasons) == 2 and all("identical pixel data; one kept" in r for r in reasons.values())
    assert len(set(reasons) & {copy, ds.scans[0].paths[1]}) == 1 and len(set(reasons) & {resent, ds.scans[0].paths[2]}) == 1
    assert sum("same SOPInstanceUID" in r for r in reasons.values()) == 1
    np.testing.assert_array_equal(_arrays(tmp_path / "c")[ds.scans[0].bag_id], _arrays(tmp_path / "clean")[ds.scans[0].bag_id])


def test_different_images_at_one_position_refuse_the_bag(tmp_path: Path) -> None:
    """Two different images at the same position cannot both belong to one scan: the bag must be refused naming
    both files, not silently keep one of them."""
    ds = _generic(tmp_path / "gen")
    folder = Path(ds.image_dir) / ds.scans[0].bag_id
    other = _copy_at(ds.scans[0].paths[1], folder / "other.dcm", SOPInstanceUID=generate_uid(),
                     PixelData=np.full((16, 16), 1100, "<i2").tobytes())
    index = index_generic(ds.image_dir, ds.labels_csv)
    assert ds.scans[0].bag_id not in index.bag_ids
    assert "two different images at the same position" in index.refused[0].reason and "other.dcm" in index.refused[0].reason


def test_interleaved_acquisitions_are_refused_but_sequential_ones_kept(tmp_path: Path, ct5n_dir: str) -> None:
    """A second acquisition interleaved in one series (AcquisitionNumber 2 over the same z range; or, with one
    AcquisitionNumber, slices offset between the first stack's ones) must be refused. Sequential acquisitions
    covering disjoint z ranges (pydicom's CT5N: acquisitions 1 and 2) are ordinary head CT and must load."""
    assert len(load_series(ct5n_dir).paths) == 5
    for offset, acquisition in [(2.5, "2"), (1.0, None)]:
        ds = _generic(tmp_path / f"gen{offset}", slices=6)
        folder = Path(ds.image_dir) / ds.scans[0].bag_id
        for k, path in enumerate(ds.scans[0].paths):
            ipp = pydicom.dcmread(path, stop_before_pixels=True).ImagePositionPatient
            extra = {"AcquisitionNumber": acquisition} if acquisition else {}
            _copy_at(path, folder / f"second{k}.dcm", SOPInstanceUID=generate_uid(),
                     ImagePositionPatient=[ipp[0], ipp[1], float(ipp[2]) + offset], **extra)
        if acquisition:
            for path in ds.scans[0].paths:
                _rewrite(path, AcquisitionNumber="1")
        index = index_generic(ds.image_dir, ds.labels_csv)
        assert ds.scans[0].bag_id not in index.bag_ids
        assert ("two acquisitions interleaved" if acquisition else "spacing alternates") in index.refused[0].reason


def test_gap_is_a_warning_in_the_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A missing slice (a 10 mm gap in a 5 mm series) must be reported as a warning naming the slice after the
    gap; the bag is cached with the slices it has."""
    ds = _generic(tmp_path / "gen", slices=6)
    os.unlink(ds.scans[1].paths[3])
    rc, report = _cache(ds, tmp_path / "c", slice_labels=False)
    assert rc == 0
    [gap] = report["warnings"]
    assert gap["bag_id"] == ds.scans[1].bag_id and gap["path"] == ds.scans[1].paths[4] and "gap of 10.00 mm" in gap["reason"]
    assert "1 warnings" in capsys.readouterr().err
    with pytest.warns(UserWarning, match="gap of 10.00 mm"):
        load_series(Path(ds.image_dir) / ds.scans[1].bag_id)


def test_sagittal_series_is_refused_unless_allowed(tmp_path: Path) -> None:
    """A sagittal series (slice normal along x) used to be cached as an axial CT bag. It must be refused with the
    angle in the reason, and accepted with --allow-non-axial."""
    ds = _generic(tmp_path / "gen")
    for k, path in enumerate(ds.scans[0].paths):
        _rewrite(path, ImageOrientationPatient=[0, 1, 0, 0, 0, -1], ImagePositionPatient=[5.0 * k, -125, 125])
    index = index_generic(ds.image_dir, ds.labels_csv)
    assert ds.scans[0].bag_id not in index.bag_ids and "90 degrees from the patient z axis" in index.refused[0].reason
    assert ds.scans[0].bag_id in index_generic(ds.image_dir, ds.labels_csv, policy=SeriesPolicy(allow_non_axial=True)).bag_ids


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("MR_small.dcm", "Modality 'MR', not CT"),
        ("examples_palette.dcm", "PALETTE COLOR"),
        ("liver_1frame.dcm", "Modality 'SEG', not CT"),
        ("rtdose_1frame.dcm", "Modality 'RTDOSE', not CT"),
        ("badVR.dcm", "NumberOfFrames"),
    ],
)
def test_non_ct_bundled_files_are_refused_with_the_reason(tmp_path: Path, name: str, reason: str) -> None:
    """MR, palette-colour ultrasound, segmentation and RT-dose objects used to be cached as axial CT bags. A bag
    folder holding one must be refused, the reason naming the modality or the fault; the other bags are cached."""
    ds = _generic(tmp_path / "gen")
    folder = Path(ds.image_dir) / ds.scans[0].bag_id
    shutil.rmtree(folder)
    folder.mkdir()
    shutil.copy(_bundled(name), folder / name)
    rc, report = _cache(ds, tmp_path / "c", slice_labels=False)
    assert rc == 0
    [refused] = report["refused_bags"]
    assert refused["bag_id"] == ds.scans[0].bag_id and reason in refused["reason"], refused
    assert sorted(CTCache(tmp_path / "c").bag_ids) == sorted(s.bag_id for s in ds.scans[1:])


def test_nuclear_medicine_and_localizer_and_secondary_capture_are_left_out(tmp_path: Path) -> None:
    """An NM image (built from a synthetic slice), a secondary-capture screenshot labelled CT, and a localizer
    (scout) inside a CT series must each be left out with the reason; the CT slices of the series are cached."""
    ds = _generic(tmp_path / "gen")
    folder = Path(ds.image_dir) / ds.scans[0].bag_id
    src = ds.scans[0].paths[0]
    nm = _copy_at(src, folder / "nm.dcm", Modality="NM", SOPInstanceUID=generate_uid(), ImagePositionPatient=[-125, -125, 2.5])
    sc = _copy_at(src, folder / "sc.dcm", SOPClassUID="1.2.840.10008.5.1.4.1.1.7", SOPInstanceUID=generate_uid(),
                  ImagePositionPatient=[-125, -125, 7.5])
    scout = _copy_at(src, folder / "scout.dcm", ImageType=["ORIGINAL", "PRIMARY", "LOCALIZER"], SOPInstanceUID=generate_uid(),
                     ImageOrientationPatient=[0, 1, 0, 0, 0, -1])
    index = index_generic(ds.image_dir, ds.labels_csv)
    reasons = {e.path: e.reason for e in index.skipped}
    assert "Modality 'NM', not CT" in reasons[nm] and "Secondary Capture" in reasons[sc] and "localizer" in reasons[scout]
    assert index.bags[0].slice_paths == ds.scans[0].paths


def test_a_localizer_of_another_series_does_not_name_the_scan(tmp_path: Path) -> None:
    """A localizer exported into the scan's folder under its own SeriesInstanceUID is left out, and the
    series read must carry the scan's UID; with the localizer's (its file sorted first) predictions and
    reports would name a series that was never read."""
    ds = _generic(tmp_path / "gen")
    folder = Path(ds.image_dir) / ds.scans[0].bag_id
    _copy_at(ds.scans[0].paths[0], folder / "0_scout.dcm", ImageType=["ORIGINAL", "PRIMARY", "LOCALIZER"], SOPInstanceUID=generate_uid(),
             SeriesInstanceUID="9.9.9", ImageOrientationPatient=[0, 1, 0, 0, 0, -1])
    series = load_series(folder)
    assert series.paths == list(ds.scans[0].paths) and series.series_uid == pydicom.dcmread(ds.scans[0].paths[0]).SeriesInstanceUID != "9.9.9"


def test_mr_values_are_never_called_hu(bundled) -> None:
    """read_hu must refuse an MR image (its values are not Hounsfield units); accepted explicitly, its series says
    so in its units, and a cache built from it records the same."""
    with pytest.raises(DicomReadError, match=r"MR_small\.dcm: Modality 'MR', not CT: pixel values are not Hounsfield units"):
        read_hu(bundled("MR_small.dcm"))
    values = read_slice_values(bundled("MR_small.dcm"), allow_non_ct=True)
    assert values.units != "HU" and "not HU" in values.units
    with pytest.warns(UserWarning, match="RescaleSlope/RescaleIntercept missing"):  # MR_small has no rescale tags
        series = load_series([bundled("MR_small.dcm")], policy=SeriesPolicy(allow_non_ct=True))
    assert series.units == values.units
    with pytest.raises(ValueError, match="Modality 'MR'"):
        load_series([bundled("MR_small.dcm")])


def test_mr_bag_accepted_explicitly_is_recorded_as_not_hu(tmp_path: Path, bundled) -> None:
    """With --allow-non-ct an MR bag is cached, and the manifest says its values are not HU."""
    ds = _generic(tmp_path / "gen")
    folder = Path(ds.image_dir) / ds.scans[0].bag_id
    shutil.rmtree(folder)
    folder.mkdir()
    shutil.copy(bundled("MR_small.dcm"), folder / "mr.dcm")
    rc, _ = _cache(ds, tmp_path / "c", "--allow-non-ct", slice_labels=False)
    assert rc == 0
    cache = CTCache(tmp_path / "c")
    assert cache.entry(ds.scans[0].bag_id).units.startswith("MR") and cache.entry(ds.scans[1].bag_id).units == "HU"


# -- values --------------------------------------------------------------------------------------------


def _faulty_12bit(src: str, dst: Path, true_hu: np.ndarray) -> str:
    """An RSNA-style faulty slice: stored = true HU mod 4096, BitsStored 12, unsigned, intercept 0."""
    ds = pydicom.dcmread(src)
    raw = np.mod(np.rint(true_hu).astype(np.int32), 4096).astype(np.uint16)
    ds.Rows, ds.Columns = raw.shape
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
    ds.RescaleIntercept, ds.RescaleSlope = "0", "1"
    ds.PixelData = raw.tobytes()
    ds.save_as(dst)
    return str(dst)


def test_12bit_repair_keeps_air_noise_at_air_and_warns_once_per_series(write_series, tmp_path: Path) -> None:
    """Air noise below -1000 HU used to come back at +3042...+3095 HU (white in every window) from the RSNA 12-bit
    repair. It must stay at air (-1000 HU), tissue must stay exact, and the clamping must be announced once per
    series (not per slice) and recorded in the cache report."""
    paths = write_series(num_slices=3, size=16)
    rng = np.random.default_rng(0)
    truth = np.where(np.arange(16)[None, :] < 8, -1000 + rng.normal(0, 25, (16, 16)), 35 + rng.normal(0, 5, (16, 16)))
    for p in paths:
        _faulty_12bit(p, Path(p), truth)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        series = load_series(os.path.dirname(paths[0]))
    clamp = [w for w in caught if "RSNA 12-bit repair" in str(w.message)]
    assert len(clamp) == 1 and "on 3 slices" in str(clamp[0].message)
    air, tissue = series.hu[:, :, :8], series.hu[:, :, 8:]
    assert air.max() < 0 and air.min() >= -1000 and (air == -1000).sum() > 0.3 * air.size
    np.testing.assert_array_equal(tissue, np.broadcast_to(np.rint(truth[:, 8:]), tissue.shape))
    index = BagIndex.load(_index_of(paths, tmp_path))
    report = build_cache(index, tmp_path / "c", CacheParams(size=8), workers=0, progress=False)
    assert [("12-bit repair on 3 slices" in w.reason) for w in report.warnings] == [True]


def _index_of(paths: list[str], tmp_path: Path) -> Path:
    from milgp.ct.index import bag_from_headers
    from milgp.ct.dicom import read_headers

    headers, _ = read_headers(paths)
    record, _, _ = bag_from_headers("bag", headers, 0.0)
    BagIndex([record]).save(tmp_path / "index.json")
    return tmp_path / "index.json"


def test_missing_rescale_warns_once_per_series(write_series, tmp_path: Path) -> None:
    """A series without RescaleSlope/RescaleIntercept is read with slope 1 / intercept 0 (raw values, 1024 HU off
    here): announced by exactly one warning for the series, and one report warning per cached bag."""
    paths = write_series(num_slices=4, size=16)
    for p in paths:
        _rewrite(p, RescaleSlope=None, RescaleIntercept=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        series = load_series(os.path.dirname(paths[0]))
    assert [("missing on 4 of 4 slices" in str(w.message)) for w in caught] == [True]
    np.testing.assert_allclose(series.hu.mean(axis=(1, 2)), np.arange(4) * 10.0 + 1024, atol=0.5)
    report = build_cache(BagIndex.load(_index_of(paths, tmp_path)), tmp_path / "c", CacheParams(size=8), workers=0, progress=False)
    assert ["assumed slope 1, intercept 0" in w.reason for w in report.warnings] == [True]


@pytest.mark.parametrize(("slope", "intercept"), [("nan", "-1024"), ("0", "-1024"), ("1", "inf"), ("1e38", "0")])
def test_meaningless_rescale_values_are_refused(write_series, slope: str, intercept: str) -> None:
    """A NaN/zero slope, an infinite intercept, or a slope that overflows float32 would put NaN or inf into the
    cache (uint8 then turns NaN into 0 silently): the slice must be refused naming the file."""
    [path] = write_series(num_slices=1, size=16)
    _rewrite(path, RescaleSlope=slope, RescaleIntercept=intercept)
    with pytest.raises(DicomReadError, match=r"f00\.dcm: .*(Rescale|not finite)"):
        read_hu(path)


# -- more of what archives do ----------------------------------------------------------------------------


def test_the_same_series_under_two_bag_folders_is_indexed_once(tmp_path: Path) -> None:
    """A scan exported twice under two folder names (same SeriesInstanceUID) would be counted twice and could land
    in train and test at once. The second bag must be refused naming the first."""
    ds = _generic(tmp_path / "gen")
    twin = Path(ds.image_dir) / "scan_twin"
    shutil.copytree(Path(ds.image_dir) / ds.scans[0].bag_id, twin)
    labels = Path(ds.labels_csv)
    labels.write_text(labels.read_text() + f"scan_twin,{int(ds.scans[0].bag_label)},other_patient\n")
    index = index_generic(ds.image_dir, ds.labels_csv)
    assert index.bag_ids == [s.bag_id for s in ds.scans]
    [refused] = index.refused
    assert refused.bag_id == "scan_twin" and f"as bag {ds.scans[0].bag_id!r}" in refused.reason


def test_saved_index_with_a_damaged_entry_caches_the_rest(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`milgp-cache index` on a saved index whose one bag entry was edited to a NaN label (or lost its slices) must
    cache the other bags and report the damaged entry as refused, not fail on the whole file."""
    ds = _generic(tmp_path / "gen")
    saved = tmp_path / "index.json"
    index_generic(ds.image_dir, ds.labels_csv).save(saved)
    obj = json.loads(saved.read_text())
    obj["bags"][0]["bag_label"] = float("nan")
    del obj["bags"][1]["slice_paths"]
    saved.write_text(json.dumps(obj))
    assert main(["index", "--index", str(saved), "--out", str(tmp_path / "c"), "--no-progress", *SIZE]) == 0
    report = json.loads((tmp_path / "c" / "skipped.json").read_text())
    assert [e["bag_id"] for e in report["refused_bags"]] == [ds.scans[0].bag_id, ds.scans[1].bag_id]
    assert "not a finite number" in report["refused_bags"][0]["reason"]
    assert CTCache(tmp_path / "c").bag_ids == [ds.scans[2].bag_id]


def test_non_finite_values_in_a_float16_cache_stop_training_naming_the_bag(tmp_path: Path) -> None:
    """A float16 bag whose values became NaN (same shape and size, so only the checksum or the values show it) must
    raise naming the bag and the file when served, never reach the network."""
    ds = _generic(tmp_path / "gen", n_bags=2)
    out = tmp_path / "c"
    assert _cache(ds, out, "--dtype", "float16")[0] == 0
    victim = ds.scans[1].bag_id
    np.save(_npy(out, victim), np.full(np.load(_npy(out, victim)).shape, np.nan, np.float16))
    dataset = CTBagDataset(out)
    dataset[0]
    with pytest.raises(CacheCorruptError, match=rf"cached bag '{victim}': .*\.npy holds non-finite values"):
        dataset[1]
    assert [e.bag_id for e in verify_cache(out).problems] == [victim]


def test_cache_folder_that_is_a_file_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--out naming an existing file must be a one-line error naming it (exit 1), and the file is left as it was."""
    ds = _generic(tmp_path / "gen", n_bags=1)
    (tmp_path / "out").write_text("not a folder")
    assert _cache(ds, tmp_path / "out")[0] == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "milgp-cache: error:" in err and "out" in err
    assert (tmp_path / "out").read_text() == "not a folder"


def test_degenerate_orientation_refuses_the_bag(tmp_path: Path) -> None:
    """ImageOrientationPatient with parallel row and column cosines has no slice normal: the bag must be refused
    naming a file, not crash the indexer."""
    ds = _generic(tmp_path / "gen")
    for path in ds.scans[0].paths:
        _rewrite(path, ImageOrientationPatient=[1, 0, 0, 1, 0, 0])
    index = index_generic(ds.image_dir, ds.labels_csv)
    assert ds.scans[0].bag_id not in index.bag_ids and "degenerate ImageOrientationPatient" in index.refused[0].reason


def test_verify_of_a_folder_that_is_not_a_cache(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """verify on a folder without params.json must say so in one line (exit 1)."""
    (tmp_path / "empty").mkdir()
    assert main(["verify", str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a milgp CT cache (no params.json)" in err


def test_gantry_tilt_is_still_axial(tmp_path: Path) -> None:
    """A head CT acquired with a 30 degree gantry tilt (slice normal 30 degrees from z) is an ordinary axial series
    and must be indexed; refusing it would drop real scans."""
    ds = _generic(tmp_path / "gen")
    c, s_ = np.cos(np.radians(30)), np.sin(np.radians(30))
    for k, path in enumerate(ds.scans[0].paths):
        _rewrite(path, ImageOrientationPatient=[1, 0, 0, 0, c, -s_], ImagePositionPatient=[-125, -125 + 5.0 * k * s_, 5.0 * k * c])
    index = index_generic(ds.image_dir, ds.labels_csv)
    assert index.bag_ids == [s.bag_id for s in ds.scans] and not index.refused
    assert index.bags[0].slice_paths == ds.scans[0].paths


def test_cache_without_checksums_is_rebuilt_once(built) -> None:
    """A cache written before checksums existed cannot be verified: verify must say so, and the next run must
    rebuild its bags (reported as rebuilt, equal to before) instead of trusting them."""
    ds, out, clean = built
    marker = _npy(out, ds.scans[0].bag_id).with_suffix(".json")
    meta = json.loads(marker.read_text())
    del meta["sha256"]
    marker.write_text(json.dumps(meta))
    assert ["no checksum recorded" in e.reason for e in verify_cache(out).problems] == [True]
    rc, report = _cache(ds, out)
    assert [e["bag_id"] for e in report["rebuilt_bags"]] == [ds.scans[0].bag_id]
    assert np.array_equal(_arrays(out)[ds.scans[0].bag_id], clean[ds.scans[0].bag_id]) and verify_cache(out).ok


# -- reruns, other directories, other terminals ----------------------------------------------------


def test_rerun_with_other_params_after_params_json_is_lost_rebuilds_every_bag(built) -> None:
    """With params.json lost, a rerun with other windows used to reuse every bag cached with the old ones
    (served as the new windows). Each marker now records its parameters: the rerun rebuilds every bag naming the
    change, and verify reports a bag whose marker records other parameters than params.json."""
    ds, out, clean = built
    (out / "params.json").unlink()
    rc, report = _cache(ds, out, "--windows", "40,80", "80,200", "600,2800")
    assert rc == 0 and sorted(e["bag_id"] for e in report["rebuilt_bags"]) == sorted(clean)
    assert all("other preprocessing parameters" in e["reason"] and "600.0, 2800.0" in e["reason"] for e in report["rebuilt_bags"])
    arrays = _arrays(out)
    assert all(np.array_equal(arrays[b][:, :2], clean[b][:, :2]) and not np.array_equal(arrays[b], clean[b]) for b in clean)
    victim = ds.scans[0].bag_id
    marker = _npy(out, victim).with_suffix(".json")
    meta = json.loads(marker.read_text())
    meta["params"]["size"] = [16, 16]
    marker.write_text(json.dumps(meta))
    assert [(e.bag_id, "other preprocessing parameters (size [16, 16] -> [8, 8])" in e.reason) for e in verify_cache(out).problems] == [(victim, True)]


def test_cache_of_an_older_milgp_with_relative_paths_is_rebuilt_once(built, monkeypatch: pytest.MonkeyPatch) -> None:
    """Markers written before they recorded the parameters (and with slice paths relative to the build's working
    directory) must not be trusted: verify reports them, the next run rebuilds each once (reported, equal to
    before, now with absolute paths and parameters) and the run after that reuses them."""
    ds, out, clean = built
    monkeypatch.chdir(Path(ds.image_dir).parent)
    for scan in ds.scans:
        marker = _npy(out, scan.bag_id).with_suffix(".json")
        meta = json.loads(marker.read_text())
        del meta["params"]
        meta["index_slice_paths"] = meta["slice_paths"] = [os.path.relpath(p) for p in meta["slice_paths"]]
        meta["sources"] = [{**s, "path": os.path.relpath(s["path"])} for s in meta["sources"]]
        marker.write_text(json.dumps(meta))
    assert all("no preprocessing parameters recorded" in e.reason for e in verify_cache(out).problems)
    rc, report = _cache(ds, out)
    assert rc == 0 and sorted(e["bag_id"] for e in report["rebuilt_bags"]) == sorted(clean)
    assert all(np.array_equal(_arrays(out)[b], clean[b]) for b in clean)
    rc, report = _cache(ds, out)
    assert rc == 0 and not report["rebuilt_bags"] and verify_cache(out).ok


def test_interrupted_rerun_keeps_the_bags_it_did_not_get_to(built, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in a rerun used to cut manifest.json down to the bags that run had reached (here none), taking
    every other bag away from training. The bags not reached must stay listed when their marker, sources and
    parameters still match -- decided without reading a checksum -- and a bag whose source changed must not."""
    ds, out, clean = built
    stale = ds.scans[2]
    os.utime(stale.paths[0], ns=(1, 1))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def no_checksum(path):
        raise AssertionError(f"the interrupted build read the checksum of {path}")

    monkeypatch.setattr("milgp.ct.cache.process_bag_isolated", interrupted)
    monkeypatch.setattr(cache_bag, "file_sha256", no_checksum)
    with pytest.raises(KeyboardInterrupt):
        build_cache(BagIndex.load(out / "index.json"), out, CacheParams(size=8), workers=0, progress=False)
    assert CTCache(out).bag_ids == [s.bag_id for s in ds.scans if s is not stale]


def test_cache_built_with_relative_paths_is_repaired_from_another_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache built with relative --root/--labels used to record source paths relative to that directory:
    verify --repair run elsewhere saw every source as gone and dropped a repairable bag from the manifest and
    splits. The index now records absolute paths: the bag is rebuilt and stays listed."""
    ds = _generic(tmp_path / "gen", n_bags=4)
    monkeypatch.chdir(tmp_path)
    rel = dict(image_dir=os.path.relpath(ds.image_dir), labels_csv=os.path.relpath(ds.labels_csv),
               slice_labels_csv=os.path.relpath(ds.slice_labels_csv))
    assert _cache(SyntheticDataset(ds.layout, ds.root, scans=ds.scans, **rel), Path("cache"), "--splits", "0.5,0.25,0.25")[0] == 0
    out = tmp_path / "cache"
    clean = _arrays(out)
    victim = ds.scans[0].bag_id
    _npy(out, victim).write_bytes(_npy(out, victim).read_bytes()[:-10] + b"\x7f" * 10)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    repaired = verify_cache(out, repair=True)
    assert repaired.ok and any(victim in a and a.startswith("rebuilt") for a in repaired.actions), repaired.summary()
    assert victim in CTCache(out).bag_ids and victim in _splits(out) and np.array_equal(_arrays(out)[victim], clean[victim])


def test_splits_that_leave_the_training_split_empty_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--splits 0.1,0.45,0.45 on 6 bags used to write a splits.json with an empty training split (exit 0). It must
    be refused in one line with nothing of splits.json written; an empty test split is a one-line warning."""
    ds = _generic(tmp_path / "gen", n_bags=6)
    out = tmp_path / "cache"
    rc, _ = _cache(ds, out, "--splits", "0.1,0.45,0.45")
    err = capsys.readouterr().err.strip()
    assert rc == 1 and not (out / "splits.json").exists()
    assert len(err.splitlines()) == 1 and "leaves the training split empty" in err
    rc, _ = _cache(ds, out, "--splits", "0.7,0.3,0")
    err = capsys.readouterr().err
    assert rc == 0 and "leaves the test split empty" in err
    assert json.loads((out / "splits.json").read_text())["test"] == []


def test_rerun_with_splits_never_moves_a_bag_between_splits(tmp_path: Path) -> None:
    """A rerun with --splits used to reshuffle every bag when the set of cached bags changed (one folder briefly
    unavailable), putting test bags into training. Bags already in splits.json must keep their split; a bag new to
    the cache joins its patient's split when the patient is placed, and a returning bag gets its old split back."""
    ds = _generic(tmp_path / "gen", n_bags=12)
    labels = Path(ds.labels_csv)
    rows = labels.read_text().splitlines()
    newcomer = rows.pop()  # scan_011, later added as a second bag of scan_000's patient
    labels.write_text("\n".join(rows) + "\n")
    out = tmp_path / "cache"
    assert _cache(ds, out, "--splits", "0.5,0.25,0.25")[0] == 0
    where = lambda: {b: k for k, ids in json.loads((out / "splits.json").read_text()).items() for b in ids}  # noqa: E731
    first = where()
    away = Path(ds.image_dir) / ds.scans[7].bag_id
    away.rename(tmp_path / "away")
    assert _cache(ds, out, "--splits", "0.5,0.25,0.25")[0] == 0
    second = where()
    assert ds.scans[7].bag_id not in second and all(first[b] == k for b, k in second.items())
    (tmp_path / "away").rename(away)
    assert _cache(ds, out, "--splits", "0.5,0.25,0.25")[0] == 0
    assert where() == first
    labels.write_text("\n".join(rows + [newcomer.rsplit(",", 1)[0] + ",patient_000"]) + "\n")
    assert _cache(ds, out, "--splits", "0.5,0.25,0.25")[0] == 0
    fourth = where()
    assert all(fourth[b] == k for b, k in first.items()) and fourth[ds.scans[11].bag_id] == first[ds.scans[0].bag_id]


def test_generic_bag_ids_that_cannot_be_plain_folder_names_refuse_only_that_bag(tmp_path: Path) -> None:
    """A 300-character bag id used to abort the whole indexing with '[Errno 36] File name too long', and ids like
    'scan_001/' or './scan_002' reached another row's folder and cached it under the alias's label. Each such row
    must be refused with the reason, every other bag indexed."""
    ds = _generic(tmp_path / "gen", n_bags=3)
    long_id = "X" * 300
    with open(ds.labels_csv, "a", encoding="utf-8") as fh:
        fh.write(f"{long_id},1,px\nscan_001/,1,pp\n./scan_002,0,pq\n")
    index = index_generic(ds.image_dir, ds.labels_csv)
    assert index.bag_ids == [s.bag_id for s in ds.scans]
    reasons = {e.bag_id: e.reason for e in index.refused}
    assert "cannot name a folder (File name too long)" in reasons[long_id]
    assert all("not a plain folder name" in reasons[b] for b in ("scan_001/", "./scan_002"))


def test_verify_without_repair_writes_nothing_not_even_the_lock(built) -> None:
    """verify without --repair used to take the writer lock, so a read-only cache (or one being written) could not
    be checked (Permission denied on the lock file). It must check while another process holds the lock and
    leave every file and the folder untouched."""
    ds, out, clean = built
    before = {p: p.stat().st_mtime_ns for p in [out, *out.rglob("*")]}
    fd = os.open(out / LOCK_FILE_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        before[out / LOCK_FILE_NAME] = (out / LOCK_FILE_NAME).stat().st_mtime_ns
        before[out] = out.stat().st_mtime_ns
        assert verify_cache(out).ok
        assert {p: p.stat().st_mtime_ns for p in [out, *out.rglob("*")]} == before
        with pytest.raises(CacheLockedError):
            verify_cache(out, repair=True)
    finally:
        os.close(fd)


def test_output_survives_a_terminal_that_cannot_encode_the_file_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With PYTHONIOENCODING=ascii (or latin-1), build and verify used to exit 1 with a codec error after all the
    work was done. Their output must be written with escapes instead, and both succeed."""
    ds = _generic(tmp_path / "gen", n_bags=2)
    out = tmp_path / "cache ü 😀"
    streams = {name: io.TextIOWrapper(io.BytesIO(), encoding="ascii") for name in ("stdout", "stderr")}
    for name, stream in streams.items():
        monkeypatch.setattr(sys, name, stream)
    assert _cache(ds, out)[0] == 0 and main(["verify", str(out)]) == 0
    streams["stdout"].flush()
    assert b"cache \\xfc \\U0001f600" in streams["stdout"].buffer.getvalue()
