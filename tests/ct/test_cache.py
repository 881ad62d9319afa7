"""milgp.ct.cache and the milgp-cache CLI: contents, resumption, parameters, skipped files, atomicity."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import milgp.ct.cache_bag as cache_bag
import milgp.ct.hounsfield as hounsfield
from milgp.data.atomic import atomic_open
from milgp.ct.cache import CacheParams, CacheParamsMismatch, CTCache, build_cache
from milgp.ct.cache_bag import bag_file_stem
from milgp.ct.cache_cli import main
from milgp.ct.index import BagIndex, BagRecord
from milgp.ct.hounsfield import read_hu
from milgp.ct.windows import ct_channels
from milgp.ct.rsna import index_rsna
from milgp.ct.synthetic import SyntheticDataset

PARAMS = CacheParams(size=16)


def _index(ds: SyntheticDataset) -> BagIndex:
    return index_rsna(ds.image_dir, ds.labels_csv)


def test_cache_holds_windowed_resized_slices(rsna_synth: SyntheticDataset, rsna_cache: str) -> None:
    """Each cached bag must be (S, 3, 24, 24) uint8 equal to ct_channels(read_hu(slice)) quantised to 1/255,
    in the index's slice order, with labels in the manifest and parameters recorded."""
    cache = CTCache(rsna_cache)
    assert cache.params == CacheParams(size=24) and len(cache) == len(rsna_synth.scans)
    params = json.loads((Path(rsna_cache) / "params.json").read_text())
    assert params["dtype"] == "uint8" and params["size"] == [24, 24] and params["windows"][0] == [40.0, 80.0]
    for truth in rsna_synth.scans[:3]:
        stored = cache.load(truth.bag_id)
        assert stored.dtype == np.uint8 and stored.shape == (len(truth.paths), 3, 24, 24)
        expected = np.stack([ct_channels(read_hu(p), size=24) for p in truth.paths])
        np.testing.assert_allclose(cache.params.decode(np.asarray(stored)), expected, atol=0.5 / 255 + 1e-6)
        assert cache.entry(truth.bag_id).slice_labels == truth.slice_labels


def test_resume_after_interruption_does_not_redo_finished_bags(rsna_copy: SyntheticDataset, tmp_path: Path, monkeypatch) -> None:
    """Interrupt after 3 bags (Ctrl-C), rerun: the 3 finished bags must be reused untouched (same mtimes, no
    slice re-read), the rest computed, and the manifest must list finished bags even after the interruption."""
    index = _index(rsna_copy)
    cache_dir = tmp_path / "cache"
    seen: list[str] = []

    def stop_after_three(result) -> None:
        seen.append(result.bag_id)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_cache(index, cache_dir, PARAMS, workers=0, progress=False, on_bag=stop_after_three)
    manifest = json.loads((cache_dir / "manifest.json").read_text())
    assert [b["bag_id"] for b in manifest["bags"]] == seen
    mtimes = {b: (cache_dir / "bags" / f"{bag_file_stem(b)}.npy").stat().st_mtime_ns for b in seen}

    reads: list[str] = []
    real_read = hounsfield.read_slice_values
    monkeypatch.setattr(hounsfield, "read_slice_values", lambda p, allow_non_ct: reads.append(p) or real_read(p, allow_non_ct))
    report = build_cache(index, cache_dir, PARAMS, workers=0, progress=False)
    assert sorted(report.reused) == sorted(seen) and len(report.done) == len(index) - 3
    assert {b: (cache_dir / "bags" / f"{bag_file_stem(b)}.npy").stat().st_mtime_ns for b in seen} == mtimes
    finished_paths = {p for b in index.bags if b.bag_id in seen for p in b.slice_paths}
    assert reads and not finished_paths & set(reads)
    assert len(CTCache(cache_dir)) == len(index)


def test_changed_bag_is_recomputed(rsna_synth: SyntheticDataset, tmp_path: Path) -> None:
    """When a bag's labels change in the index, its cached copy must be redone, not silently reused."""
    index = _index(rsna_synth)
    build_cache(index, tmp_path, PARAMS, workers=0, progress=False)
    first = index.bags[0]
    flipped = BagRecord(first.bag_id, first.patient_id, 1.0, first.slice_paths, (1,) * first.num_slices, first.series_uid)
    report = build_cache(BagIndex([flipped] + index.bags[1:]), tmp_path, PARAMS, workers=0, progress=False)
    assert report.done == [first.bag_id] and len(report.reused) == len(index) - 1
    assert CTCache(tmp_path).entry(first.bag_id).slice_labels == (1,) * first.num_slices


