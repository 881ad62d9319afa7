"""``milgp-cache verify``: check a whole CT cache, and repair it from the sources it records.

What the check covers (what training would be served) and what the repair does are described in
``docs/ct_data.md``, "The cache": the repair reruns :func:`milgp.ct.cache.build_cache` on the
recorded index (``index.json``, or the index rows in the markers when it is missing or
unreadable), drops from ``splits.json`` the bags the manifest no longer lists, and checks again.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from milgp.data.atomic import atomic_write_json
from milgp.ct.cache import CacheCorruptError, CacheEntry, build_cache, read_manifest
from milgp.ct.cache_bag import cached_bag_problem
from milgp.ct.cache_lock import CacheLock
from milgp.ct.cache_params import CacheParams, read_cache_params
from milgp.ct.index import BagIndex, BagRecord, read_splits
from milgp.ct.report_entry import ReportEntry, printable

__all__ = ["VerifyReport", "verify_cache"]


@dataclass
class VerifyReport:
    """What :func:`verify_cache` found and did.

    Attributes:
        cache_dir: the cache.
        checked: bags checked in the first pass.
        problems: what was wrong before any repair (bag, file, reason).
        actions: what the repair did, one line each.
        remaining: what is still wrong after the repair (equal to ``problems`` without repair).
        notes: findings that are not problems (source files gone, cached copy kept).
    """

    cache_dir: str
    checked: int = 0
    problems: list[ReportEntry] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    remaining: list[ReportEntry] = field(default_factory=list)
    notes: list[ReportEntry] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Nothing is wrong now."""
        return not self.remaining

    def summary(self) -> str:
        lines = [f"verify {printable(self.cache_dir)}: {self.checked} bags checked, {len(self.problems)} problems found, "
                 f"{len(self.actions)} repair actions, {len(self.remaining)} problems remaining, {len(self.notes)} notes"]
        lines += [f"  problem: {e}" for e in self.problems]
        lines += [f"  repaired: {a}" for a in self.actions]
        lines += [f"  still wrong: {e}" for e in self.remaining] if self.actions else []
        lines += [f"  note: {e}" for e in self.notes]
        return "\n".join(lines)


def _recorded_index(root: Path, entries: list[CacheEntry] | None) -> tuple[BagIndex | None, list[ReportEntry]]:
    """The index to check against and rebuild from: ``index.json``, else the markers' index rows."""
    problems: list[ReportEntry] = []
    path = root / "index.json"
    if path.is_file():
        try:
            return BagIndex.load(path), problems
        except (OSError, ValueError) as err:
            problems.append(ReportEntry("", str(path), f"unreadable index ({err}); the markers' records are used instead"))
    if entries is None:
        problems.append(ReportEntry("", str(root), "neither manifest.json nor index.json is readable: which bags the cache holds is unknown"))
        return None, problems
    records: list[BagRecord] = []
    for e in entries:
        try:
            marker = json.loads((root / "bags" / e.file).with_suffix(".json").read_text(encoding="utf-8"))
            slices = {"slice_paths": marker["index_slice_paths"], "slice_labels": marker["index_slice_labels"],
                      "bag_label": marker.get("index_bag_label", marker["bag_label"])}  # older markers: one label
            if missing := {"series_uid", "ordering", "modality"} - marker.keys():  # every marker writes them
                raise KeyError(f"the marker lacks {sorted(missing)}")
            records.append(BagRecord.from_json_dict({**marker, **slices}))
        except (OSError, KeyError, TypeError, ValueError) as err:
            problems.append(ReportEntry(e.bag_id, str(root / "bags" / e.file), f"cannot be rebuilt: no index.json and its marker is unreadable ({err})"))
    return BagIndex(records), problems


