"""milgp.ct.dicom, hounsfield, windows, series_check, series: HU conversion, windows, series ordering and
every bad-input path."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.pixels import get_decoder
from pydicom.uid import JPEGLSLossless

from milgp.ct.series import load_series
from milgp.ct.dicom import DicomReadError, header_window, read_headers, read_slice_header
from milgp.ct.hounsfield import needs_rsna_12bit_repair, read_hu, read_slice_values, repair_rsna_12bit_fault
from milgp.ct.windows import HEAD_CT_WINDOWS, apply_window, ct_channels, resize_images


def test_read_hu_ct_small_matches_rescale_tags(ct_small_path: str) -> None:
    """CT_small stores int16 with slope 1, intercept -1024; raw min/max 128/2191 must become -896/1167 HU.
    Failing means the rescale is not applied, applied twice, or the 12-bit repair fires on a normal file."""
    ds = pydicom.dcmread(ct_small_path)
    assert float(ds.RescaleSlope) == 1.0 and float(ds.RescaleIntercept) == -1024.0
    hu = read_hu(ct_small_path)
    assert hu.dtype == np.float32 and hu.shape == (128, 128)
    np.testing.assert_array_equal(hu, ds.pixel_array.astype(np.float32) * 1.0 - 1024.0)
    assert hu.min() == -896.0 and hu.max() == 1167.0


def test_brain_window_anchor_points() -> None:
    """The brain window (40, 80) must map HU 0 -> 0, 40 -> 0.5, 80 -> 1 and clip outside; otherwise
    every cached image has the wrong contrast."""
    out = apply_window(np.array([-1000.0, 0.0, 40.0, 80.0, 1000.0]), 40, 80)
    np.testing.assert_allclose(out, [0.0, 0.0, 0.5, 1.0, 1.0])
    assert out.dtype == np.float32
    with pytest.raises(ValueError, match="width"):
        apply_window(np.zeros(2), 40, 0)


def test_ct_channels_stacks_the_three_head_windows(ct_small_path: str) -> None:
    """Channels must be brain, subdural, soft tissue in that order, each in [0, 1]; resizing must give the
    requested size and keep values in [0, 1]. Failing means channel order or scaling differs from the
    three-window pipeline of Castro-Macias et al. (2024)."""
    assert HEAD_CT_WINDOWS == ((40.0, 80.0), (80.0, 200.0), (40.0, 380.0))
    hu = read_hu(ct_small_path)
    ch = ct_channels(hu)
    assert ch.shape == (3, 128, 128) and ch.dtype == np.float32
    for k, (c, w) in enumerate(HEAD_CT_WINDOWS):
        np.testing.assert_array_equal(ch[k], apply_window(hu, c, w))
    small = ct_channels(hu, size=(32, 48))
    assert small.shape == (3, 32, 48) and small.min() >= 0.0 and small.max() <= 1.0
    assert ct_channels(np.stack([hu, hu]), size=16).shape == (2, 3, 16, 16)


def test_resize_is_antialiased() -> None:
    """Shrinking a 1-pixel stripe pattern 8x must average it (~0.5 everywhere); plain bilinear sampling
    would alias to stripes. Constant images must stay constant."""
    stripes = np.tile(np.array([0.0, 1.0], dtype=np.float32), (64, 32))
    out = resize_images(stripes, 8)
    assert out.shape == (8, 8)
    np.testing.assert_allclose(out, 0.5, atol=0.05)
    np.testing.assert_allclose(resize_images(np.full((2, 30, 30), 0.7, np.float32), 9), 0.7, atol=1e-6)


def test_ct5n_is_ordered_by_geometry(ct5n_dir: str) -> None:
    """CT5N's file names and InstanceNumbers do not follow the scan axis (instances count down as z rises).
    The loaded series must be in ascending position along the slice normal (here +z), which equals the
    ImagePositionPatient z of each file."""
    series = load_series(ct5n_dir)
    assert series.ordering == "geometry" and series.hu.shape == (5, 16, 16) and not series.skipped
    assert np.all(np.diff(series.positions) > 0)
    headers = [pydicom.dcmread(p, stop_before_pixels=True) for p in series.paths]
    np.testing.assert_allclose(series.positions, [float(h.ImagePositionPatient[2]) for h in headers])
    instance_numbers = [int(h.InstanceNumber) for h in headers]
    assert instance_numbers == sorted(instance_numbers, reverse=True)
    assert [os.path.basename(p) for p in series.paths] != sorted(os.listdir(ct5n_dir))
    np.testing.assert_array_equal(series.hu[0], read_hu(series.paths[0]))
    assert len({h.SeriesInstanceUID for h in headers}) == 1 and series.series_uid == headers[0].SeriesInstanceUID


def test_non_dicom_file_raises_naming_it(tmp_path: Path) -> None:
    """A text file must raise DicomReadError whose message names the file, not a bare pydicom error."""
    path = tmp_path / "notes.dcm"
    path.write_text("this is not a DICOM file\n" * 20)
    with pytest.raises(DicomReadError, match="notes.dcm.*not a DICOM file") as err:
        read_hu(path)
    assert err.value.path == str(path)
    with pytest.raises(DicomReadError, match="notes.dcm"):
        read_slice_header(path)


@pytest.mark.parametrize("keep", [0.5, 0.02])
def test_truncated_file_raises_naming_it(ct_small_path: str, tmp_path: Path, keep: float) -> None:
    """A file cut inside the pixel data (0.5) or inside the header (0.02) must raise DicomReadError naming it."""
    data = Path(ct_small_path).read_bytes()
    path = tmp_path / "cut.dcm"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(DicomReadError, match="cut.dcm"):
        read_hu(path)


def test_pydicom_truncated_example_raises(bundled) -> None:
    """pydicom's own MR_truncated.dcm (pixel data short) must be refused with the file named: as MR by read_hu
    (its values are not HU), as undecodable when non-CT images are allowed."""
    with pytest.raises(DicomReadError, match="MR_truncated.dcm.*Modality 'MR', not CT"):
        read_hu(bundled("MR_truncated.dcm"))
    with pytest.raises(DicomReadError, match="MR_truncated.dcm.*cannot be decoded"):
        read_slice_values(bundled("MR_truncated.dcm"), allow_non_ct=True)


def test_dicom_without_pixel_data_is_refused(ct_small_path: str, tmp_path: Path, bundled) -> None:
    """A DICOM with no PixelData must raise 'no PixelData' naming the file; non-image objects (an RT plan)
    must be skipped by batch header reading with a reason, not crash it."""
    ds = pydicom.dcmread(ct_small_path)
    del ds.PixelData
    path = tmp_path / "nopix.dcm"
    ds.save_as(path)
    with pytest.raises(DicomReadError, match="nopix.dcm.*no PixelData"):
        read_hu(path)
    plan = tmp_path / "plan.dcm"
    shutil.copy(bundled("rtplan.dcm"), plan)
    headers, skipped = read_headers([plan, ct_small_path])
    assert [h.path for h in headers] == [ct_small_path]
    assert skipped[0][0] == str(plan) and "no image" in skipped[0][1]


def test_rsna_12bit_fault_is_repaired(ct_small_path: str, tmp_path: Path) -> None:
    """An RSNA-style faulty slice (BitsStored 12, unsigned, intercept 0, negative HU wrapped into 3096..4095)
    must read back as the true HU; without the repair air would read as ~+3000 HU."""
    true_hu = np.array([[-1000, -500, -1, 0], [40, 80, 1000, 2000]], dtype=np.int32)
    raw = np.mod(true_hu, 4096).astype(np.uint16)
    ds = pydicom.dcmread(ct_small_path)
    ds.Rows, ds.Columns = raw.shape
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
    ds.RescaleIntercept, ds.RescaleSlope = "0", "1"
    ds.PixelData = raw.tobytes()
    path = tmp_path / "fault.dcm"
    ds.save_as(path)
    np.testing.assert_array_equal(read_hu(path), true_hu.astype(np.float32))
    assert needs_rsna_12bit_repair(12, 0, 0.0) and not needs_rsna_12bit_repair(12, 0, -1024.0)
    assert not needs_rsna_12bit_repair(16, 0, 0.0) and not needs_rsna_12bit_repair(12, 1, 0.0)
    fixed, intercept, clamped = repair_rsna_12bit_fault(np.array([0, 2999, 3000, 3095, 3096, 4095]))
    assert intercept == -1000.0 and (fixed + intercept).tolist() == [0, 2999, -1000, -1000, -1000, -1] and clamped == 2


def test_the_12bit_repair_leaves_other_modalities_alone(ct_small_path: str, tmp_path: Path) -> None:
    """An MR slice stored as 12-bit unsigned without rescale tags (a common MR layout) looks like the
    RSNA CT fault by its tags alone; read with ``allow_non_ct`` its values must come back as stored.
    If this fails, bright MR pixels are wrapped to dark ones (3500 → -596) and values ≥ 4000 set to the minimum."""
    raw = np.array([[0, 100, 2000, 3500], [3999, 4000, 4050, 4095]], dtype=np.uint16)
    ds = pydicom.dcmread(ct_small_path)
    ds.Modality, ds.Rows, ds.Columns = "MR", *raw.shape
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
    del ds.RescaleSlope, ds.RescaleIntercept
    ds.PixelData = raw.tobytes()
    path = tmp_path / "mr12.dcm"
    ds.save_as(path)
    sv = read_slice_values(path, allow_non_ct=True)
    np.testing.assert_array_equal(sv.values, raw.astype(np.float32))
    assert not sv.repaired_12bit and sv.clamped_air == 0 and sv.units.startswith("MR")


def test_missing_rescale_tags_mean_identity(ct_small_path: str, tmp_path: Path) -> None:
    """Without RescaleSlope/RescaleIntercept the HU are the stored values (slope 1, intercept 0), and the
    assumption is announced with a warning naming the file."""
    ds = pydicom.dcmread(ct_small_path)
    raw = ds.pixel_array.astype(np.float32)
    del ds.RescaleSlope, ds.RescaleIntercept
    path = tmp_path / "norescale.dcm"
    ds.save_as(path)
    with pytest.warns(UserWarning, match="norescale.dcm: RescaleSlope/RescaleIntercept missing.*assumed slope 1, intercept 0"):
        np.testing.assert_array_equal(read_hu(path), raw)


def test_multivalue_window_tags_take_the_first(ct_small_path: str) -> None:
    """Multi-valued WindowCenter/WindowWidth (common in real CTs) must give the first window, not crash."""
    ds = pydicom.dcmread(ct_small_path, stop_before_pixels=True)
    ds.WindowCenter, ds.WindowWidth = ["40", "300"], ["80", "1500"]
    assert header_window(ds) == (40.0, 80.0)
    ds.WindowCenter = "50"
    ds.WindowWidth = "100"
    assert header_window(ds) == (50.0, 100.0)
    del ds.WindowCenter
    assert header_window(ds) is None


def test_missing_geometry_falls_back_to_instance_number_with_warning(write_series) -> None:
    """Without ImagePositionPatient/Orientation the series must be ordered by InstanceNumber, with a warning
    naming the series and ordering == 'instance_number' (the writer numbers slices top-down)."""
    paths = write_series(num_slices=5, geometry=False, series_uid="1.2.3.99")
    with pytest.warns(UserWarning, match=r"1\.2\.3\.99.*InstanceNumber"):
        series = load_series(os.path.dirname(paths[0]))
    assert series.ordering == "instance_number"
    assert series.paths == paths[::-1]
    np.testing.assert_array_equal(series.positions, [1, 2, 3, 4, 5])


def test_geometry_order_beats_file_names_and_instance_numbers(write_series) -> None:
    """With geometry present the order must be ascending z even though file names are shuffled and
    InstanceNumbers count down."""
    paths = write_series(num_slices=6)
    series = load_series(os.path.dirname(paths[0]))
    assert series.ordering == "geometry" and series.paths == paths
    np.testing.assert_allclose(series.hu.mean(axis=(1, 2)), np.arange(6) * 10.0, atol=0.5)


def test_odd_image_size_within_a_series_is_an_error(write_series, ct_small_path: str) -> None:
    """One slice of another size in a series must raise an error naming that file, not be silently resized."""
    paths = write_series(num_slices=3, size=16)
    odd = os.path.join(os.path.dirname(paths[0]), "odd.dcm")
    ds = pydicom.dcmread(paths[0])
    ds.Rows = ds.Columns = 8
    ds.PixelData = np.zeros((8, 8), dtype="<i2").tobytes()
    ds.ImagePositionPatient = [0, 0, 99]
    ds.save_as(odd)
    with pytest.raises(ValueError, match=r"inconsistent image sizes.*odd\.dcm is 8x8"):
        load_series(os.path.dirname(paths[0]))


def test_mixed_series_is_an_error(write_series, tmp_path: Path) -> None:
    """Files of two SeriesInstanceUIDs in one folder must raise an error naming both UIDs."""
    write_series(name="mix", num_slices=2, series_uid="1.2.3.10")
    a = write_series(name="other", num_slices=2, series_uid="1.2.3.11")
    shutil.copy(a[0], tmp_path / "mix" / "from_other.dcm")
    with pytest.raises(ValueError, match=r"2 different SeriesInstanceUIDs.*1\.2\.3\.10.*1\.2\.3\.11"):
        load_series(tmp_path / "mix")


def test_empty_folder_is_an_error(tmp_path: Path) -> None:
    """An empty folder must raise a clear 'no files' error, not return an empty series."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: no files found"):
        load_series(tmp_path / "empty")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a.txt").write_text("x")
    with pytest.raises(ValueError, match="no readable DICOM image"):
        load_series(tmp_path / "junk")