def test_mismatched_parameters_are_refused(rsna_synth: SyntheticDataset, rsna_cache: str, tmp_path: Path) -> None:
    """Adding to or opening a cache with other windows/size/dtype must raise CacheParamsMismatch, never mix."""
    index = _index(rsna_synth)
    with pytest.raises(CacheParamsMismatch, match="was built with"):
        build_cache(index, rsna_cache, CacheParams(size=16), workers=0, progress=False)
    with pytest.raises(CacheParamsMismatch):
        build_cache(index, rsna_cache, CacheParams(size=24, dtype="float16"), workers=0, progress=False)
    with pytest.raises(CacheParamsMismatch):
        CTCache(rsna_cache, expected_params=CacheParams(size=24, windows=((40, 80),)))
    with pytest.raises(ValueError, match="dtype"):
        CacheParams(dtype="int32")


def test_skipped_file_report_lists_planted_corrupt_file(rsna_copy: SyntheticDataset, tmp_path: Path) -> None:
    """A slice corrupted after indexing must be skipped (bag cached without it, labels kept aligned) and
    listed in skipped.json with its path; a bag whose slices are all corrupt must be reported as failed."""
    index = _index(rsna_copy)
    scan0, scan1 = rsna_copy.scans[0], rsna_copy.scans[1]
    Path(scan0.paths[2]).write_bytes(b"\x00" * 64)
    for p in scan1.paths:
        Path(p).write_text("gone")
    report = build_cache(index, tmp_path, PARAMS, workers=0, progress=False)
    skipped = json.loads((tmp_path / "skipped.json").read_text())
    assert {"bag_id": scan0.bag_id, "path": scan0.paths[2]} in [{k: s[k] for k in ("bag_id", "path")} for s in skipped["skipped_files"]]
    assert [f["bag_id"] for f in skipped["failed_bags"]] == [scan1.bag_id] == [e.bag_id for e in report.failed]
    entry = CTCache(tmp_path).entry(scan0.bag_id)
    assert entry.num_slices == len(scan0.paths) - 1
    assert entry.slice_labels == scan0.slice_labels[:2] + scan0.slice_labels[3:]
    assert scan0.paths[2] in report.summary() or "more" in report.summary()


def test_failed_write_leaves_no_partial_files(rsna_synth: SyntheticDataset, tmp_path: Path, monkeypatch) -> None:
    """If writing a bag dies half-way (disk full), that bag must be reported failed with the reason and nothing
    of it may remain (no .npy, no temporary file, no marker); the build goes on with the other bags."""
    index = BagIndex(_index(rsna_synth).bags[:2])
    first = index.bags[0].bag_id
    real_save = cache_bag.atomic_save_npy

    def full_disk_for_first(path, array) -> None:
        if bag_file_stem(first) in str(path):
            with atomic_open(path, "wb") as fh:
                fh.write(b"\x93NUMPY partial")
                raise OSError(28, "No space left on device", str(path))
        real_save(path, array)

    monkeypatch.setattr(cache_bag, "atomic_save_npy", full_disk_for_first)
    report = build_cache(index, tmp_path, PARAMS, workers=0, progress=False)
    [failed] = report.failed
    assert failed.bag_id == first and "No space left on device" in failed.reason and bag_file_stem(first) in failed.path
    assert report.done == [index.bags[1].bag_id]
    assert sorted(os.listdir(tmp_path / "bags")) == sorted(f"{bag_file_stem(index.bags[1].bag_id)}{x}" for x in (".json", ".npy"))


def test_stale_temporaries_are_removed(rsna_synth: SyntheticDataset, tmp_path: Path) -> None:
    """Temporary files left by a killed writer must be cleaned on the next build."""
    (tmp_path / "bags").mkdir(parents=True)
    stale = tmp_path / "bags" / ".x.npy.tmp-abc123"
    stale.write_bytes(b"partial")
    build_cache(BagIndex(_index(rsna_synth).bags[:1]), tmp_path, PARAMS, workers=0, progress=False)
    assert not stale.exists()


def test_two_workers_give_the_same_cache(rsna_synth: SyntheticDataset, tmp_path: Path) -> None:
    """The process pool must produce byte-identical arrays and the same manifest as the in-process path."""
    index = BagIndex(_index(rsna_synth).bags[:4])
    build_cache(index, tmp_path / "one", PARAMS, workers=0, progress=False)
    build_cache(index, tmp_path / "two", PARAMS, workers=2, progress=False)
    one, two = CTCache(tmp_path / "one"), CTCache(tmp_path / "two")
    assert one.entries == two.entries
    for b in index.bag_ids:
        np.testing.assert_array_equal(one.load(b), two.load(b))


