"""Index users' own data: one folder per bag plus a CSV of bag labels.

Layout::

    root/<bag_id>/*.dcm            one CT series per folder (searched recursively)
    labels.csv                     bag_id,label[,patient_id]
    slice_labels.csv (optional)    bag_id,file,label   (file: path relative to root/<bag_id>)

Without ``patient_id`` each bag is its own patient. How labels are validated and when a listed bag
is left out whole (reported in ``BagIndex.refused``) is described in ``docs/ct_data.md``, "Layouts".
"""
from __future__ import annotations

import os
from pathlib import Path

from milgp.ct.index import BagIndex
from milgp.ct.dicom import read_folder_headers
from milgp.ct.label_rule import LabelRule, read_csv_rows
from milgp.ct.report_entry import ReportEntry, printable
from milgp.ct.series_policy import SeriesPolicy

__all__ = ["index_generic", "read_bag_labels", "read_slice_labels"]


def read_bag_labels(
    labels_csv: str | os.PathLike[str], rule: LabelRule = LabelRule()
) -> tuple[dict[str, tuple[float, str | None]], dict[str, str], list[str]]:
    """Bag labels from a ``bag_id,label[,patient_id]`` CSV.

    Identical duplicate rows are merged; a bag whose label ``rule`` refuses, or that is listed twice
    with different labels or patients, is invalid.

    Returns:
        ``(labels, invalid, unattributed)``: ``{bag_id: (label, patient_id or None)}`` for valid
        bags, ``{bag_id: reason}`` for invalid ones, and reasons for rows without a bag id.
        Reasons name the file and line.

    Raises:
        ValueError: naming the file when it cannot be read or lacks the ``bag_id``/``label`` columns.
    """
    name = printable(labels_csv)
    out: dict[str, tuple[float, str | None]] = {}
    line_of: dict[str, int] = {}
    invalid: dict[str, str] = {}
    unattributed: list[str] = []
    for line, row in read_csv_rows(labels_csv, ("bag_id", "label")):
        bag_id = row["bag_id"]
        if not bag_id:
            unattributed.append(f"{name}, line {line}: empty bag_id")
            continue
        try:
            label = rule.parse(row["label"])
        except ValueError as err:
            invalid.setdefault(bag_id, f"{name}, line {line}: bag {bag_id!r}: {err}")
            continue
        entry = (label, row.get("patient_id") or None)
        if bag_id in out and out[bag_id] != entry:
            invalid.setdefault(
                bag_id, f"{name}: bag {bag_id!r} is listed twice with different values (lines {line_of[bag_id]} and {line})"
            )
        line_of.setdefault(bag_id, line)
        out[bag_id] = entry
    return {k: v for k, v in out.items() if k not in invalid}, invalid, unattributed


def read_slice_labels(
    slice_labels_csv: str | os.PathLike[str], rule: LabelRule = LabelRule()
) -> tuple[dict[str, dict[str, int]], dict[str, str]]:
    """Slice labels from a ``bag_id,file,label`` CSV (``file`` relative to the bag folder).

    Slice labels are MIL instance labels: read by a binary :class:`LabelRule` with the entries of
    ``rule.mapping`` that map to 0 or 1 (so ``--label-map yes=1,no=0`` and ``1.0`` read as they
    do for bag labels, with any ``--target``).

    Returns:
        ``({bag_id: {file: 0/1}}, {bag_id: reason})``: a bag with a label the rule refuses or
        conflicting duplicate rows is invalid (the reason names the file and line).

    Raises:
        ValueError: naming the file when it cannot be read or lacks a column.
    """
    name = printable(slice_labels_csv)
    out: dict[str, dict[str, int]] = {}
    invalid: dict[str, str] = {}
    binary = LabelRule("binary", {k: v for k, v in rule.mapping.items() if v in (0.0, 1.0)})
    for line, row in read_csv_rows(slice_labels_csv, ("bag_id", "file", "label")):
        bag_id, file = row["bag_id"], Path(row["file"]).as_posix()
        try:
            value = int(binary.parse(row["label"]))
        except ValueError as err:
            invalid.setdefault(bag_id, f"{name}, line {line}: slice {bag_id}/{file}: {err}")
            continue
        per_bag = out.setdefault(bag_id, {})
        if file in per_bag and per_bag[file] != value:
            invalid.setdefault(bag_id, f"{name}, line {line}: conflicting labels for slice {bag_id}/{file}")
        per_bag[file] = value
    return out, invalid


