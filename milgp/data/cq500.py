"""Index the CQ500 layout into bags (one non-contrast series per study).

Layout: one folder per study, e.g. ``CQ500CT1 CQ500CT1/Unknown Study/CT 5mm/*.dcm``, holding
several series (thin and thick reconstructions, bone kernels, sometimes post-contrast), and
``reads.csv`` with columns ``name`` (``CQ500-CT-1``), ``Category``, ``R1:ICH``, ``R2:ICH``,
``R3:ICH``, ... The bag label is the majority vote of the three readers' ``ICH`` reads. Slice
labels are unknown (``None``).

Series selection rule (:func:`choose_series`), applied to the series of one study:

1. keep axial series only (slice normal within ~25 degrees of the patient z axis; series without
   geometry are kept);
2. drop contrast-enhanced series: ContrastBolusAgent set to anything but empty/``NONE``/``NO``,
   or a SeriesDescription matching ``POST``, ``CONTRAST``, ``C+`` or ``CE`` -- unless it says
   ``PRE``/``NON``/``NO``/``WITHOUT``/``W/O`` contrast, or ``PLAIN``;
3. among the rest prefer, in order: a soft/plain kernel over a bone kernel (``BONE`` in the
   description or ConvolutionKernel), slice thickness closest to 5 mm, most slices, and finally
   the smallest SeriesInstanceUID (for determinism).
"""
from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from milgp.data.ct_index import BagIndex, BagRecord, bag_from_headers
from milgp.data.dicom import SliceHeader, list_files, read_headers, slice_normal

__all__ = [
    "CQ500_READERS",
    "SeriesSummary",
    "choose_series",
    "cq500_number",
    "index_cq500",
    "is_contrast_series",
    "read_cq500_labels",
]

#: Reader columns whose majority gives the CQ500 bag label.
CQ500_READERS: tuple[str, ...] = ("R1:ICH", "R2:ICH", "R3:ICH")
_NAME_RE = re.compile(r"CQ500[\s_-]*CT[\s_-]*(\d+)", re.IGNORECASE)
_NEGATED_CONTRAST_RE = re.compile(r"\b(PRE|NON|NO|WITHOUT|W/O)[\s_-]*(CONTRAST|C\+|CE)(?!\w)|\bPLAIN\b", re.IGNORECASE)
_CONTRAST_RE = re.compile(r"\bPOST\b|CONTRAST|C\+|\bCE\b", re.IGNORECASE)
_NO_AGENT = {"", "NONE", "NO", "N/A", "NA", "0"}
_TARGET_THICKNESS_MM = 5.0
_AXIAL_MIN_COS = 0.9


def cq500_number(name: str) -> int:
    """Study number from a CQ500 study folder or ``reads.csv`` name.

    ``"CQ500CT1 CQ500CT1"``, ``"CQ500-CT-1"`` and ``"cq500_ct_1"`` all give ``1``.

    Raises:
        ValueError: naming ``name`` when it holds no ``CQ500...CT<n>`` pattern.
    """
    m = _NAME_RE.search(name)
    if m is None:
        raise ValueError(f"{name!r} is not a CQ500 study name (expected e.g. 'CQ500-CT-1' or 'CQ500CT1 CQ500CT1')")
    return int(m.group(1))