def test_cli_synthetic_then_rsna(tmp_path: Path, capsys) -> None:
    """`milgp-cache synthetic` then `milgp-cache rsna --splits` must exit 0 and write index, cache, report and
    splits; a second run must reuse everything; a bad folder must exit 1 with the path in the message."""
    assert main(["synthetic", "--out", str(tmp_path / "syn"), "--scans", "4", "--slices", "3", "4", "--size", "16"]) == 0
    args = ["rsna", "--images", str(tmp_path / "syn" / "stage_2_train"), "--labels", str(tmp_path / "syn" / "stage_2_train.csv"),
            "--out", str(tmp_path / "cache"), "--size", "8", "--no-progress", "--splits", "0.5,0.25,0.25"]
    assert main(args) == 0
    for name in ("index.json", "manifest.json", "params.json", "skipped.json", "splits.json"):
        assert (tmp_path / "cache" / name).is_file(), name
    assert main(args) == 0
    assert "0 bags computed" in capsys.readouterr().out.splitlines()[-1]
    assert main(["rsna", "--images", str(tmp_path / "nowhere"), "--labels", str(tmp_path / "x.csv"), "--out", str(tmp_path / "c2")]) == 1
    assert "nowhere: not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["cq500", "generic"])
def test_cli_cq500_and_generic_layouts_and_saved_index(layout: str, tmp_path: Path) -> None:
    """The cq500 and generic subcommands must cache every synthetic bag, and `index` must rebuild a cache
    with other parameters from the saved index.json."""
    syn = tmp_path / "syn"
    assert main(["synthetic", "--layout", layout, "--out", str(syn), "--scans", "2", "--slices", "3", "3", "--size", "16"]) == 0
    if layout == "cq500":
        args = ["cq500", "--root", str(syn), "--reads", str(syn / "reads.csv")]
    else:
        args = ["generic", "--root", str(syn / "bags"), "--labels", str(syn / "labels.csv"), "--slice-labels", str(syn / "slice_labels.csv")]
    assert main(args + ["--out", str(tmp_path / "c"), "--size", "8", "--no-progress"]) == 0
    assert len(CTCache(tmp_path / "c")) == 2
    assert main(["index", "--index", str(tmp_path / "c" / "index.json"), "--out", str(tmp_path / "c2"), "--size", "0",
                 "--dtype", "float16", "--no-progress"]) == 0
    rebuilt = CTCache(tmp_path / "c2")
    assert rebuilt.params.size is None and rebuilt.load(rebuilt.bag_ids[0]).shape[1:] == (3, 16, 16)


def test_cli_runs_as_module_with_help() -> None:
    """`python -m milgp.ct.cache_cli --help` must work (the console script wraps the same main)."""
    out = subprocess.run([sys.executable, "-m", "milgp.ct.cache_cli", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "rsna" in out.stdout and "synthetic" in out.stdout


def test_split_fractions_are_checked_before_any_work(tmp_path):
    """``--splits`` is checked when the command line is parsed, before any file is read: fractions
    that do not sum to 1 are refused in one line, percentages summing to 100 are converted."""
    import subprocess
    import sys

    from milgp.ct.cache_cli import _fractions

    assert _fractions("80,10,10") == (0.8, 0.1, 0.1)
    assert _fractions("0.7,0.15,0.15") == (0.7, 0.15, 0.15)
    out = subprocess.run(
        [sys.executable, "-m", "milgp.ct.cache_cli", "rsna", "--images", str(tmp_path / "missing"),
         "--labels", str(tmp_path / "missing.csv"), "--out", str(tmp_path / "cache"), "--splits", "0.8,0.3,0.1"],
        capture_output=True, text=True,
    )
    assert out.returncode != 0 and "sum to 1.2" in out.stderr
    assert not (tmp_path / "cache").exists()


def test_every_bag_refused_says_why_and_writes_the_report(rsna_copy: SyntheticDataset, tmp_path: Path, capsys) -> None:
    """When the indexer refuses every bag, the one-line error must give the count and the first reason
    (file and line), and skipped.json must list every refusal; a folder that already holds a cache
    keeps its report. Before, the error was only 'the bag index is empty: nothing to cache'."""
    labels = Path(rsna_copy.labels_csv)
    labels.write_text(labels.read_text().replace(",1\n", ",True\n").replace(",0\n", ",False\n"))
    out = tmp_path / "cache"
    args = ["rsna", "--images", rsna_copy.image_dir, "--labels", str(labels), "--out", str(out), "--size", "16", "--no-progress"]
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{len(rsna_copy.scans)} bags refused at indexing" in err and "label 'False' is not a number" in err
    assert "stage_2_train.csv, line" in err and "skipped.json" in err
    report = json.loads((out / "skipped.json").read_text())
    assert len(report["refused_bags"]) == len(rsna_copy.scans)
    cache = tmp_path / "built"
    build_cache(BagIndex([BagRecord("a", "p", 0.0, (rsna_copy.scans[0].paths[0],))]), cache, PARAMS, progress=False)
    before = (cache / "skipped.json").read_bytes()
    with pytest.raises(ValueError, match="keeps its earlier cache and report"):
        build_cache(index_rsna(rsna_copy.image_dir, str(labels)), cache, PARAMS, progress=False)
    assert (cache / "skipped.json").read_bytes() == before
