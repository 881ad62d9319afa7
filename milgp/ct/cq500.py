"""Index the CQ500 layout into bags (one non-contrast series per study).

Layout: one folder per study, e.g. ``CQ500CT1 CQ500CT1/Unknown Study/CT 5mm/*.dcm``, holding
several series (thin and thick reconstructions, bone kernels, sometimes post-contrast), and
``reads.csv`` with columns ``name`` (``CQ500-CT-1``), ``Category``, ``R1:ICH``, ``R2:ICH``,
``R3:ICH``, ... The bag label is the majority vote of the three readers' ``ICH`` reads. Slice
labels are unknown (``None``). The series selection rule (:func:`choose_series`) is listed in
``docs/ct_data.md``, "Layouts" (CQ500).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from milgp.ct.index import BagIndex
from milgp.ct.dicom import SliceHeader, read_folder_headers
from milgp.ct.label_rule import LabelRule, read_csv_rows
from milgp.ct.report_entry import ReportEntry, printable
from milgp.ct.series_check import tilt_deg
from milgp.ct.series_policy import SeriesPolicy

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


def read_cq500_labels(
    reads_csv: str | os.PathLike[str], rule: LabelRule = LabelRule()
) -> tuple[dict[int, tuple[str, float]], dict[int, str], list[str]]:
    """Majority-vote ICH labels from CQ500 ``reads.csv``.

    Returns:
        ``(labels, invalid, unattributed)``: ``{study number: (name as in the file, label
        0.0/1.0)}`` with label = 1 when at least two of :data:`CQ500_READERS` say 1; ``{study
        number: reason}`` for studies whose reads ``rule`` refuses or that are listed twice with
        different reads (any of the three, even when the majority agrees); reasons for rows whose name is not a CQ500 study. Reasons name the file
        and line.

    Raises:
        ValueError: naming the file when it cannot be read or lacks a column.
    """
    if rule.target != "binary":
        raise ValueError(f"CQ500 reads are binary, not {rule.target!r} targets")
    name = printable(reads_csv)
    out: dict[int, tuple[str, float]] = {}
    reads_of: dict[int, list[float]] = {}
    line_of: dict[int, int] = {}
    invalid: dict[int, str] = {}
    unattributed: list[str] = []
    for line, row in read_csv_rows(reads_csv, ("name", *CQ500_READERS)):
        try:
            number = cq500_number(row["name"])
        except ValueError as err:
            unattributed.append(f"{name}, line {line}: {err}")
            continue
        try:
            votes = [rule.parse(row[r]) for r in CQ500_READERS]
        except ValueError as err:
            invalid.setdefault(number, f"{name}, line {line}: study {row['name']}: {err}")
            continue
        if number in out and reads_of[number] != votes:  # the reads, not only their majority: one of the rows is wrong
            invalid.setdefault(number, f"{name}: study {row['name']} is listed twice with different reads (lines {line_of[number]} "
                                       f"and {line}: {'/'.join(f'{v:g}' for v in reads_of[number])} vs {'/'.join(f'{v:g}' for v in votes)})")
        line_of.setdefault(number, line)
        reads_of.setdefault(number, votes)
        out.setdefault(number, (row["name"], float(sum(votes) >= 2)))
    return {k: v for k, v in out.items() if k not in invalid}, invalid, unattributed


def is_contrast_series(description: str, contrast_agent: str) -> bool:
    """Whether a series looks contrast-enhanced: ContrastBolusAgent set to anything but empty/``NONE``/``NO``,
    or a SeriesDescription matching ``POST``, ``CONTRAST``, ``C+`` or ``CE`` -- unless it says
    ``PRE``/``NON``/``NO``/``WITHOUT``/``W/O`` contrast, or ``PLAIN``."""
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
    def from_headers(cls, headers: Sequence[SliceHeader], policy: SeriesPolicy = SeriesPolicy()) -> "SeriesSummary":
        """Summary of one series; ``axial`` by ``policy.max_tilt_deg`` (a degenerate orientation is
        not axial)."""
        h = headers[0]
        axial = True
        if h.orientation is not None:
            try:
                axial = tilt_deg(h.orientation) <= policy.max_tilt_deg
            except ValueError:
                axial = False
        return cls(
            series_uid=h.series_uid,
            description=h.series_description,
            contrast_agent=h.contrast_agent,
            kernel=h.convolution_kernel,
            thickness_mm=h.slice_thickness,
            num_slices=len(headers),
            axial=axial,
        )


def choose_series(series: Sequence[SeriesSummary], allow_non_axial: bool = False) -> SeriesSummary | None:
    """Pick one non-contrast series of a study (``None`` if none qualifies): axial series only
    (series without geometry count as axial; ``allow_non_axial`` admits the others, ranked after
    every axial one), then a soft/plain kernel over a bone kernel (``BONE`` in the description or
    ConvolutionKernel), slice thickness closest to 5 mm, most slices, smallest SeriesInstanceUID."""
    candidates = [s for s in series if (s.axial or allow_non_axial) and not is_contrast_series(s.description, s.contrast_agent)]
    if not candidates:
        return None

    def rank(s: SeriesSummary) -> tuple[int, int, float, int, str]:
        bone = int("BONE" in s.description.upper() or "BONE" in s.kernel.upper())
        thickness_gap = abs(s.thickness_mm - _TARGET_THICKNESS_MM) if s.thickness_mm is not None else np.inf
        return int(not s.axial), bone, thickness_gap, -s.num_slices, s.series_uid

    return min(candidates, key=rank)


def index_cq500(
    root: str | os.PathLike[str],
    reads_csv: str | os.PathLike[str],
    workers: int = 0,
    progress: bool = False,
    rule: LabelRule = LabelRule(),
    policy: SeriesPolicy = SeriesPolicy(),
) -> BagIndex:
    """Index a CQ500 download: one bag per study that has a valid label and an eligible series.

    Args:
        root: folder holding the study folders (``CQ500CT<n> CQ500CT<n>/...``, searched
            recursively for DICOM files).
        reads_csv: the ``reads.csv`` file (:func:`read_cq500_labels`).
        workers, progress: header-reading processes and progress bar (:func:`milgp.ct.dicom.read_headers`).
        rule: read validation (a mapping for other encodings).
        policy: what a series may contain; files it refuses (non-CT, localizers) are left out
            before a series is chosen.

    Returns:
        A :class:`BagIndex` with ``bag_id`` = the ``reads.csv`` name (``CQ500-CT-1``),
        ``patient_id`` = the same (one study per patient), slices of the chosen series
        (:func:`choose_series`) ordered along the scan axis, ``slice_labels = None``. Unreadable
        and refused files are listed in ``skipped``; studies without a valid ``reads.csv`` row or
        without an eligible series in ``refused``.

    Raises:
        ValueError: when ``root`` holds no CQ500 study folder, or ``reads.csv`` cannot be read.
    """
    if not Path(root).is_dir():
        raise ValueError(f"{printable(root)}: not a folder")
    labels, invalid, unattributed = read_cq500_labels(reads_csv, rule)
    studies: dict[int, Path] = {}
    ambiguous: set[int] = set()
    refused: list[ReportEntry] = []
    for d in sorted(Path(os.path.abspath(root)).iterdir()):  # absolute: the cache is usable from any directory
        if d.is_dir() and _NAME_RE.search(d.name):
            number = cq500_number(d.name)
            if number in studies:
                ambiguous.add(number)
                refused.append(ReportEntry(f"CQ500-CT-{number}", str(d), f"study has two folders, {printable(studies[number])} and this one; neither used"))
            studies[number] = d
    if not studies:
        raise ValueError(f"{printable(root)}: no CQ500 study folders (expected names like 'CQ500CT1 CQ500CT1')")
    skipped = [ReportEntry("", str(reads_csv), r) for r in unattributed]
    folders: dict[str, Path] = {}  # the studies whose folders are read, by their reads.csv name
    for number, folder in sorted(studies.items()):
        bag = labels[number][0] if number in labels else f"CQ500-CT-{number}"
        if number in ambiguous:
            continue
        if number in invalid:
            refused.append(ReportEntry(bag, str(folder), f"study left out: {invalid[number]}"))
        elif number not in labels:
            refused.append(ReportEntry(bag, str(folder), f"study CQ500-CT-{number} has no row in {printable(reads_csv)}"))
        else:
            folders[bag] = folder
    headers_of, unread = read_folder_headers(folders, workers, progress)
    skipped += unread
    by_study: dict[str, dict[str, list[SliceHeader]]] = {name: {} for name in folders}
    for name, headers in headers_of.items():
        kept, left_out = policy.screen(headers, name)
        skipped += left_out
        for h in kept:
            by_study[name].setdefault(h.series_uid, []).append(h)
    index = BagIndex([], skipped, refused)
    label_of = dict(labels.values())
    for name, by_series in by_study.items():
        chosen = choose_series([SeriesSummary.from_headers(hs, policy) for hs in by_series.values()], policy.allow_non_axial)
        if chosen is None:
            index.refused.append(ReportEntry(name, str(folders[name]), f"study {name}: no axial non-contrast CT series among {len(by_series)}"))
            continue
        index.add_series(name, by_series[chosen.series_uid], label_of[name], None, name, policy, str(folders[name]))
    return index
