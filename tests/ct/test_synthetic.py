"""milgp.ct.synthetic: real DICOM phantoms, ground truth, determinism, thin re-slicing."""
from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian

from milgp.ct.hounsfield import read_hu
from milgp.ct.synthetic import SyntheticDataset, write_cq500_dataset, write_generic_dataset, write_rsna_dataset


def test_files_are_valid_ct_image_storage(rsna_synth: SyntheticDataset) -> None:
    """Every written file must be a CT Image Storage object in explicit VR little endian with file meta,
    UIDs, identifiers, geometry, rescale and window tags -- otherwise real DICOM tools would reject it."""
    ds = pydicom.dcmread(rsna_synth.scans[0].paths[0])
    assert ds.file_meta.MediaStorageSOPClassUID == CTImageStorage == ds.SOPClassUID
    assert ds.file_meta.TransferSyntaxUID == ExplicitVRLittleEndian
    assert ds.file_meta.MediaStorageSOPInstanceUID == ds.SOPInstanceUID
    for tag in ("PatientID", "StudyInstanceUID", "SeriesInstanceUID", "ImagePositionPatient", "ImageOrientationPatient",
                "PixelSpacing", "SliceThickness", "RescaleSlope", "RescaleIntercept", "WindowCenter", "WindowWidth",
                "BitsStored", "InstanceNumber"):
        assert tag in ds, tag
    assert ds.Modality == "CT" and ds.BitsStored == 16 and ds.PixelRepresentation == 1
    uids = {pydicom.dcmread(p, stop_before_pixels=True).SOPInstanceUID for s in rsna_synth.scans for p in s.paths}
    assert len(uids) == sum(len(s.paths) for s in rsna_synth.scans)