def read_cq500_labels(reads_csv: str | os.PathLike[str]) -> dict[int, tuple[str, float]]:
    """Majority-vote ICH labels from CQ500 ``reads.csv``.

    Returns:
        ``{study number: (name as in the file, label 0.0/1.0)}``; label = 1 when at least two of
        :data:`CQ500_READERS` say 1.

    Raises:
        ValueError: naming the file and line for missing columns, unparsable names, reads other
            than 0/1, or the same study listed twice.
    """
    out: dict[int, tuple[str, float]] = {}
    with open(reads_csv, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        missing = {"name", *CQ500_READERS} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{reads_csv}: missing columns {sorted(missing)}")
        for line, row in enumerate(reader, start=2):
            try:
                number = cq500_number(row["name"])
                votes = [int(float(row[r])) for r in CQ500_READERS]
            except ValueError as err:
                raise ValueError(f"{reads_csv}, line {line}: {err}") from err
            if any(v not in (0, 1) for v in votes):
                raise ValueError(f"{reads_csv}, line {line}: reads {votes} for {row['name']} are not 0/1")
            if number in out:
                raise ValueError(f"{reads_csv}, line {line}: study {row['name']} is listed twice")
            out[number] = (row["name"].strip(), float(sum(votes) >= 2))
    return out


def is_contrast_series(description: str, contrast_agent: str) -> bool:
    """Whether a series looks contrast-enhanced (rule 2 of the module docstring)."""
    if contrast_agent.strip().upper() not in _NO_AGENT:
        return True
    if _NEGATED_CONTRAST_RE.search(description):
        return False
    return bool(_CONTRAST_RE.search(description))


@dataclass(frozen=True)
class SeriesSummary:
    """What :func:`choose_series` needs to know about one series."""

    series_uid: str
    description: str
    contrast_agent: str
    kernel: str
    thickness_mm: float | None
    num_slices: int
    axial: bool

    @classmethod
    def from_headers(cls, headers: Sequence[SliceHeader]) -> "SeriesSummary":
        h = headers[0]
        axial = True
        if h.orientation is not None:
            axial = abs(float(slice_normal(h.orientation)[2])) >= _AXIAL_MIN_COS
        return cls(
            series_uid=h.series_uid,
            description=h.series_description,
            contrast_agent=h.contrast_agent,
            kernel=h.convolution_kernel,
            thickness_mm=h.slice_thickness,
            num_slices=len(headers),
            axial=axial,
        )


def choose_series(series: Sequence[SeriesSummary]) -> SeriesSummary | None:
    """Pick one non-contrast series of a study by the rule in the module docstring (``None`` if none qualifies)."""
    candidates = [s for s in series if s.axial and not is_contrast_series(s.description, s.contrast_agent)]
    if not candidates:
        return None

    def rank(s: SeriesSummary) -> tuple[int, float, int, str]:
        bone = int("BONE" in s.description.upper() or "BONE" in s.kernel.upper())
        thickness_gap = abs(s.thickness_mm - _TARGET_THICKNESS_MM) if s.thickness_mm is not None else np.inf
        return bone, thickness_gap, -s.num_slices, s.series_uid

    return min(candidates, key=rank)


def index_cq500(
    root: str | os.PathLike[str],
    reads_csv: str | os.PathLike[str],
    workers: int = 0,
    progress: bool = False,
) -> BagIndex:
    """Index a CQ500 download: one bag per study that has a label and an eligible series.

    Args:
        root: folder holding the study folders (``CQ500CT<n> CQ500CT<n>/...``, searched
            recursively for DICOM files).
        reads_csv: the ``reads.csv`` file (:func:`read_cq500_labels`).
        workers: processes for header reading.
        progress: show a progress bar while reading headers.

    Returns:
        A :class:`BagIndex` with ``bag_id`` = the ``reads.csv`` name (``CQ500-CT-1``),
        ``patient_id`` = the same (one study per patient), slices of the chosen series
        (:func:`choose_series`) ordered along the scan axis, ``slice_labels = None``. Studies
        without a ``reads.csv`` row or without an eligible series, and unreadable files, are listed
        in ``skipped``.

    Raises:
        ValueError: when ``root`` holds no CQ500 study folder, or for ``reads.csv`` errors.
    """
    if not Path(root).is_dir():
        raise ValueError(f"{root}: not a folder")
    labels = read_cq500_labels(reads_csv)
    studies: dict[int, Path] = {}
    for d in sorted(Path(root).iterdir()):
        if d.is_dir() and _NAME_RE.search(d.name):
            number = cq500_number(d.name)
            if number in studies:
                raise ValueError(f"{root}: study CQ500-CT-{number} has two folders, {studies[number]} and {d}")
            studies[number] = d
    if not studies:
        raise ValueError(f"{root}: no CQ500 study folders (expected names like 'CQ500CT1 CQ500CT1')")
    skipped: list[tuple[str, str]] = []
    files_of: dict[int, list[str]] = {}
    for number, folder in sorted(studies.items()):
        if number not in labels:
            skipped.append((str(folder), f"study CQ500-CT-{number} has no row in {reads_csv}"))
        else:
            files_of[number] = list_files(folder)
    study_of = {f: number for number, files in files_of.items() for f in files}
    headers, bad = read_headers(list(study_of), workers=workers, progress=progress)
    skipped.extend(bad)
    by_study: dict[int, dict[str, list[SliceHeader]]] = {number: {} for number in files_of}
    for h in headers:
        by_study[study_of[h.path]].setdefault(h.series_uid, []).append(h)
    bags: list[BagRecord] = []
    for number, by_series in by_study.items():
        name, label = labels[number]
        folder = studies[number]
        chosen = choose_series([SeriesSummary.from_headers(hs) for hs in by_series.values()])
        if chosen is None:
            skipped.append((str(folder), f"study {name}: no axial non-contrast series among {len(by_series)}"))
            continue
        try:
            bags.append(bag_from_headers(name, by_series[chosen.series_uid], label, None, patient_id=name))
        except ValueError as err:
            skipped.append((str(folder), f"study {name} left out: {err}"))
    return BagIndex(bags, skipped)
