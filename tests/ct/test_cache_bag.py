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


def test_a_bag_an_older_milgp_cached_with_a_stale_label_is_rebuilt_and_reported(rsna_copy: SyntheticDataset, tmp_path: Path) -> None:
    """A cache of the previous milgp: its marker holds the index's label (1) beside kept slice labels
    all 0, and its index.json has no ``label_from_slices``. Verify must report that bag, and a rerun
    from that index must rebuild it with a warning saying why and how to take the label anew.
    Before, both reused it silently: the new label check only fired for an index that says the
    label was the maximum of the slice labels."""
    from milgp.ct.index import BagIndex

    scan = min((s for s in rsna_copy.scans if s.bag_label == 1), key=lambda s: sum(s.slice_labels))
    _truncate_pixels([p for p, lab in zip(scan.paths, scan.slice_labels) if lab])
    out = tmp_path / "cache"
    build_cache(index_rsna(rsna_copy.image_dir, rsna_copy.labels_csv), out, PARAMS, progress=False)
    for marker_path in (out / "bags").glob("*.json"):  # the markers as the previous milgp wrote them
        marker = json.loads(marker_path.read_text())
        marker["bag_label"] = marker.pop("index_bag_label")
        marker.pop("label_from_slices")
        marker_path.write_text(json.dumps(marker))
    saved = json.loads((out / "index.json").read_text())
    for bag in saved["bags"]:
        bag.pop("label_from_slices", None)
    (out / "index.json").write_text(json.dumps(saved))
    problems = verify_cache(out).problems
    assert [p.bag_id for p in problems] == [scan.bag_id] and "older milgp" in problems[0].reason
    again = build_cache(BagIndex.load(out / "index.json"), out, PARAMS, progress=False)
    assert scan.bag_id in [e.bag_id for e in again.rebuilt]
    assert any(w.bag_id == scan.bag_id and "kept as given" in w.reason for w in again.warnings)


def test_an_index_of_an_older_milgp_reuses_a_cache_built_from_a_fresh_index(rsna_copy: SyntheticDataset, tmp_path: Path) -> None:
    """An index saved by the previous milgp (no ``label_from_slices``) run over a cache built from a
    fresh index: every intact bag is reused, and the bag whose positive slices were left out keeps
    the label its marker took from the kept slices (0). Before, every RSNA bag was rebuilt as
    "changed in the index", and that bag went back to 1."""
    from milgp.ct.index import BagIndex

    scan = min((s for s in rsna_copy.scans if s.bag_label == 1), key=lambda s: sum(s.slice_labels))
    _truncate_pixels([p for p, lab in zip(scan.paths, scan.slice_labels) if lab])
    index = index_rsna(rsna_copy.image_dir, rsna_copy.labels_csv)
    out = tmp_path / "cache"
    build_cache(index, out, PARAMS, progress=False)
    index.save(tmp_path / "old.csv")
    rows = (tmp_path / "old.csv").read_text().splitlines()
    (tmp_path / "old.csv").write_text("\n".join(",".join(r.split(",")[:-1]) for r in rows) + "\n")  # no last column
    old = BagIndex.load(tmp_path / "old.csv")
    assert {b.label_from_slices for b in old.bags} == {None}
    again = build_cache(old, out, PARAMS, progress=False)
    assert not again.rebuilt and len(again.reused) == len(index.bags)
    assert CTCache(out).entry(scan.bag_id).bag_label == 0.0
