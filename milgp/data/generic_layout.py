"""Index users' own data: one folder per bag plus a CSV of bag labels.

Layout::

    root/<bag_id>/*.dcm            one CT series per folder (searched recursively)
    labels.csv                     bag_id,label[,patient_id]
    slice_labels.csv (optional)    bag_id,file,label   (file: path relative to root/<bag_id>)

Slices are ordered by geometry (:func:`milgp.data.dicom.order_slices`). Without ``patient_id``
each bag is its own patient.
"""
from __future__ import annotations

import csv
import os
from pathlib import Path

from milgp.data.ct_index import BagIndex, BagRecord, bag_from_headers
from milgp.data.dicom import SliceHeader, list_files, read_headers

__all__ = ["index_generic", "read_bag_labels", "read_slice_labels"]


def read_bag_labels(labels_csv: str | os.PathLike[str]) -> dict[str, tuple[float, str | None]]:
    """``{bag_id: (label, patient_id or None)}`` from a ``bag_id,label[,patient_id]`` CSV.

    Raises:
        ValueError: naming the file and line for missing columns, non-numeric labels or a bag
            listed twice.
    """
    out: dict[str, tuple[float, str | None]] = {}
    with open(labels_csv, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        missing = {"bag_id", "label"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{labels_csv}: missing columns {sorted(missing)}")
        for line, row in enumerate(reader, start=2):
            bag_id = row["bag_id"].strip()
            try:
                label = float(row["label"])
            except ValueError:
                raise ValueError(f"{labels_csv}, line {line}: label {row['label']!r} of bag {bag_id!r} is not a number") from None
            if bag_id in out:
                raise ValueError(f"{labels_csv}, line {line}: bag {bag_id!r} is listed twice")
            patient = (row.get("patient_id") or "").strip() or None
            out[bag_id] = (label, patient)
    return out


def read_slice_labels(slice_labels_csv: str | os.PathLike[str]) -> dict[str, dict[str, int]]:
    """``{bag_id: {file: 0/1}}`` from a ``bag_id,file,label`` CSV (``file`` relative to the bag folder).

    Raises:
        ValueError: naming the file and line for missing columns, labels other than 0/1, or
            conflicting duplicate rows.
    """
    out: dict[str, dict[str, int]] = {}
    with open(slice_labels_csv, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        missing = {"bag_id", "file", "label"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{slice_labels_csv}: missing columns {sorted(missing)}")
        for line, row in enumerate(reader, start=2):
            bag_id, name, value = row["bag_id"].strip(), Path(row["file"].strip()).as_posix(), row["label"].strip()
            if value not in ("0", "1"):
                raise ValueError(f"{slice_labels_csv}, line {line}: label {value!r} of {bag_id}/{name} is not 0 or 1")
            per_bag = out.setdefault(bag_id, {})
            if name in per_bag and per_bag[name] != int(value):
                raise ValueError(f"{slice_labels_csv}, line {line}: conflicting labels for slice {bag_id}/{name}")
            per_bag[name] = int(value)
    return out


def index_generic(
    root: str | os.PathLike[str],
    labels_csv: str | os.PathLike[str],
    slice_labels_csv: str | os.PathLike[str] | None = None,
    workers: int = 0,
    progress: bool = False,
) -> BagIndex:
    """Index a folder-per-bag layout.

    Args:
        root: folder holding one sub-folder per bag.
        labels_csv: bag labels (:func:`read_bag_labels`); every listed bag must have a folder.
        slice_labels_csv: optional slice labels (:func:`read_slice_labels`); when given, every
            readable slice of every bag needs a row.
        workers: processes for header reading.
        progress: show a progress bar while reading headers.

    Returns:
        A :class:`BagIndex` in ``labels_csv`` order. Folders not listed in ``labels_csv``,
        unreadable files and bags that cannot be ordered are listed in ``skipped``.

    Raises:
        ValueError: naming the bag for a listed bag without a folder (or without any readable
            slice), and naming the slice for a missing slice label.
    """
    root_path = Path(root)
    if not root_path.is_dir():
        raise ValueError(f"{root}: not a folder")
    bag_labels = read_bag_labels(labels_csv)
    slice_labels = read_slice_labels(slice_labels_csv) if slice_labels_csv is not None else None
    skipped: list[tuple[str, str]] = [
        (str(d), f"folder {d.name!r} is not listed in {labels_csv}")
        for d in sorted(root_path.iterdir())
        if d.is_dir() and d.name not in bag_labels
    ]
    bag_of: dict[str, str] = {}
    for bag_id in bag_labels:
        folder = root_path / bag_id
        if not folder.is_dir():
            raise ValueError(f"bag {bag_id!r} is listed in {labels_csv} but {folder} is not a folder")
        bag_of.update({f: bag_id for f in list_files(folder)})
    headers, bad = read_headers(list(bag_of), workers=workers, progress=progress)
    skipped.extend(bad)
    by_bag: dict[str, list[SliceHeader]] = {bag_id: [] for bag_id in bag_labels}
    for h in headers:
        by_bag[bag_of[h.path]].append(h)
    bags: list[BagRecord] = []
    for bag_id, (label, patient) in bag_labels.items():
        series = by_bag[bag_id]
        if not series:
            raise ValueError(f"bag {bag_id!r}: no readable DICOM image in {root_path / bag_id}")
        labels_by_path = None
        if slice_labels is not None:
            given = slice_labels.get(bag_id, {})
            labels_by_path = {}
            for h in series:
                rel = Path(h.path).relative_to(root_path / bag_id).as_posix()
                if rel not in given:
                    raise ValueError(f"bag {bag_id!r}: slice {rel!r} has no row in {slice_labels_csv}")
                labels_by_path[h.path] = given[rel]
        try:
            bags.append(bag_from_headers(bag_id, series, label, labels_by_path, patient_id=patient or bag_id))
        except ValueError as err:
            skipped.append((str(root_path / bag_id), f"bag {bag_id!r} left out: {err}"))
    return BagIndex(bags, skipped)