def _check(root: Path, params: CacheParams) -> tuple[int, list[ReportEntry], list[ReportEntry], BagIndex | None]:
    """One pass against the cache's ``params``: ``(bags checked, problems, notes, recorded index)``."""
    problems: list[ReportEntry] = []
    notes: list[ReportEntry] = []
    entries: list[CacheEntry] | None
    try:
        entries = read_manifest(root)
    except (FileNotFoundError, CacheCorruptError) as err:
        problems.append(ReportEntry("", str(root / "manifest.json"), str(err)))
        entries = None
    index, index_problems = _recorded_index(root, entries)
    problems += index_problems
    by_id = {} if index is None else {b.bag_id: b for b in index.bags}
    served = entries if entries is not None else []
    for e in served:
        record = by_id.get(e.bag_id)
        if record is None:
            problems.append(ReportEntry(e.bag_id, str(root / "manifest.json"), "listed in the manifest but not in the index it was built from"))
            continue
        state = cached_bag_problem(root / "bags", record, params)
        if state.marker is None:
            problems.append(ReportEntry(e.bag_id, state.path or str(root / "bags" / e.file), state.reason or "listed in the manifest but not cached"))
            continue
        if state.note:
            notes.append(ReportEntry(e.bag_id, state.path, state.note))
        marker = state.marker
        if (marker["file"], marker["sha256"], tuple(marker["shape"]), marker["slice_labels"], float(marker["bag_label"])) != (
            e.file, e.sha256, e.shape, None if e.slice_labels is None else list(e.slice_labels), e.bag_label
        ):
            problems.append(ReportEntry(e.bag_id, str(root / "manifest.json"), "manifest entry differs from the bag's marker (file, checksum, shape or labels)"))
    splits_path = root / "splits.json"
    if splits_path.is_file() and entries is not None:
        known = {e.bag_id for e in entries}
        try:
            listed = [b for ids in read_splits(splits_path).values() for b in ids]
        except (OSError, ValueError) as err:
            problems.append(ReportEntry("", str(splits_path), str(err)))
        else:
            problems += [ReportEntry(b, str(splits_path), "listed in splits.json but not in the manifest") for b in listed if b not in known]
    return len(served), problems, notes, index


def _fix_splits(root: Path) -> list[str]:
    """Drop from ``splits.json`` the bags the manifest does not list; returns what was done."""
    path = root / "splits.json"
    if not path.is_file():
        return []
    try:
        known = {e.bag_id for e in read_manifest(root)}
    except (FileNotFoundError, CacheCorruptError):
        return []
    try:
        splits = read_splits(path)
    except (OSError, ValueError) as err:
        return [f"left as it is: {err}"]
    kept = {name: [b for b in ids if b in known] for name, ids in splits.items()}
    dropped = [b for name, ids in splits.items() for b in ids if b not in known]
    if not dropped:
        return []
    atomic_write_json(path, kept)
    return [f"removed {len(dropped)} bags that are not in the cache from {printable(path)} (e.g. {dropped[0]!r})"]


def verify_cache(
    cache_dir: str | os.PathLike[str], repair: bool = False, wait_s: float = 0.0, workers: int = 1, progress: bool = False
) -> VerifyReport:
    """Check a cache (what ``docs/ct_data.md``, "The cache", lists); with ``repair``, rebuild what can be rebuilt and check again.

    Without ``repair`` nothing is written, not even the lock file, so a read-only cache can be
    checked (a check racing with a writer may report the bag being written); with ``repair`` the
    cache's writer lock is held throughout (``wait_s`` as in :class:`milgp.ct.cache_lock.CacheLock`).

    Raises:
        FileNotFoundError, ValueError: naming the folder or ``params.json`` when the folder is not a
            readable cache (nothing can be checked or rebuilt without its parameters).
        CacheLockedError: with ``repair``, when another process writes into the cache.
    """
    root = Path(cache_dir)
    params = read_cache_params(root)
    with CacheLock(root, wait_s=wait_s) if repair else contextlib.nullcontext():
        checked, problems, notes, index = _check(root, params)
        report = VerifyReport(str(root), checked, problems, remaining=list(problems), notes=notes)
        if not repair or not problems:
            return report
        if index is not None and len(index) > 0:
            built = build_cache(index, root, params, workers=workers, progress=progress)
            report.actions += [f"rebuilt {e}" for e in built.rebuilt]
            report.actions += [f"left out of the manifest (cannot be rebuilt): {e}" for e in built.failed]
        report.actions += _fix_splits(root)
        _, report.remaining, report.notes, _ = _check(root, params)
    return report
