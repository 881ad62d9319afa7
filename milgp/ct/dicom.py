"""DICOM files and headers: opening a file with one clear error, header-only reads, finding files.

A CT scan is a *series* of single-frame DICOM files, one per axial slice. Pixels become Hounsfield
units in :mod:`milgp.ct.hounsfield`; series are checked and ordered in :mod:`milgp.ct.series_check`
and loaded in :mod:`milgp.ct.series`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pydicom
from pydicom.errors import InvalidDicomError
from pydicom.multival import MultiValue
from tqdm.auto import tqdm

from milgp.ct.report_entry import ReportEntry, printable
from milgp.ct.worker_pool import run_isolated

__all__ = [
    "DicomReadError",
    "SliceHeader",
    "element_value",
    "first_value",
    "header_from_dataset",
    "header_window",
    "read_dataset",
    "read_folder_headers",
    "read_headers",
    "read_slice_header",
    "walk_files",
]

# Header tags needed to index, screen and order a slice (read with ``specific_tags`` for speed).
_HEADER_TAGS = [
    "SOPClassUID",
    "SOPInstanceUID",
    "Modality",
    "PatientID",
    "StudyInstanceUID",
    "SeriesInstanceUID",
    "SeriesDescription",
    "AcquisitionNumber",
    "InstanceNumber",
    "ImageType",
    "ImagePositionPatient",
    "ImageOrientationPatient",
    "Rows",
    "Columns",
    "PixelSpacing",
    "SamplesPerPixel",
    "PhotometricInterpretation",
    "NumberOfFrames",
    "SliceThickness",
    "ConvolutionKernel",
    "ContrastBolusAgent",
]
_READ_KILLED_WORKER = "reading this file killed the worker process (a crash in pydicom or out of memory)"


class DicomReadError(ValueError):
    """A file could not be read as a single-frame grayscale CT image (the faults: ``docs/ct_data.md``,
    "From DICOM to three channels", bad files); ``path`` is the file at fault and ``reason`` the short
    explanation, on one line (a decoder's multi-line message is joined; both also in the message)."""

    def __init__(self, path: str | os.PathLike[str], reason: str):
        self.path = str(path)
        self.reason = " ".join(reason.split())
        super().__init__(f"{printable(self.path)}: {reason}")


def read_dataset(path: str | os.PathLike[str], stop_before_pixels: bool, specific_tags: list[str] | None = None) -> pydicom.Dataset:
    """``pydicom.dcmread`` with every failure turned into :class:`DicomReadError` naming the file."""
    try:
        return pydicom.dcmread(path, stop_before_pixels=stop_before_pixels, specific_tags=specific_tags)
    except InvalidDicomError:
        raise DicomReadError(path, "not a DICOM file (no 'DICM' file-meta marker)") from None
    except FileNotFoundError:
        raise DicomReadError(path, "file not found (deleted, or a dangling link)") from None
    except IsADirectoryError:
        raise DicomReadError(path, "is a directory, not a DICOM file") from None
    except PermissionError:
        raise DicomReadError(path, "permission denied (the file is not readable by this user)") from None
    except Exception as err:  # pydicom raises many types for a damaged file; name the file whatever it was
        raise DicomReadError(path, f"corrupt or truncated DICOM file ({type(err).__name__}: {err})") from err


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


@dataclass(frozen=True)
class SliceHeader:
    """Header fields of one slice, read without pixel data.

    ``position`` is ImagePositionPatient ``(3,)`` in mm and ``orientation`` ImageOrientationPatient
    ``(6,)`` direction cosines (row then column), ``pixel_spacing`` PixelSpacing ``(2,)`` in mm (row,
    column); each is ``None`` when missing or malformed.
    ``sop_class_uid`` is SOPClassUID (or the file meta's MediaStorageSOPClassUID), ``""`` when
    absent. ``is_image`` says the header has an image-pixel module (Rows, Columns); whether the
    pixel data itself is present and decodable is only known when it is read
    (:func:`milgp.ct.hounsfield.read_hu`).
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
    sop_instance_uid: str = ""
    sop_class_uid: str = ""
    acquisition_number: int | None = None
    image_type: str = ""
    photometric: str = ""
    samples_per_pixel: int = 1
    frames: int = 1
    pixel_spacing: tuple[float, float] | None = None


def element_value(ds: pydicom.Dataset, tag: str, path: str | os.PathLike[str]) -> Any:
    """``ds.get(tag)``, with a failure to convert the stored value turned into :class:`DicomReadError`
    naming ``path`` and the tag."""
    try:
        return ds.get(tag)
    except Exception as err:  # pydicom converts values lazily and raises many types for malformed ones
        raise DicomReadError(path, f"malformed {tag} value ({type(err).__name__}: {err})") from None


def _text(ds: pydicom.Dataset, tag: str, path: str | os.PathLike[str]) -> str:
    value = element_value(ds, tag, path)
    if value in (None, ""):
        return ""
    if isinstance(value, MultiValue):
        return "\\".join(str(v).strip() for v in value)
    return str(value).strip()


def _floats(ds: pydicom.Dataset, tag: str, n: int, path: str | os.PathLike[str]) -> tuple[float, ...] | None:
    """A multi-valued numeric tag of ``n`` finite values; ``None`` when missing or malformed."""
    try:
        value = element_value(ds, tag, path)
    except DicomReadError:
        return None
    if value in (None, ""):
        return None
    try:
        vals = tuple(float(v) for v in (value if isinstance(value, (MultiValue, list, tuple)) else [value]))
    except (TypeError, ValueError):
        return None
    return vals if len(vals) == n and all(np.isfinite(vals)) else None


def _int_or_none(ds: pydicom.Dataset, tag: str, path: str | os.PathLike[str]) -> int | None:
    """An optional integer tag; ``None`` when missing or malformed (it only breaks ties)."""
    try:
        return required_int(ds, tag, None, path)
    except DicomReadError:
        return None


def required_int(ds: pydicom.Dataset, tag: str, default: int | None, path: str | os.PathLike[str]) -> int | None:
    """An integer tag that decides how pixels are read; ``default`` when missing.

    Raises:
        DicomReadError: naming ``path`` and the tag for a malformed value (e.g. ``NumberOfFrames = "1A"``).
    """
    value = element_value(ds, tag, path)
    if value in (None, ""):
        return default
    try:
        return int(first_value(value))
    except (TypeError, ValueError, OverflowError):
        raise DicomReadError(path, f"malformed {tag} value {value!r} (not an integer)") from None


def header_from_dataset(ds: pydicom.Dataset, path: str | os.PathLike[str]) -> SliceHeader:
    """The :class:`SliceHeader` of an already read dataset.

    Raises:
        DicomReadError: naming ``path`` for malformed Rows, Columns, SamplesPerPixel or
            NumberOfFrames values.
    """
    thick = _floats(ds, "SliceThickness", 1, path)
    rows, cols = required_int(ds, "Rows", 0, path), required_int(ds, "Columns", 0, path)
    meta = getattr(ds, "file_meta", None)
    sop_class = _text(ds, "SOPClassUID", path) or (_text(meta, "MediaStorageSOPClassUID", path) if meta is not None else "")
    return SliceHeader(
        path=str(path),
        patient_id=_text(ds, "PatientID", path),
        study_uid=_text(ds, "StudyInstanceUID", path),
        series_uid=_text(ds, "SeriesInstanceUID", path),
        series_description=_text(ds, "SeriesDescription", path),
        instance_number=_int_or_none(ds, "InstanceNumber", path),
        position=_floats(ds, "ImagePositionPatient", 3, path),  # type: ignore[arg-type]
        orientation=_floats(ds, "ImageOrientationPatient", 6, path),
        rows=rows,
        columns=cols,
        slice_thickness=None if thick is None else thick[0],
        convolution_kernel=_text(ds, "ConvolutionKernel", path),
        contrast_agent=_text(ds, "ContrastBolusAgent", path),
        modality=_text(ds, "Modality", path).upper(),
        is_image=rows > 0 and cols > 0,
        sop_instance_uid=_text(ds, "SOPInstanceUID", path),
        sop_class_uid=sop_class,
        acquisition_number=_int_or_none(ds, "AcquisitionNumber", path),
        image_type=_text(ds, "ImageType", path).upper(),
        photometric=_text(ds, "PhotometricInterpretation", path).upper(),
        samples_per_pixel=required_int(ds, "SamplesPerPixel", 1, path),
        frames=required_int(ds, "NumberOfFrames", 1, path),
        pixel_spacing=_floats(ds, "PixelSpacing", 2, path),  # type: ignore[arg-type]
    )


def read_slice_header(path: str | os.PathLike[str]) -> SliceHeader:
    """Read the indexing fields of one slice (``stop_before_pixels=True``: no pixel data is read).

    Raises:
        DicomReadError: naming ``path`` when it is not a readable DICOM file or a header value
            that decides how the pixels are read is malformed.
    """
    return header_from_dataset(read_dataset(path, stop_before_pixels=True, specific_tags=_HEADER_TAGS), path)


def walk_files(directory: str | os.PathLike[str]) -> tuple[list[str], list[ReportEntry]]:
    """All regular files under ``directory``, recursively: ``(sorted paths, problems)``.

    Hidden files and DICOMDIR index files are left out. Links to folders are followed once (a link
    loop is cut and reported); dangling links and folders that cannot be listed are reported as
    ``ReportEntry("", path, reason)`` instead of disappearing silently.

    Raises:
        ValueError: naming ``directory`` when it is not a folder.
    """
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"{printable(root)}: not a folder")
    files: list[str] = []
    problems: list[ReportEntry] = []
    seen: set[tuple[int, int]] = set()
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            st = folder.stat()
            key = (st.st_dev, st.st_ino)
            if key in seen:
                problems.append(ReportEntry("", str(folder), "link loop: this folder was already listed through another path; not listed again"))
                continue
            seen.add(key)
            with os.scandir(folder) as listing:
                entries = sorted(listing, key=lambda e: e.name)
        except OSError as err:
            problems.append(ReportEntry("", str(folder), f"folder cannot be listed ({err.strerror or err})"))
            continue
        for entry in entries:
            if entry.name.startswith(".") or entry.name.upper() == "DICOMDIR":
                continue
            try:
                if entry.is_dir():
                    stack.append(Path(entry.path))
                elif entry.is_file():
                    files.append(entry.path)
                elif entry.is_symlink():
                    problems.append(ReportEntry("", entry.path, "dangling link (its target does not exist)"))
            except OSError as err:
                problems.append(ReportEntry("", entry.path, f"cannot be examined ({err.strerror or err})"))
    return sorted(files), problems


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

    Files that are not DICOM, are corrupt, or are not images are skipped with their reason, and so
    is a file whose reading kills its worker process.

    Args:
        paths: files to read (headers only, ``stop_before_pixels=True``).
        workers: processes to read with (``0`` or ``1``: in this process). Worth it for archives
            of hundreds of thousands of files (RSNA).
        progress: show a tqdm progress bar.
    """
    path_list = [str(p) for p in paths]
    bar = tqdm(total=len(path_list), desc="reading headers", unit="file", disable=not progress)
    results: list[SliceHeader | tuple[str, str] | None] = [None] * len(path_list)

    def keep(i: int, result: SliceHeader | tuple[str, str]) -> None:
        results[i] = result
        bar.update(1)

    run_isolated(
        _read_header_or_reason, path_list, workers, on_result=keep,
        on_crash=lambda i: keep(i, (path_list[i], _READ_KILLED_WORKER)),
        chunk=max(1, len(path_list) // (max(workers, 1) * 16)),
    )
    bar.close()
    headers = [r for r in results if isinstance(r, SliceHeader)]
    skipped = [r for r in results if not isinstance(r, SliceHeader)]
    return headers, skipped


def read_folder_headers(
    folders: dict[str, Path], workers: int = 0, progress: bool = False
) -> tuple[dict[str, list[SliceHeader]], list[ReportEntry]]:
    """:func:`read_headers` of all files of every bag's folder (:func:`walk_files`), in one pool.

    Returns:
        ``({bag_id: image headers in file order}, skipped)``: every bag of ``folders``, in that
        order; ``skipped`` holds the walk problems, then the unreadable files, naming their bag.
    """
    bag_of: dict[str, str] = {}
    skipped: list[ReportEntry] = []
    for bag_id, folder in folders.items():
        files, problems = walk_files(folder)
        skipped += [ReportEntry(bag_id, e.path, e.reason) for e in problems]
        bag_of.update({f: bag_id for f in files})
    headers, unread = read_headers(list(bag_of), workers=workers, progress=progress)
    skipped += [ReportEntry(bag_of[p], p, r) for p, r in unread]
    by_bag: dict[str, list[SliceHeader]] = {bag_id: [] for bag_id in folders}
    for h in headers:
        by_bag[bag_of[h.path]].append(h)
    return by_bag, skipped
