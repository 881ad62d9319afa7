"""Reading CT slices from DICOM: Hounsfield units, windowing, and series ordering (DESIGN §6).

A CT scan is a *series* of single-frame DICOM files, one per axial slice. This module turns
files into arrays:

* :func:`read_hu` -- one file -> ``(H, W)`` float32 Hounsfield units (HU), with the rescale tags
  applied and the RSNA 12-bit pixel-representation fault repaired
  (:func:`repair_rsna_12bit_fault`);
* :func:`apply_window` / :func:`ct_channels` -- HU -> display windows scaled to ``[0, 1]``, the
  three head-CT windows stacked as channels (:data:`HEAD_CT_WINDOWS`), optionally resized;
* :func:`read_slice_header` / :func:`order_slices` -- header-only reads (no pixel data) and
  ordering of a series along the scan axis by geometry (ImagePositionPatient projected on the
  slice normal), falling back to InstanceNumber with a warning only when geometry is missing;
* :func:`load_series` -- a whole series -> :class:`CTSeries` ``(S, H, W)`` HU volume.

Every failure to read one file raises :class:`DicomReadError` naming the file; functions that work
on many files collect those errors, skip the file, and report ``(path, reason)`` pairs.
"""
from __future__ import annotations

import multiprocessing
import os
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pydicom
import torch
import torch.nn.functional as F
from pydicom.errors import InvalidDicomError
from pydicom.multival import MultiValue
from pydicom.pixels import get_decoder
from tqdm.auto import tqdm

__all__ = [
    "CTSeries",
    "DicomReadError",
    "HEAD_CT_WINDOWS",
    "HEAD_CT_WINDOW_NAMES",
    "SliceHeader",
    "apply_window",
    "check_single_series",
    "ct_channels",
    "first_value",
    "header_window",
    "list_files",
    "load_series",
    "needs_rsna_12bit_repair",
    "order_slices",
    "read_headers",
    "read_hu",
    "read_slice_header",
    "repair_rsna_12bit_fault",
    "resize_images",
    "slice_normal",
]

#: Head-CT display windows ``(center, width)`` in HU, in channel order: brain (40, 80),
#: subdural/blood (80, 200), soft tissue (40, 380) -- seed 000, Section 6.3.
HEAD_CT_WINDOWS: tuple[tuple[float, float], ...] = ((40.0, 80.0), (80.0, 200.0), (40.0, 380.0))
#: Names of the channels made from :data:`HEAD_CT_WINDOWS`.
HEAD_CT_WINDOW_NAMES: tuple[str, ...] = ("brain", "subdural", "soft_tissue")

# Header tags needed to index and order a slice (read with ``specific_tags`` for speed).
_HEADER_TAGS = [
    "PatientID",
    "StudyInstanceUID",
    "SeriesInstanceUID",
    "SeriesDescription",
    "InstanceNumber",
    "ImagePositionPatient",
    "ImageOrientationPatient",
    "Rows",
    "Columns",
    "SliceThickness",
    "ConvolutionKernel",
    "ContrastBolusAgent",
    "Modality",
]


