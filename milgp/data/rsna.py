"""Index the RSNA Intracranial Hemorrhage Detection layout into bags (one bag per CT series).

Layout: one folder of ``ID_<image>.dcm`` slices (``stage_2_train/``) and the label file
``stage_2_train.csv`` with rows ``ID,Label`` where ``ID = ID_<image>_<subtype>`` for the subtypes
in :data:`RSNA_SUBTYPES`. Series are found from the DICOM headers (SeriesInstanceUID; patient from
PatientID), slices ordered by geometry; a slice's label is its ``any`` label and the bag label is
the maximum over its slices.
"""
from __future__ import annotations

import csv
import os
from pathlib import Path

from milgp.data.ct_index import BagIndex, BagRecord, bag_from_headers
from milgp.data.dicom import SliceHeader, read_headers

__all__ = ["RSNA_SUBTYPES", "index_rsna", "read_rsna_labels"]

#: Hemorrhage subtypes of the RSNA label file; ``any`` is the slice-level hemorrhage label.
RSNA_SUBTYPES: tuple[str, ...] = (
    "epidural",
    "intraparenchymal",
    "intraventricular",
    "subarachnoid",
    "subdural",
    "any",
)


def read_rsna_labels(csv_path: str | os.PathLike[str]) -> dict[str, dict[str, int]]:
    """Per-image subtype labels from an RSNA ``stage_2_train.csv``.

    Duplicate rows with the same label (the real file has some) are merged.

    Returns:
        ``{image_id: {subtype: 0 or 1}}`` with ``image_id`` like ``"ID_63eb1e259"``.

    Raises:
        ValueError: naming the file and line for a bad header, a malformed ID, an unknown subtype,
            or a label other than 0/1; naming the image for conflicting duplicate rows or an image
            without its ``any`` row.
    """
    labels: dict[str, dict[str, int]] = {}
    first_line: dict[tuple[str, str], int] = {}
    with open(csv_path, newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None or [h.strip() for h in header[:2]] != ["ID", "Label"]:
            raise ValueError(f"{csv_path}: expected header 'ID,Label', got {header!r}")
        for line, row in enumerate(reader, start=2):
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) < 2:
                raise ValueError(f"{csv_path}, line {line}: expected 'ID,Label', got {row!r}")
            key, value = row[0].strip(), row[1].strip()
            image_id, sep, subtype = key.rpartition("_")
            if not sep or not image_id.startswith("ID_"):
                raise ValueError(f"{csv_path}, line {line}: ID {key!r} is not of the form ID_<image>_<subtype>")
            if subtype not in RSNA_SUBTYPES:
                raise ValueError(f"{csv_path}, line {line}: unknown subtype {subtype!r} in {key!r}")
            if value not in ("0", "1"):
                raise ValueError(f"{csv_path}, line {line}: label {value!r} for {key!r} is not 0 or 1")
            per_image = labels.setdefault(image_id, {})
            if subtype in per_image and per_image[subtype] != int(value):
                raise ValueError(
                    f"{csv_path}: conflicting duplicate rows for image {image_id}, subtype {subtype}: "
                    f"label {per_image[subtype]} on line {first_line[(image_id, subtype)]}, {value} on line {line}"
                )
            first_line.setdefault((image_id, subtype), line)
            per_image[subtype] = int(value)
    for image_id, per_image in labels.items():
        if "any" not in per_image:
            raise ValueError(f"{csv_path}: image {image_id} has no '{image_id}_any' row (the slice label)")
    return labels


def index_rsna(
    image_dir: str | os.PathLike[str],
    labels_csv: str | os.PathLike[str],
    workers: int = 0,
    progress: bool = False,
) -> BagIndex:
    """Index an RSNA-layout folder into one bag per series.

    Args:
        image_dir: folder of ``ID_*.dcm`` files (not searched recursively).
        labels_csv: the ``stage_2_train.csv`` label file (:func:`read_rsna_labels`).
        workers: processes for header reading (see :func:`milgp.data.dicom.read_headers`).
        progress: show a progress bar while reading headers.

    Returns:
        A :class:`BagIndex`: ``bag_id`` = SeriesInstanceUID, ``patient_id`` = PatientID, slices
        ordered along the scan axis, slice labels = ``any``, bag label = max of slice labels.
        Unreadable files and series that cannot be one bag (mixed image sizes, unorderable) are
        left out and listed in ``skipped``.

    Raises:
        ValueError: for an empty folder, for label-file errors, and naming the image for a
            ``.dcm`` file that has no rows in the label file.
    """
    if not Path(image_dir).is_dir():
        raise ValueError(f"{image_dir}: not a folder")
    files = sorted(Path(image_dir).glob("ID_*.dcm"))
    if not files:
        raise ValueError(f"{image_dir}: no ID_*.dcm files (expected the RSNA stage_2_train layout)")
    labels = read_rsna_labels(labels_csv)
    for f in files:
        if f.stem not in labels:
            raise ValueError(f"image {f.stem} ({f}) has no rows in the label file {labels_csv}")
    headers, skipped = read_headers(files, workers=workers, progress=progress)
    by_series: dict[str, list[SliceHeader]] = {}
    for h in headers:
        if not h.series_uid:
            skipped.append((h.path, "no SeriesInstanceUID: cannot tell which scan the slice belongs to"))
            continue
        by_series.setdefault(h.series_uid, []).append(h)
    bags: list[BagRecord] = []
    for series_uid in sorted(by_series):
        series = by_series[series_uid]
        slice_labels = {h.path: labels[Path(h.path).stem]["any"] for h in series}
        try:
            bags.append(
                bag_from_headers(
                    bag_id=series_uid,
                    headers=series,
                    bag_label=float(max(slice_labels.values())),
                    slice_labels_by_path=slice_labels,
                    patient_id=series[0].patient_id or series[0].study_uid,
                )
            )
        except ValueError as err:
            skipped.append((series[0].path, f"series {series_uid} left out: {err}"))
    return BagIndex(bags, skipped)
