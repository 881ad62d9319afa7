"""What the CT data path accepts as a slice of an axial CT series, and the thresholds of the series checks.

Archives hold more than axial CT (MR, US, NM, SEG, RT dose, palette colour, dose reports, scouts,
reformats: ``docs/ct_data.md``, "Faults and what happens"): their values are not Hounsfield units,
or their slices do not stack along the head's z axis, yet windowed as head CT they would be served
as ordinary scans. A :class:`SeriesPolicy` refuses them, with the reason, unless an explicit option
accepts them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from pydicom.uid import UID

from milgp.ct.report_entry import ReportEntry

if TYPE_CHECKING:
    from milgp.ct.dicom import SliceHeader

__all__ = ["CT_IMAGE_STORAGE", "SeriesPolicy"]

#: SOP Class UID of CT Image Storage (one single-frame CT slice per file).
CT_IMAGE_STORAGE = "1.2.840.10008.5.1.4.1.1.2"
_GRAYSCALE = ("MONOCHROME1", "MONOCHROME2")


@dataclass(frozen=True)
class SeriesPolicy:
    """What a series may contain, and when it is refused or warned about.

    Args:
        allow_non_ct: accept images whose Modality is not ``CT`` or whose SOP class is not CT Image
            Storage. Their values are then reported in the modality's own units, never as HU.
        allow_non_axial: accept series whose slice normal is more than ``max_tilt_deg`` from the
            patient z axis (sagittal, coronal, strongly tilted).
        max_tilt_deg: largest angle between the slice normal and z for an axial series. Head CT is
            often acquired with the gantry tilted by up to ~30 degrees (along the orbitomeatal line),
            which tilts the normal as much; sagittal and coronal series are at 90 degrees.
        gap_factor: a spacing between neighbouring slices larger than this times the median spacing
            is reported as a gap (missing slices).
        position_tol_mm: positions closer than this are the same position (duplicates).
    """

    allow_non_ct: bool = False
    allow_non_axial: bool = False
    max_tilt_deg: float = 40.0
    gap_factor: float = 1.5
    position_tol_mm: float = 0.01

    def image_problem(self, h: "SliceHeader") -> str:
        """Why the pixels of ``h`` cannot be read as one grayscale CT slice in HU (``""`` when they can)."""
        if h.frames != 1:
            return f"multi-frame image with {h.frames} frames; expected one CT slice per file"
        if h.samples_per_pixel != 1:
            return f"SamplesPerPixel = {h.samples_per_pixel}; a CT slice is grayscale (1 sample per pixel)"
        if h.photometric and h.photometric not in _GRAYSCALE:
            return f"PhotometricInterpretation {h.photometric!r} is not grayscale (MONOCHROME1/2); values are not intensities"
        if self.allow_non_ct:
            return ""
        if h.modality != "CT":
            what = f"Modality {h.modality!r}" if h.modality else "no Modality tag"
            return f"{what}, not CT: pixel values are not Hounsfield units (accept with --allow-non-ct)"
        if h.sop_class_uid and h.sop_class_uid != CT_IMAGE_STORAGE:
            name = UID(h.sop_class_uid).name
            sop = f"{name} ({h.sop_class_uid})" if name != h.sop_class_uid else h.sop_class_uid
            return f"SOP class {sop} is not CT Image Storage (accept with --allow-non-ct)"
        return ""

    def slice_problem(self, h: "SliceHeader") -> str:
        """Why ``h`` is not a slice of an axial series (:meth:`image_problem`, or a localizer); ``""`` when it is."""
        problem = self.image_problem(h)
        if problem:
            return problem
        if "LOCALIZER" in h.image_type.split("\\"):
            return "localizer (scout) image, not a slice of the axial stack"
        return ""

    def screen(self, headers: Iterable["SliceHeader"], bag_id: str) -> tuple[list["SliceHeader"], list[ReportEntry]]:
        """``(kept, left out)``: the headers without a :meth:`slice_problem`, and the others with theirs."""
        problems = [(h, self.slice_problem(h)) for h in headers]
        return [h for h, p in problems if not p], [ReportEntry(bag_id, h.path, p) for h, p in problems if p]
