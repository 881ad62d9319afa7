"""Synthetic head-CT datasets written as real DICOM files (for demos and tests).

Positive phantom heads carry one hyperdense blob (its slices are the positive instances); files are
written in a scrambled order that only the geometry undoes (``docs/ct_data.md``, "Synthetic data").
Writers for the three layouts the indexers read: :func:`write_rsna_dataset`,
:func:`write_cq500_dataset`, :func:`write_generic_dataset`; each returns the ground truth
(:class:`SyntheticDataset`). Everything is deterministic given ``seed``.
"""
from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, PYDICOM_IMPLEMENTATION_UID, generate_uid

from milgp.data.atomic import atomic_write_text
from milgp.ct.report_entry import printable
from milgp.ct.rsna import RSNA_SUBTYPES

__all__ = [
    "HU_AIR",
    "HU_BONE",
    "HU_BRAIN",
    "HU_CSF",
    "PhantomSpec",
    "SyntheticDataset",
    "SyntheticScan",
    "render_phantom",
    "sample_phantom",
    "write_cq500_dataset",
    "write_ct_series",
    "write_generic_dataset",
    "write_rsna_dataset",
]

HU_AIR, HU_BONE, HU_BRAIN, HU_CSF = -1000.0, 1000.0, 35.0, 5.0
_RESCALE_INTERCEPT = -1024.0
_FOV_MM = 250.0
_AXIAL = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)
_SKULL_THICKNESS = 0.07  # in normalised head units


@dataclass(frozen=True)
class PhantomSpec:
    """Geometry of one phantom head in normalised coordinates (image half-width = 1, scan half-length = 1).

    Attributes:
        head_axes: ``(a_x, a_y, a_z)`` semi-axes of the outer skull surface.
        lesion_center: ``(x, y, z)`` of the hemorrhage, or ``None`` for a negative scan.
        lesion_axes: ``(r_x, r_y, r_z)`` semi-axes of the hemorrhage.
        lesion_hu: hemorrhage density in HU.
        noise_hu: standard deviation of the Gaussian noise in HU.
    """

    head_axes: tuple[float, float, float]
    lesion_center: tuple[float, float, float] | None
    lesion_axes: tuple[float, float, float]
    lesion_hu: float
    noise_hu: float


def sample_phantom(
    rng: np.random.Generator,
    positive: bool,
    z_slices: np.ndarray,
    lesion_radius: tuple[float, float] = (0.1, 0.2),
    noise_hu: float = 8.0,
    lesion_hu: tuple[float, float] = (60.0, 90.0),
) -> PhantomSpec:
    """Draw a phantom; a positive one gets a lesion centred on one of ``z_slices`` (normalised z).

    Args:
        rng: random generator.
        positive: whether to place a lesion.
        z_slices: ``(S,)`` normalised slice positions in ``[-1, 1]``; the lesion centre is put on
            one of the central ones, so at least one slice shows it.
        lesion_radius: range of the lesion's in-plane semi-axes (normalised units, 1 = half the
            field of view).
        noise_hu: noise standard deviation in HU.
        lesion_hu: range of the lesion density in HU (brain is 35 HU).
    """
    head = (float(rng.uniform(0.72, 0.82)), float(rng.uniform(0.82, 0.92)), float(rng.uniform(1.0, 1.15)))
    if not positive:
        return PhantomSpec(head, None, (0.0, 0.0, 0.0), 0.0, noise_hu)
    central = z_slices[np.abs(z_slices) <= 0.5]
    cz = float(rng.choice(central if len(central) else z_slices))
    angle, radius = rng.uniform(0, 2 * np.pi), rng.uniform(0.15, 0.4)
    center = (float(radius * np.cos(angle)), float(radius * np.sin(angle)), cz)
    r = float(rng.uniform(*lesion_radius))
    axes = (r, float(r * rng.uniform(0.7, 1.3)), float(rng.uniform(0.15, 0.35)))
    return PhantomSpec(head, center, axes, float(rng.uniform(*lesion_hu)), noise_hu)