def index_generic(
    root: str | os.PathLike[str],
    labels_csv: str | os.PathLike[str],
    slice_labels_csv: str | os.PathLike[str] | None = None,
    workers: int = 0,
    progress: bool = False,
    rule: LabelRule = LabelRule(),
    policy: SeriesPolicy = SeriesPolicy(),
) -> BagIndex:
    """Index a folder-per-bag layout.

    Args:
        root: folder holding one sub-folder per bag.
        labels_csv: bag labels (:func:`read_bag_labels`).
        slice_labels_csv: optional slice labels (:func:`read_slice_labels`); when given, every
            kept slice of a bag needs a row.
        workers, progress: header-reading processes and progress bar (:func:`milgp.ct.dicom.read_headers`).
        rule: bag-label validation (``LabelRule("aggregate")`` for aggregate targets); its
            mapping reads slice labels too (:func:`read_slice_labels`).
        policy: what a series may contain.

    Returns:
        A :class:`BagIndex` in ``labels_csv`` order. Folders not listed in ``labels_csv``,
        unreadable files and duplicates are in ``skipped``; bags left out whole in ``refused``.

    Raises:
        ValueError: naming the file or folder when ``root`` is not a folder or a label file cannot
            be read at all.
    """
    root_path = Path(os.path.abspath(root))  # absolute slice paths: the cache is usable from any directory
    if not root_path.is_dir():
        raise ValueError(f"{printable(root)}: not a folder")
    bag_labels, invalid, unattributed = read_bag_labels(labels_csv, rule)
    slice_labels, invalid_slices = read_slice_labels(slice_labels_csv, rule) if slice_labels_csv is not None else (None, {})
    listed = set(bag_labels) | set(invalid)
    skipped = [ReportEntry("", str(labels_csv), r) for r in unattributed]
    skipped += [
        ReportEntry(d.name, str(d), f"folder {d.name!r} is not listed in {printable(labels_csv)}")
        for d in sorted(root_path.iterdir())
        if d.is_dir() and d.name not in listed
    ]
    refused = [ReportEntry(b, str(labels_csv), f"bag left out: {why}") for b, why in invalid.items()]
    folders: dict[str, Path] = {}  # the bags whose folders are read, in labels_csv order
    for bag_id in bag_labels:
        folder = root_path / bag_id
        if bag_id in invalid_slices:
            refused.append(ReportEntry(bag_id, str(slice_labels_csv), f"bag left out: {invalid_slices[bag_id]}"))
            continue
        # not a plain folder name: 'scan_001/' or './scan_001' would reach scan_001's folder under another id
        if bag_id in (".", "..") or any(sep and sep in bag_id for sep in (os.sep, os.altsep)):
            refused.append(ReportEntry(bag_id, str(labels_csv), f"bag left out: its id in {printable(labels_csv)} "
                                                                 "is not a plain folder name (a path separator, '.' or '..')"))
            continue
        try:
            is_folder = folder.is_dir()
        except (OSError, ValueError) as err:  # a name too long for the file system, a NUL byte
            refused.append(ReportEntry(bag_id, str(labels_csv), f"bag left out: its id in {printable(labels_csv)} "
                                                                 f"cannot name a folder ({getattr(err, 'strerror', None) or err})"))
            continue
        if is_folder:
            folders[bag_id] = folder
        else:
            refused.append(ReportEntry(bag_id, str(folder), f"bag left out: listed in {printable(labels_csv)} but not a folder"))
    by_bag, unread = read_folder_headers(folders, workers, progress)
    skipped += unread
    index = BagIndex([], skipped, refused)
    for bag_id, series in by_bag.items():
        label, patient = bag_labels[bag_id]
        folder = root_path / bag_id
        if not series:
            why = next((f" (e.g. {printable(e.path)}: {e.reason})" for e in skipped if e.bag_id == bag_id), " (it holds no file)")
            index.refused.append(ReportEntry(bag_id, str(folder), f"bag left out: no readable DICOM image in its folder{why}"))
            continue
        labels_by_path = None
        if slice_labels is not None:
            given = slice_labels.get(bag_id, {})
            labels_by_path = {h.path: given[rel] for h in series if (rel := Path(h.path).relative_to(folder).as_posix()) in given}
        index.add_series(bag_id, series, label, labels_by_path, patient or bag_id, policy, str(folder))
    return index
