"""Index the RSNA Intracranial Hemorrhage Detection layout into bags (one bag per CT series).

Layout: one folder of ``ID_<image>.dcm`` slices (``stage_2_train/``) and the label file
``stage_2_train.csv`` with rows ``ID,Label`` where ``ID = ID_<image>_<subtype>`` for the subtypes
in :data:`RSNA_SUBTYPES`. Series are found from the DICOM headers (:func:`index_rsna`).
"""
from __future__ import annotations

import os
from pathlib import Path

from milgp.ct.index import BagIndex
from milgp.ct.dicom import SliceHeader, read_headers
from milgp.ct.label_rule import LabelRule, read_csv_rows
from milgp.ct.report_entry import ReportEntry, printable
from milgp.ct.series_policy import SeriesPolicy

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


def read_rsna_labels(
    csv_path: str | os.PathLike[str], rule: LabelRule = LabelRule()
) -> tuple[dict[str, dict[str, int]], dict[str, str], list[str]]:
    """Per-image subtype labels from an RSNA ``stage_2_train.csv``.

    Which rows are merged and which make an image invalid: ``docs/ct_data.md``, "Layouts" (RSNA).

    Args:
        csv_path: the label file (columns ``ID,Label``).
        rule: label validation (binary; a mapping for other encodings).

    Returns:
        ``(labels, invalid, unattributed)``: ``{image_id: {subtype: 0 or 1}}`` for valid images
        (``image_id`` like ``"ID_63eb1e259"``), ``{image_id: reason}`` for invalid ones, and the
        reasons for rows that name no image (a malformed ID). Reasons name the file and line.

    Raises:
        ValueError: naming the file when it cannot be read or lacks the ``ID``/``Label`` columns.
    """
    if rule.target != "binary":
        raise ValueError(f"RSNA labels are binary slice labels, not {rule.target!r} targets")
    name = printable(csv_path)
    labels: dict[str, dict[str, int]] = {}
    first_line: dict[tuple[str, str], int] = {}
    invalid: dict[str, str] = {}
    unattributed: list[str] = []
    for line, row in read_csv_rows(csv_path, ("ID", "Label")):
        key = row["ID"]
        image_id, sep, subtype = key.rpartition("_")
        if not sep or not image_id.startswith("ID_"):
            unattributed.append(f"{name}, line {line}: ID {key!r} is not of the form ID_<image>_<subtype>")
            continue
        if subtype not in RSNA_SUBTYPES:
            invalid.setdefault(image_id, f"{name}, line {line}: unknown subtype {subtype!r} in {key!r}")
            continue
        try:
            value = int(rule.parse(row["Label"]))
        except ValueError as err:
            invalid.setdefault(image_id, f"{name}, line {line}: {key}: {err}")
            continue
        per_image = labels.setdefault(image_id, {})
        if subtype in per_image and per_image[subtype] != value:
            invalid.setdefault(
                image_id,
                f"{name}: conflicting duplicate rows for image {image_id}, subtype {subtype}: "
                f"label {per_image[subtype]} on line {first_line[(image_id, subtype)]}, {value} on line {line}",
            )
        first_line.setdefault((image_id, subtype), line)
        per_image[subtype] = value
    for image_id, per_image in labels.items():
        if "any" not in per_image:
            invalid.setdefault(image_id, f"{name}: image {image_id} has no '{image_id}_any' row (the slice label)")
    return {k: v for k, v in labels.items() if k not in invalid}, invalid, unattributed


def index_rsna(
    image_dir: str | os.PathLike[str],
    labels_csv: str | os.PathLike[str],
    workers: int = 0,
    progress: bool = False,
    rule: LabelRule = LabelRule(),
    policy: SeriesPolicy = SeriesPolicy(),
) -> BagIndex:
    """Index an RSNA-layout folder into one bag per series.

    Args:
        image_dir: folder of ``ID_*.dcm`` files (not searched recursively).
        labels_csv: the ``stage_2_train.csv`` label file (:func:`read_rsna_labels`).
        workers, progress: header-reading processes and progress bar (:func:`milgp.ct.dicom.read_headers`).
        rule: label validation (a mapping for other label encodings).
        policy: what a series may contain (:class:`milgp.ct.series_policy.SeriesPolicy`).

    Returns:
        A :class:`BagIndex`: ``bag_id`` = SeriesInstanceUID, ``patient_id`` = PatientID, slices
        ordered along the scan axis, slice labels = ``any``, bag label = max of slice labels.
        Unreadable files are listed in ``skipped``; label rows of images that have no file, one
        warning (their count and a few image ids); a series with an image whose label is invalid
        or missing, or that :func:`milgp.ct.series_check.check_series` refuses, is left out whole
        and listed in ``refused``, so that no bag is ever half present.

    Raises:
        ValueError: for a missing or empty folder, and for a label file that cannot be read at all.
    """
    if not Path(image_dir).is_dir():
        raise ValueError(f"{printable(image_dir)}: not a folder")
    files = sorted(Path(os.path.abspath(image_dir)).glob("ID_*.dcm"))  # absolute: the cache is usable from any directory
    if not files:
        raise ValueError(f"{printable(image_dir)}: no ID_*.dcm files (expected the RSNA stage_2_train layout)")
    labels, invalid, unattributed = read_rsna_labels(labels_csv, rule)
    headers, unread = read_headers(files, workers=workers, progress=progress)
    skipped = [ReportEntry("", p, r) for p, r in unread] + [ReportEntry("", str(labels_csv), r) for r in unattributed]
    by_series: dict[str, list[SliceHeader]] = {}
    for h in headers:
        if not h.series_uid:
            skipped.append(ReportEntry("", h.path, "no SeriesInstanceUID: cannot tell which scan the slice belongs to"))
            continue
        by_series.setdefault(h.series_uid, []).append(h)
    index = BagIndex([], skipped)
    found = {f.stem for f in files}
    orphans = sorted(image_id for image_id in (*labels, *invalid) if image_id not in found)
    if orphans:  # nothing is left out for them, but a label file for other images, or lost files, should be seen
        shown = ", ".join(orphans[:3]) + (f" and {len(orphans) - 3} more" if len(orphans) > 3 else "")
        index.warnings.append(ReportEntry(
            "", str(labels_csv), f"{len(orphans)} images have rows in the label file but no file {printable(image_dir)}/<image>.dcm "
                                 f"({printable(shown)}); their rows are not used",
        ))
    for series_uid in sorted(by_series):
        series = by_series[series_uid]
        unlabelled = [h for h in series if Path(h.path).stem not in labels]
        if unlabelled:
            stem = Path(unlabelled[0].path).stem
            why = invalid.get(stem, f"image {stem} has no rows in the label file {printable(labels_csv)}")
            index.refused.append(ReportEntry(
                series_uid, unlabelled[0].path,
                f"series left out: {len(unlabelled)} of its {len(series)} slices have no valid label (e.g. {why})",
            ))
            continue
        slice_labels = {h.path: labels[Path(h.path).stem]["any"] for h in series}
        index.add_series(series_uid, series, None, slice_labels, series[0].patient_id or series[0].study_uid, policy, series[0].path)
    return index