def _inside(x: np.ndarray, y: np.ndarray, z: np.ndarray, center: Sequence[float], axes: Sequence[float]) -> np.ndarray:
    return ((x - center[0]) / axes[0]) ** 2 + ((y - center[1]) / axes[1]) ** 2 + ((z - center[2]) / axes[2]) ** 2 <= 1.0


def render_phantom(spec: PhantomSpec, z_slices: np.ndarray, size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Render a phantom on slices at normalised positions ``z_slices``.

    Returns:
        ``(hu (S, size, size) float32 in HU, slice_labels (S,) int8)``; a slice is labelled 1 when
        it contains any lesion pixel.
    """
    coords = (np.arange(size, dtype=np.float32) + 0.5) / size * 2.0 - 1.0
    z = np.asarray(z_slices, dtype=np.float32)[:, None, None]
    y = coords[None, :, None]
    x = coords[None, None, :]
    origin = (0.0, 0.0, 0.0)
    head = _inside(x, y, z, origin, spec.head_axes)
    brain_axes = tuple(a - _SKULL_THICKNESS for a in spec.head_axes)
    brain = _inside(x, y, z, origin, brain_axes)
    ventricles = _inside(np.abs(x), y, z, (0.12, -0.05, 0.1), (0.07, 0.22, 0.25)) & brain
    hu = np.full(head.shape, HU_AIR, dtype=np.float32)
    hu[head] = HU_BONE
    hu[brain] = HU_BRAIN
    hu[ventricles] = HU_CSF
    labels = np.zeros(len(z_slices), dtype=np.int8)
    if spec.lesion_center is not None:
        lesion = _inside(x, y, z, spec.lesion_center, spec.lesion_axes) & brain
        hu[lesion] = spec.lesion_hu
        labels = lesion.any(axis=(1, 2)).astype(np.int8)
    hu += rng.standard_normal(hu.shape, dtype=np.float32) * np.float32(spec.noise_hu)
    return hu, labels


def _uid(seed: int, *parts: object) -> str:
    return generate_uid(entropy_srcs=["milgp-synthetic", str(seed), *map(str, parts)])


def write_ct_series(
    directory: str | os.PathLike[str],
    hu: np.ndarray,
    file_names: Sequence[str],
    *,
    rng: np.random.Generator,
    patient_id: str,
    study_uid: str,
    series_uid: str,
    z_start_mm: float = 0.0,
    slice_thickness_mm: float = 5.0,
    description: str = "CT 5mm",
    kernel: str = "STANDARD",
    contrast_agent: str | None = None,
    geometry: bool = True,
) -> list[str]:
    """Write a volume ``hu`` ``(S, H, W)`` (HU, slice 0 lowest along z) as one DICOM series of CT
    Image Storage files.

    Files are written in a random order (``rng``); slice ``k`` sits at
    ``z = z_start_mm + k * slice_thickness_mm`` and gets InstanceNumber ``S - k`` (top of the head
    first). Pixels are stored as int16 (``BitsStored = 16``, ``PixelRepresentation = 1``) with
    ``RescaleSlope = 1`` and ``RescaleIntercept = -1024`` so that HU = stored - 1024.
    ``geometry=False`` leaves out ImagePositionPatient/ImageOrientationPatient.

    Returns:
        The ``S`` paths in anatomical (ascending z) order.
    """
    if len(file_names) != hu.shape[0]:
        raise ValueError(f"{len(file_names)} file names for {hu.shape[0]} slices")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    num_slices, size = hu.shape[0], hu.shape[2]
    spacing = _FOV_MM / size
    raw = np.clip(np.rint(np.asarray(hu, dtype=np.float64) - _RESCALE_INTERCEPT), -32768, 32767).astype("<i2")
    paths = [str(directory / name) for name in file_names]
    for k in rng.permutation(num_slices):
        sop_uid = generate_uid(entropy_srcs=[series_uid, "instance", str(k)])
        ds = Dataset()
        ds.file_meta = FileMetaDataset()
        ds.file_meta.MediaStorageSOPClassUID = CTImageStorage
        ds.file_meta.MediaStorageSOPInstanceUID = sop_uid
        ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
        ds.file_meta.ImplementationClassUID = PYDICOM_IMPLEMENTATION_UID
        ds.SOPClassUID = CTImageStorage
        ds.SOPInstanceUID = sop_uid
        ds.Modality = "CT"
        ds.PatientID = patient_id
        ds.PatientName = patient_id
        ds.StudyInstanceUID = study_uid
        ds.SeriesInstanceUID = series_uid
        ds.FrameOfReferenceUID = generate_uid(entropy_srcs=[study_uid, "frame-of-reference"])
        ds.SeriesDescription = description
        ds.ConvolutionKernel = kernel
        if contrast_agent is not None:
            ds.ContrastBolusAgent = contrast_agent
        ds.InstanceNumber = num_slices - int(k)
        if geometry:
            position = (-_FOV_MM / 2, -_FOV_MM / 2, z_start_mm + k * slice_thickness_mm)
            ds.ImagePositionPatient = [f"{float(v):.4f}" for v in position]
            ds.SliceLocation = f"{float(position[2]):.4f}"
            ds.ImageOrientationPatient = [f"{float(v):.6f}" for v in _AXIAL]
        ds.PixelSpacing = [f"{spacing:.6f}", f"{spacing:.6f}"]
        ds.SliceThickness = f"{slice_thickness_mm:.4f}"
        ds.SamplesPerPixel = 1
        ds.PhotometricInterpretation = "MONOCHROME2"
        ds.Rows, ds.Columns = int(raw.shape[1]), int(raw.shape[2])
        ds.BitsAllocated = 16
        ds.BitsStored = 16
        ds.HighBit = 15
        ds.PixelRepresentation = 1
        ds.RescaleIntercept = f"{_RESCALE_INTERCEPT:g}"
        ds.RescaleSlope = "1"
        ds.RescaleType = "HU"
        ds.WindowCenter = "40"  # the brain window
        ds.WindowWidth = "80"
        ds.PixelData = raw[k].tobytes()
        ds.save_as(paths[k], enforce_file_format=True)
    return paths


@dataclass(frozen=True)
class SyntheticScan:
    """Ground truth for one written series.

    Attributes:
        bag_id: the id the matching indexer gives the bag (SeriesInstanceUID for RSNA, the
            ``reads.csv`` name for CQ500, the folder name for the generic layout).
        patient_id, study_uid, series_uid: the written identifiers.
        paths: files in anatomical order (ascending ImagePositionPatient z).
        z_mm: ``(S,)`` slice positions in mm, ascending.
        slice_labels: ``(S,)`` 1 where the slice shows the lesion.
        bag_label: 1.0 for a scan with a lesion.
    """

    bag_id: str
    patient_id: str
    study_uid: str
    series_uid: str
    paths: tuple[str, ...]
    z_mm: tuple[float, ...]
    slice_labels: tuple[int, ...]
    bag_label: float


def _write_scan(
    directory: Path, hu: np.ndarray, labels: np.ndarray, file_names: Sequence[str], rng: np.random.Generator, *,
    bag_id: str, patient_id: str, study_uid: str, series_uid: str, bag_label: float | None = None,
    z_start_mm: float = 0.0, slice_thickness_mm: float = 5.0, **series_kw: object,
) -> SyntheticScan:
    """Write one series (:func:`write_ct_series`) and return its ground truth; the bag label is the
    largest slice label unless given."""
    paths = write_ct_series(
        directory, hu, file_names, rng=rng, patient_id=patient_id, study_uid=study_uid, series_uid=series_uid,
        z_start_mm=z_start_mm, slice_thickness_mm=slice_thickness_mm, **series_kw,  # type: ignore[arg-type]
    )
    return SyntheticScan(
        bag_id=bag_id, patient_id=patient_id, study_uid=study_uid, series_uid=series_uid, paths=tuple(paths),
        z_mm=tuple(z_start_mm + slice_thickness_mm * np.arange(len(paths))),
        slice_labels=tuple(int(v) for v in labels), bag_label=float(labels.max()) if bag_label is None else bag_label,
    )


@dataclass
class SyntheticDataset:
    """What a ``write_*_dataset`` call wrote: the layout's paths and the per-scan ground truth.

    ``image_dir`` is the folder to index (RSNA: the ``ID_*.dcm`` folder; CQ500 and generic: the
    root of the study/bag folders); ``labels_csv`` the label file; ``slice_labels_csv`` the
    generic layout's optional slice-label file.
    """

    layout: str
    root: str
    image_dir: str
    labels_csv: str
    scans: list[SyntheticScan]
    slice_labels_csv: str | None = None

    def scan(self, bag_id: str) -> SyntheticScan:
        """The ground truth of one bag (``KeyError`` naming the id when unknown)."""
        for s in self.scans:
            if s.bag_id == bag_id:
                return s
        raise KeyError(f"no synthetic scan with bag id {bag_id!r}")


def _random_names(rng: np.random.Generator, count: int, prefix: str, used: set[str]) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = f"{prefix}{int(rng.integers(0, 16**9)):09x}"
        if name not in used:
            used.add(name)
            names.append(name)
    return names


def _start(
    root: str | os.PathLike[str], n: int, slices: tuple[int, int], size: int, prevalence: float, seed: int
) -> tuple[np.random.Generator, np.ndarray]:
    """Check the arguments every writer takes; ``(rng, positive (n,) bool)``: the seeded generator
    and which scans get a lesion (``prevalence · n`` of them, rounded).

    ``root`` must be new or an empty folder: written into an existing dataset, the new series
    would mix with its series and the label files would be replaced, silently."""
    path = Path(root)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        what = "is not a folder" if not path.is_dir() else "is not empty"
        raise ValueError(f"{printable(path)}: {what}; a synthetic dataset is written into a new or empty folder only "
                         "(writing into an existing dataset would mix its series and replace its label files)")
    if n < 1:
        raise ValueError(f"need at least one scan, got {n}")
    if not 1 <= slices[0] <= slices[1]:
        raise ValueError(f"slices must be a range (min, max) with 1 <= min <= max, got {slices}")
    if size < 8:
        raise ValueError(f"image size must be at least 8 pixels, got {size}")
    if not 0.0 <= prevalence <= 1.0:
        raise ValueError(f"prevalence must be in [0, 1], got {prevalence}")
    rng = np.random.default_rng(seed)
    positive = np.zeros(n, dtype=bool)
    positive[rng.permutation(n)[: int(round(prevalence * n))]] = True
    return rng, positive


def _z_norm(num_slices: int) -> np.ndarray:
    """Normalised positions of ``num_slices`` slices evenly covering the scan."""
    return (np.arange(num_slices) + 0.5) / num_slices * 2.0 - 1.0


def write_rsna_dataset(
    root: str | os.PathLike[str],
    n_scans: int = 20,
    slices: tuple[int, int] = (10, 14),
    size: int = 64,
    prevalence: float = 0.5,
    lesion_radius: tuple[float, float] = (0.1, 0.2),
    seed: int = 0,
    n_patients: int | None = None,
    noise_hu: float = 8.0,
    duplicate_rows: int = 0,
    slice_factor: int = 1,
    lesion_hu: tuple[float, float] = (60.0, 90.0),
) -> SyntheticDataset:
    """Write an RSNA-style dataset: ``root/stage_2_train/ID_<hex>.dcm`` + ``root/stage_2_train.csv``.

    Args:
        root: output folder (created; must be new or empty).
        n_scans: number of series.
        slices: ``(min, max)`` slices per scan at the standard 5 mm spacing, inclusive.
        size: image height = width in pixels.
        prevalence: fraction of positive scans (rounded to a count).
        lesion_radius, noise_hu, lesion_hu: lesion size, noise and lesion density, as in :func:`sample_phantom`.
        seed: makes the whole dataset, file names and UIDs included, reproducible.
        n_patients: scans are dealt round-robin to this many patients (default: one per scan).
        duplicate_rows: how many label rows to repeat verbatim (the real file has duplicates).
        slice_factor: re-slice every scan this many times more finely, as thin-slice external CT
            sets are: a scan drawn with ``n`` slices is written as ``slice_factor · n`` slices of
            ``5 / slice_factor`` mm covering the same head, and its lesion (placed as for the
            ``n``-slice scan) spans ``slice_factor`` times more slices.

    Returns:
        The ground truth; ``bag_id`` = SeriesInstanceUID.
    """
    if slice_factor < 1:
        raise ValueError(f"slice_factor must be a positive integer, got {slice_factor}")
    rng, positive = _start(root, n_scans, slices, size, prevalence, seed)
    n_patients = n_scans if n_patients is None else n_patients
    root_path = Path(root)
    image_dir = root_path / "stage_2_train"
    used: set[str] = set()
    scans: list[SyntheticScan] = []
    rows: list[tuple[str, int]] = []
    subtypes = RSNA_SUBTYPES[:-1]  # the hemorrhage subtypes, without "any"
    thickness = 5.0 / slice_factor
    for i in range(n_scans):
        num = int(rng.integers(slices[0], slices[1] + 1))
        spec = sample_phantom(rng, bool(positive[i]), _z_norm(num), lesion_radius, noise_hu, lesion_hu)
        z = _z_norm(num * slice_factor)
        hu, labels = render_phantom(spec, z, size, rng)
        series_uid = _uid(seed, "series", i)
        names = _random_names(rng, len(z), "ID_", used)
        scans.append(_write_scan(
            image_dir, hu, labels, [n + ".dcm" for n in names], rng, bag_id=series_uid,
            patient_id=f"ID_{i % n_patients:08x}", study_uid=_uid(seed, "study", i), series_uid=series_uid,
            z_start_mm=float(rng.uniform(-50.0, 50.0)),
            slice_thickness_mm=thickness, description="CT 5mm" if slice_factor == 1 else f"CT {thickness:g}mm",
        ))
        subtype = subtypes[int(rng.integers(len(subtypes)))]
        for name, lab in zip(names, labels):
            rows.extend((f"{name}_{s}", int(lab) if s == subtype else 0) for s in subtypes)
            rows.append((f"{name}_any", int(lab)))
    rows.sort()
    for k in rng.choice(len(rows), size=min(duplicate_rows, len(rows)), replace=False):
        rows.append(rows[int(k)])
    labels_csv = root_path / "stage_2_train.csv"
    atomic_write_text(labels_csv, "ID,Label\n" + "".join(f"{key},{value}\n" for key, value in rows))
    return SyntheticDataset("rsna", str(root_path), str(image_dir), str(labels_csv), scans)


def write_cq500_dataset(
    root: str | os.PathLike[str],
    n_studies: int = 4,
    slices: tuple[int, int] = (8, 10),
    size: int = 48,
    prevalence: float = 0.5,
    seed: int = 0,
    noise_hu: float = 8.0,
) -> SyntheticDataset:
    """Write a CQ500-style dataset: ``root/CQ500CT<n> CQ500CT<n>/Unknown Study/<series>/CT*.dcm`` + ``root/reads.csv``.

    Every study has four series of the same phantom: ``CT 5mm`` (plain, 5 mm: the one the
    selection rule must pick), ``CT PLAIN THIN`` (2.5 mm, twice the slices), ``CT POST CONTRAST``
    (5 mm, more slices, ContrastBolusAgent set) and ``CT BONE`` (5 mm, bone kernel, more slices).
    ``reads.csv`` has three readers whose majority is the truth (one reader disagrees on some
    studies).

    Returns:
        The ground truth of the ``CT 5mm`` series; ``bag_id`` = ``CQ500-CT-<n>``.
    """
    rng, positive = _start(root, n_studies, slices, size, prevalence, seed)
    root_path = Path(root)
    scans: list[SyntheticScan] = []
    reads = io.StringIO()
    writer = csv.writer(reads, lineterminator="\n")
    writer.writerow(["name", "Category", "R1:ICH", "R1:IPH", "R2:ICH", "R2:IPH", "R3:ICH", "R3:IPH"])
    variants = (  # description, thickness (mm), slice-count factor, extra slices, kernel, contrast agent
        ("CT 5mm", 5.0, 1, 0, "STANDARD", None),
        ("CT PLAIN THIN", 2.5, 2, 0, "STANDARD", None),
        ("CT POST CONTRAST", 5.0, 1, 3, "STANDARD", "IOHEXOL"),
        ("CT BONE", 5.0, 1, 2, "BONE", None),
    )
    for i in range(n_studies):
        name, folder = f"CQ500-CT-{i}", root_path / f"CQ500CT{i} CQ500CT{i}" / "Unknown Study"
        num = int(rng.integers(slices[0], slices[1] + 1))
        spec = sample_phantom(rng, bool(positive[i]), _z_norm(num), noise_hu=noise_hu)
        study_uid = _uid(seed, "cq500-study", i)
        for v, (desc, thickness, factor, extra_slices, kernel, agent) in enumerate(variants):
            count = num * factor + extra_slices
            hu, labels = render_phantom(spec, _z_norm(count) * (count / (num * factor)), size, rng)
            scan = _write_scan(
                folder / desc, hu, labels, [f"CT{k:06d}.dcm" for k in rng.permutation(count)], rng, bag_id=name,
                patient_id=name, study_uid=study_uid, series_uid=_uid(seed, "cq500-series", i, v),
                bag_label=float(positive[i]), slice_thickness_mm=thickness,
                description=desc, kernel=kernel, contrast_agent=agent,
            )
            if v == 0:
                scans.append(scan)
        truth = int(positive[i])
        votes = [truth, truth, truth]
        votes[int(rng.integers(3))] = 1 - truth if rng.random() < 0.5 else truth
        writer.writerow([name, "synthetic", votes[0], 0, votes[1], 0, votes[2], 0])
    labels_csv = root_path / "reads.csv"
    atomic_write_text(labels_csv, reads.getvalue())
    return SyntheticDataset("cq500", str(root_path), str(root_path), str(labels_csv), scans)


def write_generic_dataset(
    root: str | os.PathLike[str],
    n_bags: int = 6,
    slices: tuple[int, int] = (8, 12),
    size: int = 48,
    prevalence: float = 0.5,
    seed: int = 0,
    n_patients: int | None = None,
    noise_hu: float = 8.0,
) -> SyntheticDataset:
    """Write the generic layout: ``root/bags/<bag_id>/img_<hex>.dcm``, ``root/labels.csv``
    (``bag_id,label,patient_id``) and ``root/slice_labels.csv`` (``bag_id,file,label``).

    Returns:
        The ground truth; ``bag_id`` = the folder name ``scan_<i>``.
    """
    rng, positive = _start(root, n_bags, slices, size, prevalence, seed)
    n_patients = n_bags if n_patients is None else n_patients
    root_path = Path(root)
    bags_dir = root_path / "bags"
    used: set[str] = set()
    scans: list[SyntheticScan] = []
    bag_rows, slice_rows = ["bag_id,label,patient_id\n"], ["bag_id,file,label\n"]
    for i in range(n_bags):
        bag_id, patient_id = f"scan_{i:03d}", f"patient_{i % n_patients:03d}"
        num = int(rng.integers(slices[0], slices[1] + 1))
        z = _z_norm(num)
        hu, labels = render_phantom(sample_phantom(rng, bool(positive[i]), z, noise_hu=noise_hu), z, size, rng)
        names = [n + ".dcm" for n in _random_names(rng, num, "img_", used)]
        scans.append(_write_scan(
            bags_dir / bag_id, hu, labels, names, rng, bag_id=bag_id, patient_id=patient_id,
            study_uid=_uid(seed, "generic-study", i), series_uid=_uid(seed, "generic-series", i),
        ))
        bag_rows.append(f"{bag_id},{int(labels.max())},{patient_id}\n")
        slice_rows.extend(f"{bag_id},{n},{int(lab)}\n" for n, lab in zip(names, labels))
    labels_csv, slice_csv = root_path / "labels.csv", root_path / "slice_labels.csv"
    atomic_write_text(labels_csv, "".join(bag_rows))
    atomic_write_text(slice_csv, "".join(slice_rows))
    return SyntheticDataset("generic", str(root_path), str(bags_dir), str(labels_csv), scans, str(slice_csv))
