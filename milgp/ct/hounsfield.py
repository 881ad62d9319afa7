"""Pixel values of one CT slice in Hounsfield units, with the RSNA 12-bit fault repaired.

Only CT values are Hounsfield units (other images are refused, or labelled with their own units);
every failure raises :class:`milgp.ct.dicom.DicomReadError` naming the file.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pydicom
from pydicom.pixels import get_decoder

from milgp.ct.dicom import DicomReadError, element_value, first_value, header_from_dataset, read_dataset, required_int
from milgp.ct.report_entry import ReportEntry, printable
from milgp.ct.series_policy import SeriesPolicy

__all__ = [
    "RSNA_12BIT_AIR_BAND",
    "SeriesValues",
    "SliceValues",
    "clamp_warning",
    "needs_rsna_12bit_repair",
    "read_hu",
    "read_pixel_bytes",
    "read_series_values",
    "read_slice_values",
    "repair_rsna_12bit_fault",
    "rescale_warning",
]

#: Width (in stored values) of the band at the top of the repaired 12-bit range that is air noise
#: below -1000 HU wrapped around, not tissue: repaired values of 3000 HU and above.
RSNA_12BIT_AIR_BAND = 96
_PX_MODE = 4096
_SHIFT = 1000


def needs_rsna_12bit_repair(bits_stored: int, pixel_representation: int, intercept: float) -> bool:
    """Whether a slice carries the RSNA 12-bit pixel-representation fault (see :func:`repair_rsna_12bit_fault`)."""
    return int(bits_stored) == 12 and int(pixel_representation) == 0 and intercept > -100


def repair_rsna_12bit_fault(raw: np.ndarray) -> tuple[np.ndarray, float, int]:
    """Repair the known 12-bit fault of the RSNA ICH archive; returns ``(raw', intercept', clamped)``.

    Slices with ``BitsStored = 12``, ``PixelRepresentation = 0`` and an intercept ``> -100`` hold a
    wrapped 12-bit signal (the fault and its air band: ``docs/ct_data.md``, "From DICOM to three
    channels"). The repair of the RSNA ICH Kaggle solutions (J. Howard, "Cleaning the data for rapid
    prototyping (fastai)", Kaggle kernel, 2019; reused e.g. in R. Epp, "See like a radiologist with
    systematic windowing")::

        x = x + 1000; px_mode = 4096; x[x >= px_mode] -= px_mode; intercept = -1000

    is exact for true values in [-1000, 3095] HU; values in the top :data:`RSNA_12BIT_AIR_BAND` of
    the range are wrapped air noise and set to -1000 HU (counted). Apply it only when
    :func:`needs_rsna_12bit_repair` holds; the rescale slope is kept.

    Args:
        raw: ``(H, W)`` stored pixel values (unitless integers ``0..4095``).

    Returns:
        ``(H, W)`` int32 repaired stored values, the replacement intercept ``-1000.0`` (HU), and
        the number of pixels clamped from the top band to air.
    """
    x = raw.astype(np.int32) + _SHIFT
    x = np.where(x >= _PX_MODE, x - _PX_MODE, x)
    wrapped_air = x >= _PX_MODE - RSNA_12BIT_AIR_BAND
    x[wrapped_air] = 0
    return x, -float(_SHIFT), int(wrapped_air.sum())


@dataclass(frozen=True)
class SliceValues:
    """One slice's rescaled pixel values and how they were obtained.

    Attributes:
        values: ``(H, W)`` float32 ``stored * RescaleSlope + RescaleIntercept`` (12-bit repaired).
        units: ``"HU"`` for CT, otherwise a description that says the values are not HU.
        rescale_assumed: RescaleSlope or RescaleIntercept was missing and 1 / 0 was assumed.
        repaired_12bit: :func:`repair_rsna_12bit_fault` was applied.
        clamped_air: pixels the repair set from the wrapped top band to air.
    """

    values: np.ndarray
    units: str
    rescale_assumed: bool
    repaired_12bit: bool
    clamped_air: int


def _rescale_tag(ds: pydicom.Dataset, tag: str, default: float, path: str | os.PathLike[str]) -> tuple[float, bool]:
    """``(value, assumed)``: a rescale tag as float (first value if multi-valued), ``default`` when missing."""
    value = element_value(ds, tag, path)
    if value in (None, ""):
        return default, True
    try:
        number = float(first_value(value))
    except (TypeError, ValueError) as err:
        raise DicomReadError(path, f"unreadable {tag} value {value!r}: {err}") from None
    if not np.isfinite(number) or (tag == "RescaleSlope" and number == 0):
        raise DicomReadError(path, f"{tag} = {value!r} would make every pixel value meaningless")
    return number, False


def _check_decodable(ds: pydicom.Dataset, path: str | os.PathLike[str]) -> None:
    """Refuse datasets without pixels, or whose pixels no installed handler can decode."""
    if "PixelData" not in ds:
        raise DicomReadError(path, "DICOM file has no PixelData (not an image, or truncated before the pixels)")
    tsyntax = getattr(getattr(ds, "file_meta", None), "TransferSyntaxUID", None)
    if tsyntax is not None and tsyntax.is_compressed:
        try:
            available = get_decoder(tsyntax).is_available
        except NotImplementedError:
            available = False
        if not available:
            raise DicomReadError(
                path,
                f"compressed transfer syntax '{tsyntax.name}' ({tsyntax}) cannot be decoded with the "
                "installed pydicom pixel-data handlers; decompress the file (e.g. gdcmconv --raw) or "
                "install a handler (pylibjpeg + its plugins, or python-gdcm)",
            )


def read_slice_values(path: str | os.PathLike[str], allow_non_ct: bool = False) -> SliceValues:
    """One slice's rescaled pixel values: ``stored * RescaleSlope + RescaleIntercept``.

    Missing slope/intercept mean 1/0 (``rescale_assumed``); :func:`repair_rsna_12bit_fault` is
    applied to CT slices where :func:`needs_rsna_12bit_repair` says so. Compressed transfer syntaxes are
    decoded when an installed handler can, otherwise refused.

    Args:
        path: a single-frame grayscale DICOM file.
        allow_non_ct: accept images that are not CT (their ``units`` then say they are not HU).

    Raises:
        DicomReadError: naming ``path``, for corrupt, truncated, unreadable, non-DICOM, non-image,
            multi-frame, colour, palette, non-CT (unless allowed) or undecodable files, malformed
            pixel-module or rescale tags, and non-finite results.
    """
    ds = read_dataset(path, stop_before_pixels=False)
    header = header_from_dataset(ds, path)
    problem = SeriesPolicy(allow_non_ct=allow_non_ct).image_problem(header)
    if problem:
        raise DicomReadError(path, problem)
    _check_decodable(ds, path)
    try:
        raw = ds.pixel_array
    except Exception as err:  # pydicom raises many types for bad pixel data; name the file
        tsyntax = getattr(getattr(ds, "file_meta", None), "TransferSyntaxUID", "unknown")
        raise DicomReadError(
            path, f"pixel data cannot be decoded (transfer syntax {tsyntax}): {type(err).__name__}: {err}"
        ) from err
    if raw.ndim != 2:
        raise DicomReadError(path, f"pixel array has shape {raw.shape}; expected a 2-D slice")
    slope, slope_assumed = _rescale_tag(ds, "RescaleSlope", 1.0, path)
    intercept, intercept_assumed = _rescale_tag(ds, "RescaleIntercept", 0.0, path)
    bits_stored = required_int(ds, "BitsStored", 16, path)
    pixel_rep = required_int(ds, "PixelRepresentation", 0, path)
    # the repair is of a CT archive's fault; another modality's 12-bit values are its own units
    repaired, clamped = header.modality == "CT" and needs_rsna_12bit_repair(bits_stored, pixel_rep, intercept), 0
    if repaired:
        raw, intercept, clamped = repair_rsna_12bit_fault(raw)
    with np.errstate(over="ignore", invalid="ignore"):  # checked right below
        values = (raw.astype(np.float32) * np.float32(slope) + np.float32(intercept)).astype(np.float32)
    if not np.isfinite(values).all():
        raise DicomReadError(path, f"rescaled values are not finite (RescaleSlope {slope}, RescaleIntercept {intercept})")
    units = "HU" if header.modality == "CT" else f"{header.modality or 'unknown modality'} rescaled values (not HU)"
    return SliceValues(values, units, slope_assumed or intercept_assumed, repaired, clamped)


@dataclass
class SeriesValues:
    """The readable slices of a list of files (:func:`read_series_values`).

    Attributes:
        values: ``(H, W)`` float32 arrays of the readable slices, in the given order.
        kept: their indices in the given list of files.
        units: the distinct units of the kept slices (one for a sane series).
        skipped: unreadable files, with reasons.
        warnings: at most one assumed-rescale and one clamped-air warning for the whole series.
    """

    values: list[np.ndarray]
    kept: list[int]
    units: set[str]
    skipped: list[ReportEntry]
    warnings: list[ReportEntry]


def read_series_values(paths: Sequence[str], bag_id: str, allow_non_ct: bool = False) -> SeriesValues:
    """:func:`read_slice_values` for every file of one series: unreadable files are skipped and reported,
    and what was assumed or clamped is reported once for the series, not once per slice."""
    values, kept, units, skipped = [], [], set(), []
    assumed = repaired = clamped = 0
    for i, path in enumerate(paths):
        try:
            sv = read_slice_values(path, allow_non_ct=allow_non_ct)
        except DicomReadError as err:
            skipped.append(ReportEntry(bag_id, err.path, err.reason))
            continue
        values.append(sv.values)
        kept.append(i)
        units.add(sv.units)
        assumed += sv.rescale_assumed
        repaired += sv.repaired_12bit
        clamped += sv.clamped_air
    found = []
    if assumed:
        found.append(ReportEntry(bag_id, paths[kept[0]], rescale_warning(assumed, len(kept))))
    if clamped:
        found.append(ReportEntry(bag_id, paths[kept[0]], clamp_warning(clamped, repaired, sum(v.size for v in values))))
    return SeriesValues(values, kept, units, skipped, found)


def rescale_warning(assumed: int, total: int) -> str:
    """The one warning per series for slices read without RescaleSlope/RescaleIntercept."""
    return (f"RescaleSlope/RescaleIntercept missing on {assumed} of {total} slices; assumed slope 1, intercept 0 "
            "(the raw stored values: for CT often 1024 HU too high)")


def clamp_warning(clamped: int, repaired: int, pixels: int) -> str:
    """The one warning per series for air noise the RSNA 12-bit repair kept at air."""
    return (f"RSNA 12-bit repair on {repaired} slices set {clamped} of {pixels} pixels ({100.0 * clamped / max(pixels, 1):.2f} %) "
            "that wrapped to the top of the range (air below -1000 HU) to -1000 HU")


def read_hu(path: str | os.PathLike[str]) -> np.ndarray:
    """One CT slice in Hounsfield units (:func:`read_slice_values` for CT only).

    Warns (``UserWarning``) when a default rescale was assumed or the 12-bit repair clamped air
    noise; batch readers (:func:`milgp.ct.series.load_series`, the cache) call
    :func:`read_slice_values` instead and warn once per series.

    Returns:
        ``(H, W)`` float32 array in HU.

    Raises:
        DicomReadError: naming ``path`` (see :func:`read_slice_values`); non-CT images are refused.
    """
    sv = read_slice_values(path)
    if sv.rescale_assumed:
        warnings.warn(f"{printable(path)}: {rescale_warning(1, 1)}", UserWarning, stacklevel=2)
    if sv.clamped_air:
        warnings.warn(f"{printable(path)}: {clamp_warning(sv.clamped_air, 1, sv.values.size)}", UserWarning, stacklevel=2)
    return sv.values


def read_pixel_bytes(path: str | os.PathLike[str]) -> bytes:
    """The raw PixelData bytes of a file (no decoding), to tell identical slices apart from different ones.

    Raises:
        DicomReadError: naming ``path`` when it cannot be read or has no PixelData.
    """
    ds = read_dataset(path, stop_before_pixels=False)
    if "PixelData" not in ds:
        raise DicomReadError(path, "DICOM file has no PixelData")
    return bytes(ds.PixelData)
