"""milgp.ct.cache_bag: the label a cached bag is served with, when slices are left out at caching."""
from __future__ import annotations

import json
from pathlib import Path

from milgp.ct.cache import CacheParams, CTCache, build_cache
from milgp.ct.cache_verify import verify_cache
from milgp.ct.generic_layout import index_generic
from milgp.ct.rsna import index_rsna
from milgp.ct.synthetic import SyntheticDataset, write_generic_dataset

PARAMS = CacheParams(size=16)


def _truncate_pixels(paths) -> None:
    """Cut the end of each file's pixel data: its header still reads (the index keeps it), its pixels do not."""
    for p in paths:
        data = Path(p).read_bytes()
        Path(p).write_bytes(data[:-200])


def test_rsna_bag_label_is_the_maximum_of_the_kept_slices(rsna_copy: SyntheticDataset, tmp_path: Path) -> None:
    """An RSNA series whose only positive slices are unreadable at caching must be served as a negative
    bag (its label is the maximum of its kept slices' labels, as documented), with a report warning
    naming a left-out positive slice; a rerun reuses it and verify finds it clean. Before, it was
    cached with bag_label 1 and all slice labels 0."""
    scan = min((s for s in rsna_copy.scans if s.bag_label == 1), key=lambda s: sum(s.slice_labels))
    positives = [p for p, lab in zip(scan.paths, scan.slice_labels) if lab]
    _truncate_pixels(positives)
    out = tmp_path / "cache"
    report = build_cache(index_rsna(rsna_copy.image_dir, rsna_copy.labels_csv), out, PARAMS, progress=False)
    entry = CTCache(out).entry(scan.bag_id)
    assert entry.slice_labels is not None and max(entry.slice_labels) == 0
    assert entry.bag_label == 0.0
    notes = [w for w in report.warnings if w.bag_id == scan.bag_id and "bag label 1 -> 0" in w.reason]
    assert len(notes) == 1 and notes[0].path in positives
    skipped = json.loads((out / "skipped.json").read_text())
    assert any("bag label 1 -> 0" in w["reason"] for w in skipped["warnings"])
    for other in rsna_copy.scans:  # the other bags keep their labels
        if other.bag_id != scan.bag_id:
            assert CTCache(out).entry(other.bag_id).bag_label == other.bag_label
    again = build_cache(index_rsna(rsna_copy.image_dir, rsna_copy.labels_csv), out, PARAMS, progress=False)
    assert scan.bag_id in again.reused and not again.rebuilt
    assert any("bag label 1 -> 0" in w.reason for w in again.warnings)
    assert verify_cache(out).problems == []


def test_given_bag_label_is_kept_and_a_contradiction_reported(tmp_path: Path) -> None:
    """A generic bag label is given on its own: when every positive slice is left out at caching the
    label stays 1, and the report says that no positive slice is left."""
    ds = write_generic_dataset(tmp_path / "gen", n_bags=4, slices=(4, 5), size=16, seed=4, prevalence=0.5)
    scan = next(s for s in ds.scans if s.bag_label == 1)
    _truncate_pixels([p for p, lab in zip(scan.paths, scan.slice_labels) if lab])
    out = tmp_path / "cache"
    report = build_cache(index_generic(ds.image_dir, ds.labels_csv, ds.slice_labels_csv), out, PARAMS, progress=False)
    entry = CTCache(out).entry(scan.bag_id)
    assert entry.bag_label == 1.0 and entry.slice_labels is not None and max(entry.slice_labels) == 0
    assert any(w.bag_id == scan.bag_id and "kept as given" in w.reason for w in report.warnings)