def test_phantom_tissues_have_ct_densities(rsna_synth: SyntheticDataset) -> None:
    """A mid slice must contain air (~-1000 HU), bone (~+1000 HU) and brain (~35 HU) as read back in HU."""
    scan = rsna_synth.scans[0]
    hu = read_hu(scan.paths[len(scan.paths) // 2])
    assert abs(np.median(hu[hu < -500]) + 1000) < 10
    assert abs(np.median(hu[hu > 500]) - 1000) < 10
    assert abs(np.median(hu[(hu > 0) & (hu < 50)]) - 35) < 6


def test_lesions_are_hyperdense_and_on_contiguous_labelled_slices(rsna_synth: SyntheticDataset) -> None:
    """Positive scans must have a run of contiguous positive slices showing 60-90 HU blobs; negative scans none.
    Failing means the slice ground truth does not match the pixels."""
    positives = [s for s in rsna_synth.scans if s.bag_label == 1.0]
    assert len(positives) == 4 and all(s.bag_label == 0.0 for s in rsna_synth.scans if s not in positives)
    for s in rsna_synth.scans:
        labels = np.array(s.slice_labels)
        assert labels.max() == s.bag_label
        if s.bag_label:
            idx = np.flatnonzero(labels)
            assert np.all(np.diff(idx) == 1)
            hu = read_hu(s.paths[idx[len(idx) // 2]])
            assert ((hu > 55) & (hu < 100)).sum() >= 4


def test_file_order_is_not_anatomical_order(rsna_synth: SyntheticDataset) -> None:
    """File names must be shuffled relative to anatomy (else ordering tests would pass by accident)."""
    shuffled = [s for s in rsna_synth.scans if list(s.paths) != sorted(s.paths)]
    assert len(shuffled) >= len(rsna_synth.scans) - 1
    for s in rsna_synth.scans:
        z = [float(pydicom.dcmread(p, stop_before_pixels=True).ImagePositionPatient[2]) for p in s.paths]
        np.testing.assert_allclose(z, s.z_mm, atol=1e-3)
        assert np.all(np.diff(z) > 0)


def test_rsna_label_csv_format(rsna_synth: SyntheticDataset) -> None:
    """The label file must be 'ID,Label' with six subtype rows per image (plus the planted duplicates), and the
    'any' row must equal the slice ground truth; file names must be ID_<hex>.dcm in one folder."""
    with open(rsna_synth.labels_csv, newline="") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["ID", "Label"]
    n_images = sum(len(s.paths) for s in rsna_synth.scans)
    assert len(rows) - 1 == 6 * n_images + 4
    table = dict((r[0], int(r[1])) for r in rows[1:])
    for s in rsna_synth.scans:
        for p, lab in zip(s.paths, s.slice_labels):
            stem = Path(p).stem
            assert Path(p).parent == Path(rsna_synth.image_dir) and stem.startswith("ID_") and len(stem) == 12
            assert table[f"{stem}_any"] == lab


def test_generator_is_deterministic(tmp_path: Path) -> None:
    """The same seed must give byte-identical files and names; another seed must give different data."""
    a = write_rsna_dataset(tmp_path / "a", n_scans=2, slices=(3, 4), size=16, seed=5)
    b = write_rsna_dataset(tmp_path / "b", n_scans=2, slices=(3, 4), size=16, seed=5)
    c = write_rsna_dataset(tmp_path / "c", n_scans=2, slices=(3, 4), size=16, seed=6)
    assert sorted(os.listdir(a.image_dir)) == sorted(os.listdir(b.image_dir)) != sorted(os.listdir(c.image_dir))
    for name in os.listdir(a.image_dir):
        assert (Path(a.image_dir) / name).read_bytes() == (Path(b.image_dir) / name).read_bytes()
    assert Path(a.labels_csv).read_text() == Path(b.labels_csv).read_text()


def test_slice_factor_samples_the_same_head_and_lesion_more_finely(tmp_path: Path) -> None:
    """slice_factor=6 must write the same phantom (same seed) as 6x more, 6x thinner slices over the
    same extent, with the lesion on about 6x more slices (the same fraction of the scan): the
    thin-slice external sets the bag rules are checked on. If the lesion were re-drawn, or the
    extent grew with the slice count, a 'thin' scan would be another patient, not a re-slicing."""
    coarse = write_rsna_dataset(tmp_path / "c", n_scans=1, slices=(8, 8), size=16, seed=2, prevalence=1.0, lesion_radius=(0.3, 0.3))
    thin = write_rsna_dataset(tmp_path / "t", n_scans=1, slices=(8, 8), size=16, seed=2, prevalence=1.0, lesion_radius=(0.3, 0.3),
                              slice_factor=6)
    c, t = coarse.scans[0], thin.scans[0]
    assert len(c.paths) == 8 and len(t.paths) == 48
    np.testing.assert_allclose(np.diff(t.z_mm), 5.0 / 6, atol=1e-9)
    assert (t.z_mm[-1] - t.z_mm[0] + 5.0 / 6) == pytest.approx(c.z_mm[-1] - c.z_mm[0] + 5.0)
    header = pydicom.dcmread(t.paths[0], stop_before_pixels=True)
    assert float(header.SliceThickness) == pytest.approx(5.0 / 6, abs=1e-4)
    assert c.bag_label == t.bag_label == 1.0
    assert abs(np.mean(t.slice_labels) - np.mean(c.slice_labels)) <= 1.0 / 8
    with pytest.raises(ValueError, match="slice_factor"):
        write_rsna_dataset(tmp_path / "bad", n_scans=1, slices=(2, 2), size=16, slice_factor=0)


@pytest.mark.parametrize("layout", ["rsna", "cq500", "generic"])
def test_writer_refuses_a_folder_that_is_not_empty(layout: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Writing a synthetic dataset into a folder that already holds one must be refused in one line,
    leaving every file as it was (the library writers and `milgp-cache synthetic`); a new or empty
    folder is written. Before, the second write mixed its series into the first and replaced the
    label files."""
    from milgp.ct.cache_cli import main

    root = tmp_path / "data"
    args = ["synthetic", "--layout", layout, "--out", str(root), "--scans", "2", "--slices", "2", "2", "--size", "16"]
    assert main(args) == 0
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main([*args, "--seed", "9"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not empty" in err and str(root) in err
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    writer = {"rsna": write_rsna_dataset, "cq500": write_cq500_dataset, "generic": write_generic_dataset}[layout]
    with pytest.raises(ValueError, match="is not empty"):
        writer(root, 2, slices=(2, 2), size=16, seed=9)
    (tmp_path / "empty").mkdir()
    assert len(writer(tmp_path / "empty", 2, slices=(2, 2), size=16).scans) == 2
