"""One CT series from disk as an ordered ``(S, H, W)`` volume: :func:`load_series`."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from milgp.ct.dicom import read_headers, walk_files
from milgp.ct.hounsfield import read_series_values
from milgp.ct.report_entry import ReportEntry, printable
from milgp.ct.series_check import SeriesRefused, check_series
from milgp.ct.series_policy import SeriesPolicy

__all__ = ["CTSeries", "load_series"]


@dataclass
class CTSeries:
    """One series ordered along the scan axis.

    Attributes:
        hu: ``(S, H, W)`` float32 values, slice 0 first along the slice normal: Hounsfield units
            when ``units == "HU"`` (CT), the modality's rescaled values otherwise.
        paths: the ``S`` files, in the same order.
        positions: ``(S,)`` float64 positions in mm along the slice normal (``ordering ==
            "geometry"``) or the instance numbers (``"instance_number"``).
        series_uid: SeriesInstanceUID.
        ordering: ``"geometry"`` or ``"instance_number"``.
        skipped: files left out (unreadable, non-DICOM, no pixels, not CT, duplicates), with reasons.
        units: ``"HU"`` for CT; other modalities (only with ``allow_non_ct``) say they are not HU.
        warnings: findings that did not refuse the series (gaps, assumed rescale, clamped air).
    """

    hu: np.ndarray
    paths: list[str]
    positions: np.ndarray
    series_uid: str
    ordering: str
    skipped: list[ReportEntry] = field(default_factory=list)
    units: str = "HU"
    warnings: list[ReportEntry] = field(default_factory=list)


def load_series(
    directory_or_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    policy: SeriesPolicy = SeriesPolicy(),
) -> CTSeries:
    """Read one CT series (a folder, searched recursively, or a list of files), ordered along the scan axis.

    Headers are read first (no pixels) to check and order the series
    (:func:`milgp.ct.series_check.check_series`); then pixels are read. Unreadable files,
    non-CT files and duplicate slices are skipped and listed in ``CTSeries.skipped``; gaps, an
    assumed default rescale and air clamped by the 12-bit repair are listed in
    ``CTSeries.warnings`` and warned about once (``UserWarning``), not once per slice.

    Raises:
        ValueError: one line naming the folder/files when there is no readable image, or the series
            is refused (:class:`~milgp.ct.series_check.SeriesRefused`: mixed series or sizes,
            non-axial, interleaved acquisitions, different images at one position).
    """
    if isinstance(directory_or_paths, (str, os.PathLike)):
        name = printable(directory_or_paths)
        paths, listing = walk_files(directory_or_paths)
    else:
        paths, listing = [str(p) for p in directory_or_paths], []
        name = f"{len(paths)} files starting with {printable(paths[0])}" if paths else "empty file list"
    if not paths:
        raise ValueError(f"{name}: no files found")
    headers, unread = read_headers(paths)
    skipped = list(listing) + [ReportEntry("", p, r) for p, r in unread]
    if not headers:
        reasons = "; ".join(f"{printable(e.path)}: {e.reason}" for e in skipped[:3])
        raise ValueError(f"{name}: no readable DICOM image among {len(paths)} files ({reasons})")
    series_id = headers[0].series_uid or name
    try:
        checked = check_series(headers, series_id, policy)
    except SeriesRefused as err:
        raise SeriesRefused(f"{name}: {err}") from None
    skipped += checked.skipped
    read = read_series_values([h.path for h in checked.headers], series_id, policy.allow_non_ct)
    skipped += read.skipped
    if not read.values:
        raise ValueError(f"{name}: every image failed to decode ({printable(skipped[-1].path)}: {skipped[-1].reason})")
    shapes = {v.shape for v in read.values}
    if len(shapes) > 1:
        raise ValueError(f"{name}: pixel arrays of different shapes {sorted(shapes)} in one series")
    if len(read.units) > 1:
        raise ValueError(f"{name}: slices in different units {sorted(read.units)} in one series")
    found = checked.warnings + read.warnings
    for entry in found:
        warnings.warn(str(entry), UserWarning, stacklevel=2)
    return CTSeries(
        hu=np.stack(read.values).astype(np.float32, copy=False),
        paths=[checked.headers[i].path for i in read.kept],
        positions=np.asarray(checked.positions[read.kept], dtype=np.float64),
        series_uid=checked.headers[0].series_uid,
        ordering=checked.ordering,
        skipped=skipped,
        units=read.units.pop(),
        warnings=found,
    )
