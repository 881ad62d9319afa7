"""milgp-cache and build_cache keep index, manifest and splits consistent with the bags actually cached."""
from __future__ import annotations

from pathlib import Path

import pytest

from milgp.ct.cache import CacheParams, CTCache, build_cache
from milgp.ct.cache_cli import main
from milgp.ct.dataset import CTBagDataset
from milgp.ct.index import BagIndex
from milgp.ct.rsna import index_rsna
from milgp.ct.synthetic import SyntheticDataset, write_rsna_dataset

PARAMS = CacheParams(size=16)


def test_failed_bag_is_left_out_of_splits(rsna_copy: SyntheticDataset, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A bag that is indexed but fails to cache (all slices unreadable) must not be in splits.json, and the
    run must say so. If it were, every dataset built from the splits would raise KeyError at training time."""
    index_path = tmp_path / "index.json"
    index_rsna(rsna_copy.image_dir, rsna_copy.labels_csv).save(index_path)
    broken = rsna_copy.scans[1]
    for p in broken.paths:
        Path(p).write_text("gone")
    out = tmp_path / "cache"
    assert main(["index", "--index", str(index_path), "--out", str(out), "--size", "8", "--no-progress",
                 "--splits", "0.5,0.25,0.25"]) == 0
    served = [b for name in ("train", "val", "test") for b in CTBagDataset.from_split(out, name).bag_ids]  # no KeyError
    assert sorted(served) == sorted(CTCache(out).bag_ids) == sorted(s.bag_id for s in rsna_copy.scans if s is not broken)
    stdout = capsys.readouterr().out
    assert "left out of splits.json: 1 bags" in stdout and broken.bag_id in stdout


def test_refused_run_leaves_the_existing_index(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A run refused for other preprocessing parameters must not touch the cache, index.json included;
    otherwise the cache's index would describe another dataset than its bags."""
    first = write_rsna_dataset(tmp_path / "a", n_scans=3, slices=(2, 3), size=16, seed=1)
    other = write_rsna_dataset(tmp_path / "b", n_scans=4, slices=(2, 3), size=16, seed=2)
    out = tmp_path / "cache"
    assert main(["rsna", "--images", first.image_dir, "--labels", first.labels_csv, "--out", str(out), "--size", "8",
                 "--no-progress"]) == 0
    before = (out / "index.json").read_bytes()
    assert main(["rsna", "--images", other.image_dir, "--labels", other.labels_csv, "--out", str(out), "--size", "12",
                 "--no-progress"]) == 1
    assert "was built with" in capsys.readouterr().err
    assert (out / "index.json").read_bytes() == before


def test_manifest_lists_only_the_last_index(rsna_synth: SyntheticDataset, tmp_path: Path) -> None:
    """Rebuilding a cache from a smaller index must leave the manifest (hence CTCache, the datasets and data
    modules) with exactly that index's bags, while keeping the other bags' files for reuse. If stale bags
    stayed listed, a dataset over "all cached bags" would train on bags that are no longer in the data."""
    index = index_rsna(rsna_synth.image_dir, rsna_synth.labels_csv)
    build_cache(index, tmp_path, PARAMS, workers=0, progress=False)
    subset = BagIndex(index.bags[2:6])
    report = build_cache(subset, tmp_path, PARAMS, workers=0, progress=False)
    assert sorted(report.reused) == sorted(subset.bag_ids)
    assert CTCache(tmp_path).bag_ids == subset.bag_ids and CTBagDataset(tmp_path).bag_ids == subset.bag_ids
    again = build_cache(index, tmp_path, PARAMS, workers=0, progress=False)
    assert sorted(again.reused) == sorted(index.bag_ids) and CTCache(tmp_path).bag_ids == index.bag_ids


def test_stale_splits_file_is_reported(rsna_synth: SyntheticDataset, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Recaching a smaller index without --splits must warn that the earlier splits.json names bags the cache
    no longer lists (training on it would fail), and leave it for the user to rewrite."""
    out = tmp_path / "cache"
    assert main(["rsna", "--images", rsna_synth.image_dir, "--labels", rsna_synth.labels_csv, "--out", str(out),
                 "--size", "8", "--no-progress", "--splits", "0.5,0.25,0.25"]) == 0
    BagIndex(BagIndex.load(out / "index.json").bags[:3]).save(tmp_path / "subset.json")
    capsys.readouterr()
    assert main(["index", "--index", str(tmp_path / "subset.json"), "--out", str(out), "--size", "8", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "splits.json (from an earlier run) lists 5 bags not in this cache" in err
