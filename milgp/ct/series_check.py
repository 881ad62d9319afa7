"""Checking and ordering the slices of one CT series before it becomes a bag.

:func:`check_series` takes the headers of the files that claim to be one series and returns them
ordered along the scan axis, with the files it left out and the warnings, or refuses the series
(:class:`SeriesRefused`, one line naming the files). Its steps (files that are not axial CT slices
left out; one series, size and orientation; order along the slice normal; axial; disjoint
acquisitions; duplicates at one position; alternating spacing and gaps) are listed in
``docs/ct_data.md``, "Slice order and series checks"; the thresholds are :class:`SeriesPolicy`'s.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from milgp.ct.dicom import DicomReadError, SliceHeader
from milgp.ct.hounsfield import read_pixel_bytes
from milgp.ct.report_entry import ReportEntry, printable
from milgp.ct.series_policy import SeriesPolicy

__all__ = ["CheckedSeries", "SeriesRefused", "check_series", "check_single_series", "order_slices", "slice_normal", "tilt_deg"]

_ZIGZAG_STEP = 0.25  # relative change between neighbouring spacings that counts as a zigzag step
_ZIGZAG_SHARE = 0.5  # share of zigzag steps that makes a series two interleaved stacks ...
_ZIGZAG_MIN = 3  # ... when there are at least this many (one gap makes one)


class SeriesRefused(ValueError):
    """A series cannot be one bag; the message says why, naming files."""


def slice_normal(orientation: Sequence[float]) -> np.ndarray:
    """Unit slice normal ``(3,)``: cross product of the row and column direction cosines."""
    o = np.asarray(orientation, dtype=np.float64)
    n = np.cross(o[:3], o[3:6])
    norm = float(np.linalg.norm(n))
    if norm < 1e-6:
        raise ValueError(f"degenerate ImageOrientationPatient {tuple(o)}: row and column cosines are parallel")
    return n / norm


def tilt_deg(orientation: Sequence[float]) -> float:
    """Angle in degrees between the slice normal and the patient z axis (0: axial; a gantry-tilted
    head CT is 10–30; sagittal and coronal are 90). Raises ``ValueError`` on a degenerate orientation."""
    return float(np.degrees(np.arccos(min(1.0, abs(float(slice_normal(orientation)[2]))))))


def check_single_series(headers: Sequence[SliceHeader], series_name: str) -> None:
    """Raise :class:`SeriesRefused` naming files when ``headers`` mix series, image sizes or pixel spacings."""
    uids = sorted({h.series_uid for h in headers})
    if len(uids) > 1:
        examples = {u: next(h.path for h in headers if h.series_uid == u) for u in uids}
        raise SeriesRefused(
            f"{series_name}: files from {len(uids)} different SeriesInstanceUIDs are mixed "
            f"({'; '.join(f'{u} e.g. {printable(p)}' for u, p in examples.items())}); give one series at a time"
        )
    sizes = {(h.rows, h.columns) for h in headers}
    if len(sizes) > 1:
        first = (headers[0].rows, headers[0].columns)
        odd = next(h for h in headers if (h.rows, h.columns) != first)
        raise SeriesRefused(
            f"{series_name}: inconsistent image sizes in one series: {printable(headers[0].path)} is "
            f"{first[0]}x{first[1]} but {printable(odd.path)} is {odd.rows}x{odd.columns}"
        )
    spaced = [h for h in headers if h.pixel_spacing is not None]
    odd = next((h for h in spaced if not np.allclose(h.pixel_spacing, spaced[0].pixel_spacing, rtol=1e-3, atol=1e-4)), None)
    if odd is not None:  # resized to one size, they would show the anatomy at two scales
        raise SeriesRefused(
            f"{series_name}: inconsistent pixel spacing in one series: {printable(spaced[0].path)} has "
            f"{spaced[0].pixel_spacing[0]:g}x{spaced[0].pixel_spacing[1]:g} mm but {printable(odd.path)} has "
            f"{odd.pixel_spacing[0]:g}x{odd.pixel_spacing[1]:g} mm"
        )


def order_slices(headers: Sequence[SliceHeader], series_name: str = "") -> tuple[list[int], np.ndarray, str]:
    """Order the slices of one series along the scan axis.

    With geometry on every slice: position ``= ImagePositionPatient · n`` where ``n`` is the slice
    normal (:func:`slice_normal`) of the first slice, sorted ascending (ties broken by
    InstanceNumber). Otherwise, InstanceNumber ascending (:func:`check_series` reports it as a
    warning of the series).

    Args:
        headers: the slices of one series.
        series_name: how to name the series in warnings and errors.

    Returns:
        ``(order, positions (S,) float64, ordering)``: ``headers[order[i]]`` is the i-th slice,
        ``positions`` are in mm along the normal (or instance numbers), ``ordering`` is
        ``"geometry"`` or ``"instance_number"``.

    Raises:
        SeriesRefused: naming the series when slice orientations disagree, or when neither geometry
            nor InstanceNumber is available on every slice.
    """
    if len(headers) == 0:
        raise SeriesRefused(f"series {series_name!r} has no slices to order")
    inst = np.array([h.instance_number if h.instance_number is not None else np.nan for h in headers], dtype=np.float64)
    if all(h.position is not None and h.orientation is not None for h in headers):
        orients = np.array([h.orientation for h in headers], dtype=np.float64)
        if np.abs(orients - orients[0]).max() > 1e-3:
            worst = int(np.abs(orients - orients[0]).max(axis=1).argmax())
            raise SeriesRefused(
                f"series {series_name!r}: ImageOrientationPatient differs between slices "
                f"({printable(headers[0].path)} vs {printable(headers[worst].path)}); not one stack of parallel slices"
            )
        try:
            normal = slice_normal(orients[0])
        except ValueError as err:
            raise SeriesRefused(f"series {series_name!r}: {err} (in {printable(headers[0].path)})") from None
        positions = np.array([h.position for h in headers], dtype=np.float64) @ normal
        tiebreak = np.where(np.isnan(inst), 0.0, inst)
        order = np.lexsort((tiebreak, positions))
        return [int(i) for i in order], positions[order], "geometry"
    if np.isnan(inst).any():
        missing = headers[int(np.isnan(inst).argmax())].path
        raise SeriesRefused(
            f"series {series_name!r} cannot be ordered: geometry (ImagePositionPatient/"
            f"ImageOrientationPatient) and InstanceNumber are both missing, e.g. in {printable(missing)}"
        )
    order = np.argsort(inst, kind="stable")
    return [int(i) for i in order], inst[order], "instance_number"


@dataclass
class CheckedSeries:
    """A series that passed :func:`check_series`.

    Attributes:
        headers: the kept slices in scan order (first = lowest position along the normal).
        positions: ``(S,)`` float64 positions in mm along the normal, or the instance numbers.
        ordering: ``"geometry"`` or ``"instance_number"``.
        skipped: files left out, with the reason.
        warnings: gaps and other findings that did not refuse the series.
    """

    headers: list[SliceHeader]
    positions: np.ndarray
    ordering: str
    skipped: list[ReportEntry] = field(default_factory=list)
    warnings: list[ReportEntry] = field(default_factory=list)


def _check_axial(headers: Sequence[SliceHeader], name: str, policy: SeriesPolicy) -> None:
    normal = slice_normal(headers[0].orientation)  # type: ignore[arg-type]
    tilt = tilt_deg(headers[0].orientation)  # type: ignore[arg-type]
    if tilt > policy.max_tilt_deg:
        raise SeriesRefused(
            f"{name}: slice normal {tuple(round(float(v), 3) for v in normal)} is {tilt:.0f} degrees from the patient "
            f"z axis (more than {policy.max_tilt_deg:g}): not an axial series (sagittal/coronal), e.g. "
            f"{printable(headers[0].path)}; accept with --allow-non-axial"
        )


def _check_acquisitions(headers: Sequence[SliceHeader], positions: np.ndarray, name: str, policy: SeriesPolicy) -> None:
    ranges: dict[int, list[float]] = {}
    example: dict[int, str] = {}
    for h, z in zip(headers, positions):
        if h.acquisition_number is not None:
            ranges.setdefault(h.acquisition_number, []).append(float(z))
            example.setdefault(h.acquisition_number, h.path)
    spans = sorted((min(zs), max(zs), acq, len(zs)) for acq, zs in ranges.items())
    for (lo_a, hi_a, acq_a, n_a), (lo_b, hi_b, acq_b, n_b) in zip(spans, spans[1:]):
        if lo_b < hi_a - policy.position_tol_mm:
            raise SeriesRefused(
                f"{name}: two acquisitions interleaved in one series: AcquisitionNumber {acq_a} ({n_a} slices, "
                f"{lo_a:.1f}..{hi_a:.1f} mm, e.g. {printable(example[acq_a])}) and {acq_b} ({n_b} slices, {lo_b:.1f}..{hi_b:.1f} mm, "
                f"e.g. {printable(example[acq_b])}) cover the same part of the scan axis"
            )


def _deduplicate(
    headers: list[SliceHeader], positions: np.ndarray, name: str, bag_id: str, policy: SeriesPolicy
) -> tuple[list[SliceHeader], np.ndarray, list[ReportEntry]]:
    """Keep one of each group of slices at the same position when their pixel data are identical."""
    keep_h: list[SliceHeader] = []
    keep_z: list[float] = []
    skipped: list[ReportEntry] = []
    i = 0
    while i < len(headers):
        j = i + 1
        while j < len(headers) and positions[j] - positions[i] <= policy.position_tol_mm:
            j += 1
        group = headers[i:j]
        if len(group) > 1:
            try:
                pixels = [read_pixel_bytes(h.path) for h in group]
            except DicomReadError as err:
                raise SeriesRefused(f"{name}: {printable(err.path)} shares its position with another slice and cannot be read: {err.reason}") from None
            differing = next((h for h, px in zip(group[1:], pixels[1:]) if px != pixels[0]), None)
            if differing is not None:
                raise SeriesRefused(
                    f"{name}: two different images at the same position {positions[i]:.2f}: {printable(group[0].path)} and "
                    f"{printable(differing.path)} (a second acquisition or a damaged export); cannot tell which belongs to the scan"
                )
            for h in group[1:]:
                copy = "a copy (same SOPInstanceUID)" if h.sop_instance_uid and h.sop_instance_uid == group[0].sop_instance_uid else "a duplicate"
                skipped.append(ReportEntry(bag_id, h.path, f"{copy} of {printable(group[0].path)}: same position and identical pixel data; one kept"))
        keep_h.append(group[0])
        keep_z.append(float(positions[i]))
        i = j
    return keep_h, np.asarray(keep_z, dtype=np.float64), skipped


def _check_spacing(headers: Sequence[SliceHeader], positions: np.ndarray, name: str, bag_id: str, policy: SeriesPolicy) -> list[ReportEntry]:
    spacing = np.diff(positions)
    if len(spacing) < 2:
        return []
    if len(spacing) >= 4:
        steps = np.diff(spacing)
        big = np.abs(steps) > _ZIGZAG_STEP * np.maximum(spacing[:-1], spacing[1:])
        zigzag = big[:-1] & big[1:] & (np.sign(steps[:-1]) != np.sign(steps[1:]))
        if zigzag.sum() >= _ZIGZAG_MIN and zigzag.mean() >= _ZIGZAG_SHARE:
            raise SeriesRefused(
                f"{name}: slice spacing alternates between {spacing.min():.2f} and {spacing.max():.2f} mm "
                f"(e.g. around {printable(headers[1].path)}): two stacks interleaved in one series"
            )
    median = float(np.median(spacing))
    out = []
    for k in np.flatnonzero(spacing > policy.gap_factor * median):
        out.append(ReportEntry(
            bag_id, headers[k + 1].path,
            f"gap of {spacing[k]:.2f} mm before this slice (after {printable(headers[k].path)}; median spacing "
            f"{median:.2f} mm): slices may be missing",
        ))
    return out


def check_series(headers: Sequence[SliceHeader], bag_id: str, policy: SeriesPolicy = SeriesPolicy()) -> CheckedSeries:
    """Screen, check and order the headers of one series (the steps of ``docs/ct_data.md``, "Slice order and series checks").

    Args:
        headers: the files claiming to be one series (any order).
        bag_id: names the series in reports and errors.
        policy: what is accepted, and the thresholds.

    Raises:
        SeriesRefused: one line naming the series and the files at fault.
    """
    name = f"bag {printable(bag_id)}"
    kept, skipped = policy.screen(headers, bag_id)
    if not kept:
        example = f" (e.g. {printable(skipped[0].path)}: {skipped[0].reason})" if skipped else ""
        raise SeriesRefused(f"{name}: no CT slice of an axial stack among {len(headers)} files{example}")
    check_single_series(kept, name)
    order, positions, ordering = order_slices(kept, series_name=bag_id)
    ordered = [kept[i] for i in order]
    if ordering == "geometry":
        if not policy.allow_non_axial:
            _check_axial(ordered, name, policy)
        _check_acquisitions(ordered, positions, name, policy)
    ordered, positions, copies = _deduplicate(ordered, positions, name, bag_id, policy)
    found = _check_spacing(ordered, positions, name, bag_id, policy) if ordering == "geometry" else []
    if ordering == "instance_number":  # a report warning, as every finding of the check (a UserWarning from load_series)
        flat = [h for h in ordered if h.position is None or h.orientation is None]
        found.insert(0, ReportEntry(
            bag_id, flat[0].path,
            f"ImagePositionPatient/ImageOrientationPatient missing on {len(flat)} of {len(ordered)} slices (e.g. this one): "
            "ordered by InstanceNumber instead of geometry",
        ))
    anonymous = [h for h in ordered if not h.series_uid]
    if anonymous:  # a required tag: without it two series in one folder cannot be told apart
        found.insert(0, ReportEntry(
            bag_id, anonymous[0].path,
            f"{len(anonymous)} of {len(ordered)} slices have no SeriesInstanceUID: taken as one series with the other "
            "files of the folder (a second series without it would be merged into this one)",
        ))
    return CheckedSeries(ordered, positions, ordering, skipped + copies, found)