class DicomReadError(ValueError):
    """A file could not be read as a single-frame grayscale DICOM image.

    Raised for corrupt, truncated, non-DICOM and non-image (no PixelData) files, and for
    compressed pixel data that no installed handler can decode. ``path`` is the file at fault and
    ``reason`` the short explanation (both also in the message).
    """

    def __init__(self, path: str | os.PathLike[str], reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


def first_value(value: Any) -> Any:
    """The first element of a DICOM multi-valued element, or the value itself when single.

    Window tags (WindowCenter/WindowWidth) are often multi-valued (``[40, 80]``); the first
    entry is the primary window.
    """
    if isinstance(value, (MultiValue, list, tuple)):
        if len(value) == 0:
            raise ValueError("empty multi-valued DICOM element")
        return value[0]
    return value


def header_window(ds: pydicom.Dataset) -> tuple[float, float] | None:
    """The header's display window ``(center, width)`` in HU, first value if multi-valued.

    ``None`` when either tag is missing or empty.
    """
    center, width = ds.get("WindowCenter"), ds.get("WindowWidth")
    if center in (None, "") or width in (None, ""):
        return None
    return float(first_value(center)), float(first_value(width))


def needs_rsna_12bit_repair(bits_stored: int, pixel_representation: int, intercept: float) -> bool:
    """Whether a slice carries the RSNA 12-bit pixel-representation fault (see :func:`repair_rsna_12bit_fault`)."""
    return int(bits_stored) == 12 and int(pixel_representation) == 0 and intercept > -100


def repair_rsna_12bit_fault(raw: np.ndarray) -> tuple[np.ndarray, float]:
    """Repair the known 12-bit fault of the RSNA ICH archive; returns ``(raw', intercept')``.

    Some RSNA Intracranial Hemorrhage Detection slices say ``BitsStored = 12``,
    ``PixelRepresentation = 0`` (unsigned) and a rescale intercept near 0 (``> -100``), while the
    stored values are really a 12-bit wrapped signal: read with the stated tags, air and parts of
    the soft tissue land at the top of the 12-bit range and the windowed image is garbage. The
    repair used by the RSNA ICH Kaggle solutions (J. Howard, "Cleaning the data for rapid
    prototyping (fastai)", Kaggle kernel, 2019; reused e.g. in R. Epp, "See like a radiologist
    with systematic windowing") shifts by 1000, wraps modulo 4096 and sets the intercept to
    -1000::

        x = x + 1000; px_mode = 4096; x[x >= px_mode] -= px_mode; intercept = -1000

    so that ``HU = slope * x' - 1000``. Apply it only when :func:`needs_rsna_12bit_repair` holds;
    the rescale slope is kept.

    Args:
        raw: ``(H, W)`` stored pixel values (unitless integers ``0..4095``).

    Returns:
        ``(H, W)`` int32 repaired stored values and the replacement intercept ``-1000.0`` (HU).
    """
    px_mode = 4096
    x = raw.astype(np.int32) + 1000
    x = np.where(x >= px_mode, x - px_mode, x)
    return x, -1000.0


def _read_dataset(path: str | os.PathLike[str], stop_before_pixels: bool, specific_tags: list[str] | None = None) -> pydicom.Dataset:
    """``pydicom.dcmread`` with every failure turned into :class:`DicomReadError` naming the file."""
    try:
        return pydicom.dcmread(path, stop_before_pixels=stop_before_pixels, specific_tags=specific_tags)
    except InvalidDicomError:
        raise DicomReadError(path, "not a DICOM file (no 'DICM' file-meta marker)") from None
    except FileNotFoundError:
        raise DicomReadError(path, "file not found") from None
    except IsADirectoryError:
        raise DicomReadError(path, "is a directory, not a DICOM file") from None
    except (EOFError, OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
        raise DicomReadError(path, f"corrupt or truncated DICOM file ({type(err).__name__}: {err})") from err


def _check_image(ds: pydicom.Dataset, path: str | os.PathLike[str]) -> None:
    """Refuse datasets that are not single-frame grayscale images, or whose pixels cannot be decoded."""
    if "PixelData" not in ds:
        raise DicomReadError(path, "DICOM file has no PixelData (not an image, or truncated before the pixels)")
    frames = int(ds.get("NumberOfFrames", 1) or 1)
    if frames != 1:
        raise DicomReadError(path, f"multi-frame image with {frames} frames; expected one CT slice per file")
    samples = int(ds.get("SamplesPerPixel", 1) or 1)
    if samples != 1:
        raise DicomReadError(path, f"SamplesPerPixel = {samples}; a CT slice is grayscale (1 sample per pixel)")
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


def _float_tag(ds: pydicom.Dataset, tag: str, default: float, path: str | os.PathLike[str]) -> float:
    """A numeric tag as float (first value if multi-valued), ``default`` when missing or empty."""
    value = ds.get(tag)
    if value in (None, ""):
        return default
    try:
        return float(first_value(value))
    except (TypeError, ValueError) as err:
        raise DicomReadError(path, f"unreadable {tag} value {value!r}: {err}") from err


def read_hu(path: str | os.PathLike[str]) -> np.ndarray:
    """One CT slice in Hounsfield units.

    ``HU = raw * RescaleSlope + RescaleIntercept`` (missing tags -> slope 1, intercept 0), after
    :func:`repair_rsna_12bit_fault` where :func:`needs_rsna_12bit_repair` says so. Compressed
    transfer syntaxes are decoded when an installed handler can, otherwise refused.

    Args:
        path: a single-frame grayscale DICOM file.

    Returns:
        ``(H, W)`` float32 array in HU.

    Raises:
        DicomReadError: naming ``path``, for corrupt, truncated, non-DICOM, non-image, multi-frame,
            colour or undecodable files.
    """
    ds = _read_dataset(path, stop_before_pixels=False)
    _check_image(ds, path)
    try:
        raw = ds.pixel_array
    except Exception as err:  # pydicom raises many types for bad pixel data; name the file
        tsyntax = getattr(getattr(ds, "file_meta", None), "TransferSyntaxUID", "unknown")
        raise DicomReadError(
            path, f"pixel data cannot be decoded (transfer syntax {tsyntax}): {type(err).__name__}: {err}"
        ) from err
    if raw.ndim != 2:
        raise DicomReadError(path, f"pixel array has shape {raw.shape}; expected a 2-D slice")
    slope = _float_tag(ds, "RescaleSlope", 1.0, path)
    intercept = _float_tag(ds, "RescaleIntercept", 0.0, path)
    bits_stored = int(ds.get("BitsStored", 16) or 16)
    pixel_rep = int(ds.get("PixelRepresentation", 0) or 0)
    if needs_rsna_12bit_repair(bits_stored, pixel_rep, intercept):
        raw, intercept = repair_rsna_12bit_fault(raw)
    return (raw.astype(np.float32) * np.float32(slope) + np.float32(intercept)).astype(np.float32)


def apply_window(hu: np.ndarray, center: float, width: float) -> np.ndarray:
    """Display window: HU ``[center - width/2, center + width/2]`` -> ``[0, 1]``, clipped outside.

    Args:
        hu: array of any shape in HU.
        center, width: window level and width in HU (``width > 0``).

    Returns:
        float32 array of the same shape with values in ``[0, 1]``.
    """
    if not width > 0:
        raise ValueError(f"window width must be positive, got {width} (center {center})")
    out = np.array(hu, dtype=np.float32)
    out -= np.float32(center - width / 2.0)
    out *= np.float32(1.0 / width)
    return np.clip(out, 0.0, 1.0, out=out)


def resize_images(images: np.ndarray, size: int | tuple[int, int]) -> np.ndarray:
    """Bilinear, antialiased resize of the last two axes.

    Args:
        images: ``(..., H, W)`` float array.
        size: output ``(H', W')``, or one int for a square output.

    Returns:
        ``(..., H', W')`` float32 array. Antialiasing (a triangle filter widened by the scale
        factor when shrinking) keeps thin structures from aliasing; the weights are non-negative,
        so values stay inside the input range up to float rounding.
    """
    out_hw = (int(size), int(size)) if isinstance(size, (int, np.integer)) else (int(size[0]), int(size[1]))
    if min(out_hw) < 1:
        raise ValueError(f"resize size must be positive, got {size}")
    arr = np.asarray(images, dtype=np.float32)
    if arr.shape[-2:] == out_hw:
        return arr
    lead = arr.shape[:-2]
    t = torch.from_numpy(np.ascontiguousarray(arr.reshape((-1, 1) + arr.shape[-2:])))
    resized = F.interpolate(t, size=out_hw, mode="bilinear", align_corners=False, antialias=True)
    return resized.reshape(lead + out_hw).numpy()


def ct_channels(
    hu: np.ndarray,
    windows: Sequence[tuple[float, float]] = HEAD_CT_WINDOWS,
    size: int | tuple[int, int] | None = None,
) -> np.ndarray:
    """Stack display windows of HU images as channels, optionally resized.

    Windows are applied first, then the ``[0, 1]`` maps are resized (:func:`resize_images`), so
    the output stays in ``[0, 1]``.

    Args:
        hu: ``(H, W)`` slice or ``(S, H, W)`` slices in HU.
        windows: ``(center, width)`` pairs in HU, one per output channel (default
            :data:`HEAD_CT_WINDOWS`: brain, subdural, soft tissue).
        size: output ``(H', W')`` or one int; ``None`` keeps ``H, W``.

    Returns:
        float32 ``(C, H', W')`` for a slice or ``(S, C, H', W')`` for slices, ``C = len(windows)``.
    """
    hu = np.asarray(hu, dtype=np.float32)
    if hu.ndim not in (2, 3):
        raise ValueError(f"ct_channels expects (H, W) or (S, H, W) HU, got shape {hu.shape}")
    if len(windows) == 0:
        raise ValueError("ct_channels needs at least one (center, width) window")
    win = np.asarray(windows, dtype=np.float32).reshape(-1, 2)
    if (win[:, 1] <= 0).any():
        raise ValueError(f"window widths must be positive, got windows {list(windows)}")
    low = (win[:, 0] - win[:, 1] / 2)[:, None, None]
    inv_width = (1.0 / win[:, 1])[:, None, None]
    # one broadcast pass per operation over (..., C, H, W), same values as apply_window per channel
    stacked = np.subtract(hu[..., None, :, :], low, dtype=np.float32)
    stacked *= inv_width
    np.clip(stacked, 0.0, 1.0, out=stacked)
    if size is None:
        return stacked
    return np.clip(resize_images(stacked, size), 0.0, 1.0)  # clip float rounding (e.g. 1 + 1e-7)


@dataclass(frozen=True)
class SliceHeader:
    """Header fields of one slice, read without pixel data.

    ``position`` is ImagePositionPatient ``(3,)`` in mm and ``orientation`` ImageOrientationPatient
    ``(6,)`` direction cosines (row then column); either is ``None`` when missing. ``is_image``
    says the header has an image-pixel module (Rows, Columns); whether the pixel data itself is
    present and decodable is only known when it is read (:func:`read_hu`).
    """

    path: str
    patient_id: str
    study_uid: str
    series_uid: str
    series_description: str
    instance_number: int | None
    position: tuple[float, float, float] | None
    orientation: tuple[float, ...] | None
    rows: int
    columns: int
    slice_thickness: float | None
    convolution_kernel: str
    contrast_agent: str
    modality: str
    is_image: bool


def _text(ds: pydicom.Dataset, tag: str) -> str:
    value = ds.get(tag)
    if value in (None, ""):
        return ""
    if isinstance(value, MultiValue):
        return "\\".join(str(v) for v in value)
    return str(value).strip()


def _floats(ds: pydicom.Dataset, tag: str, n: int) -> tuple[float, ...] | None:
    value = ds.get(tag)
    if value in (None, ""):
        return None
    try:
        vals = tuple(float(v) for v in (value if isinstance(value, (MultiValue, list, tuple)) else [value]))
    except (TypeError, ValueError):
        return None
    return vals if len(vals) == n and all(np.isfinite(vals)) else None


def read_slice_header(path: str | os.PathLike[str]) -> SliceHeader:
    """Read the indexing fields of one slice (``stop_before_pixels=True``: no pixel data is read).

    Raises:
        DicomReadError: naming ``path`` when it is not a readable DICOM file.
    """
    ds = _read_dataset(path, stop_before_pixels=True, specific_tags=_HEADER_TAGS)
    try:
        inst = ds.get("InstanceNumber")
        instance_number = int(inst) if inst not in (None, "") else None
        thick = ds.get("SliceThickness")
        thickness = float(thick) if thick not in (None, "") else None
        rows, cols = int(ds.get("Rows", 0) or 0), int(ds.get("Columns", 0) or 0)
    except (TypeError, ValueError) as err:
        raise DicomReadError(path, f"malformed header value: {err}") from err
    return SliceHeader(
        path=str(path),
        patient_id=_text(ds, "PatientID"),
        study_uid=_text(ds, "StudyInstanceUID"),
        series_uid=_text(ds, "SeriesInstanceUID"),
        series_description=_text(ds, "SeriesDescription"),
        instance_number=instance_number,
        position=_floats(ds, "ImagePositionPatient", 3),  # type: ignore[arg-type]
        orientation=_floats(ds, "ImageOrientationPatient", 6),
        rows=rows,
        columns=cols,
        slice_thickness=thickness,
        convolution_kernel=_text(ds, "ConvolutionKernel"),
        contrast_agent=_text(ds, "ContrastBolusAgent"),
        modality=_text(ds, "Modality"),
        is_image=rows > 0 and cols > 0,
    )


def slice_normal(orientation: Sequence[float]) -> np.ndarray:
    """Unit slice normal ``(3,)``: cross product of the row and column direction cosines."""
    o = np.asarray(orientation, dtype=np.float64)
    n = np.cross(o[:3], o[3:6])
    norm = float(np.linalg.norm(n))
    if norm < 1e-6:
        raise ValueError(f"degenerate ImageOrientationPatient {tuple(o)}: row and column cosines are parallel")
    return n / norm


def order_slices(headers: Sequence[SliceHeader], series_name: str = "") -> tuple[list[int], np.ndarray, str]:
    """Order the slices of one series along the scan axis.

    With geometry on every slice: position ``= ImagePositionPatient · n`` where ``n`` is the slice
    normal (:func:`slice_normal`) of the first slice, sorted ascending (ties broken by
    InstanceNumber). Otherwise, InstanceNumber ascending, with a ``UserWarning`` naming the
    series.

    Args:
        headers: the slices of one series.
        series_name: how to name the series in warnings and errors.

    Returns:
        ``(order, positions (S,) float64, ordering)``: ``headers[order[i]]`` is the i-th slice,
        ``positions`` are in mm along the normal (or instance numbers), ``ordering`` is
        ``"geometry"`` or ``"instance_number"``.

    Raises:
        ValueError: naming the series when slice orientations disagree, or when neither geometry
            nor InstanceNumber is available on every slice.
    """
    if len(headers) == 0:
        raise ValueError(f"series {series_name!r} has no slices to order")
    inst = np.array([h.instance_number if h.instance_number is not None else np.nan for h in headers], dtype=np.float64)
    if all(h.position is not None and h.orientation is not None for h in headers):
        orients = np.array([h.orientation for h in headers], dtype=np.float64)
        if np.abs(orients - orients[0]).max() > 1e-3:
            worst = int(np.abs(orients - orients[0]).max(axis=1).argmax())
            raise ValueError(
                f"series {series_name!r}: ImageOrientationPatient differs between slices "
                f"({headers[0].path} vs {headers[worst].path}); not one stack of parallel slices"
            )
        normal = slice_normal(orients[0])
        positions = np.array([h.position for h in headers], dtype=np.float64) @ normal
        tiebreak = np.where(np.isnan(inst), 0.0, inst)
        order = np.lexsort((tiebreak, positions))
        return [int(i) for i in order], positions[order], "geometry"
    if np.isnan(inst).any():
        missing = headers[int(np.isnan(inst).argmax())].path
        raise ValueError(
            f"series {series_name!r} cannot be ordered: geometry (ImagePositionPatient/"
            f"ImageOrientationPatient) and InstanceNumber are both missing, e.g. in {missing}"
        )
    warnings.warn(
        f"series {series_name!r}: ImagePositionPatient/ImageOrientationPatient missing on some slices; "
        "ordering by InstanceNumber instead of geometry",
        UserWarning,
        stacklevel=2,
    )
    order = np.argsort(inst, kind="stable")
    return [int(i) for i in order], inst[order], "instance_number"


def list_files(directory: str | os.PathLike[str], recursive: bool = True) -> list[str]:
    """All regular files under ``directory`` (sorted; hidden files and DICOMDIR index files excluded)."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"{root}: not a directory")
    it: Iterable[Path] = root.rglob("*") if recursive else root.iterdir()
    return sorted(
        str(p) for p in it if p.is_file() and not p.name.startswith(".") and p.name.upper() != "DICOMDIR"
    )


def _read_header_or_reason(path: str) -> SliceHeader | tuple[str, str]:
    """A header, or ``(path, reason)`` when the file is unreadable or not an image."""
    try:
        h = read_slice_header(path)
    except DicomReadError as err:
        return err.path, err.reason
    if not h.is_image:
        return str(path), "DICOM file has no image (no Rows/Columns): not a CT slice"
    return h


def read_headers(
    paths: Iterable[str | os.PathLike[str]], workers: int = 0, progress: bool = False
) -> tuple[list[SliceHeader], list[tuple[str, str]]]:
    """Header-read many files, collecting failures: ``(image headers, skipped (path, reason))``.

    Files that are not DICOM, are corrupt, or are not images are skipped with their reason.

    Args:
        paths: files to read (headers only, ``stop_before_pixels=True``).
        workers: processes to read with (``0`` or ``1``: in this process). Worth it for archives
            of hundreds of thousands of files (RSNA).
        progress: show a tqdm progress bar.
    """
    path_list = [str(p) for p in paths]
    bar = tqdm(total=len(path_list), desc="reading headers", unit="file", disable=not progress)
    if workers > 1:
        # fork where available: workers start in milliseconds instead of re-importing torch
        ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            results = []
            chunk = max(1, len(path_list) // (workers * 16))
            for r in pool.map(_read_header_or_reason, path_list, chunksize=chunk):
                results.append(r)
                bar.update(1)
    else:
        results = []
        for p in path_list:
            results.append(_read_header_or_reason(p))
            bar.update(1)
    bar.close()
    headers = [r for r in results if isinstance(r, SliceHeader)]
    skipped = [r for r in results if not isinstance(r, SliceHeader)]
    return headers, skipped


def check_single_series(headers: Sequence[SliceHeader], series_name: str) -> None:
    """Raise a ``ValueError`` naming files when ``headers`` mix series or image sizes."""
    uids = sorted({h.series_uid for h in headers})
    if len(uids) > 1:
        examples = {u: next(h.path for h in headers if h.series_uid == u) for u in uids}
        raise ValueError(
            f"{series_name}: files from {len(uids)} different SeriesInstanceUIDs are mixed "
            f"({'; '.join(f'{u} e.g. {p}' for u, p in examples.items())}); give one series at a time"
        )
    sizes = {(h.rows, h.columns) for h in headers}
    if len(sizes) > 1:
        first = (headers[0].rows, headers[0].columns)
        odd = next(h for h in headers if (h.rows, h.columns) != first)
        raise ValueError(
            f"{series_name}: inconsistent image sizes in one series: {headers[0].path} is "
            f"{first[0]}x{first[1]} but {odd.path} is {odd.rows}x{odd.columns}"
        )


@dataclass
class CTSeries:
    """One CT series ordered along the scan axis.

    Attributes:
        hu: ``(S, H, W)`` float32 Hounsfield units, slice 0 first along the slice normal.
        paths: the ``S`` files, in the same order.
        positions: ``(S,)`` float64 positions in mm along the slice normal (``ordering ==
            "geometry"``) or the instance numbers (``"instance_number"``).
        series_uid: SeriesInstanceUID.
        ordering: ``"geometry"`` or ``"instance_number"``.
        skipped: ``(path, reason)`` for files left out (unreadable, non-DICOM, no pixels).
    """

    hu: np.ndarray
    paths: list[str]
    positions: np.ndarray
    series_uid: str
    ordering: str
    skipped: list[tuple[str, str]] = field(default_factory=list)


def load_series(directory_or_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> CTSeries:
    """Read one CT series (a directory, searched recursively, or a list of files), ordered along the scan axis.

    Headers are read first (no pixels) to check the series and order the slices
    (:func:`order_slices`); then pixels are read with :func:`read_hu`. Unreadable files are
    skipped and listed in ``CTSeries.skipped``.

    Raises:
        ValueError: naming the directory/files when there is no readable image, when several
            SeriesInstanceUIDs are mixed, or when image sizes differ within the series.
    """
    if isinstance(directory_or_paths, (str, os.PathLike)):
        name = str(directory_or_paths)
        paths = list_files(directory_or_paths)
    else:
        paths = [str(p) for p in directory_or_paths]
        name = f"{len(paths)} files starting with {paths[0]}" if paths else "empty file list"
    if not paths:
        raise ValueError(f"{name}: no files found")
    headers, skipped = read_headers(paths)
    if not headers:
        reasons = "; ".join(f"{p}: {r}" for p, r in skipped[:3])
        raise ValueError(f"{name}: no readable DICOM image among {len(paths)} files ({reasons})")
    check_single_series(headers, name)
    order, positions, ordering = order_slices(headers, series_name=headers[0].series_uid or name)
    kept_paths, kept_pos, slices = [], [], []
    for i, pos in zip(order, positions):
        try:
            slices.append(read_hu(headers[i].path))
        except DicomReadError as err:
            skipped.append((err.path, err.reason))
            continue
        kept_paths.append(headers[i].path)
        kept_pos.append(pos)
    if not slices:
        raise ValueError(f"{name}: every image failed to decode ({skipped[0][0]}: {skipped[0][1]})")
    shapes = {s.shape for s in slices}
    if len(shapes) > 1:
        raise ValueError(f"{name}: pixel arrays of different shapes {sorted(shapes)} in one series")
    return CTSeries(
        hu=np.stack(slices).astype(np.float32, copy=False),
        paths=kept_paths,
        positions=np.asarray(kept_pos, dtype=np.float64),
        series_uid=headers[0].series_uid,
        ordering=ordering,
        skipped=skipped,
    )