def test_corrupt_file_in_series_is_skipped_and_reported(write_series) -> None:
    """A corrupt file inside a series folder must be skipped and listed with its reason; the rest loads."""
    paths = write_series(num_slices=3)
    bad = os.path.join(os.path.dirname(paths[0]), "zz_bad.dcm")
    Path(bad).write_bytes(b"\x00" * 300)
    series = load_series(os.path.dirname(paths[0]))
    assert series.paths == paths and series.skipped and series.skipped[0].path == bad


def test_compressed_pixel_data_is_decoded_or_refused_clearly(bundled, tmp_path) -> None:
    """RLE and JPEG-LS lossless (the pylibjpeg plugins milgp installs) must decode to exactly the
    pixels of the uncompressed original; a transfer syntax no installed handler decodes must raise
    DicomReadError naming the file and the transfer syntax, never return garbage."""
    def read(name: str) -> np.ndarray:
        return read_slice_values(bundled(name), allow_non_ct=True).values

    reference = read("MR_small.dcm")
    np.testing.assert_array_equal(read("MR_small_RLE.dcm"), reference)
    assert get_decoder(JPEGLSLossless).is_available, "pylibjpeg-libjpeg should be installed by pyproject"
    np.testing.assert_array_equal(read("MR_small_jpeg_ls_lossless.dcm"), reference)
    ds = pydicom.dcmread(bundled("MR_small_jpeg_ls_lossless.dcm"))
    ds.file_meta.TransferSyntaxUID = pydicom.uid.MPEG2MPML  # video: no installed decoder
    odd = tmp_path / "mpeg2.dcm"
    ds.save_as(odd, enforce_file_format=True)
    with pytest.raises(DicomReadError, match=r"mpeg2\.dcm.*MPEG2.*1\.2\.840\.10008\.1\.2\.4\.100"):
        read_slice_values(odd, allow_non_ct=True)
