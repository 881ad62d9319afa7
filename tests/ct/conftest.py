"""Shared fixtures for the CT data tests: pydicom's bundled CT files and small synthetic datasets."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from pydicom.data import get_testdata_file

from milgp.ct.cache import CacheParams, build_cache
from milgp.ct.rsna import index_rsna
from milgp.ct.synthetic import SyntheticDataset, write_ct_series, write_rsna_dataset


def _bundled(name: str) -> str:
    path = get_testdata_file(name, download=False)
    assert path is not None, f"pydicom's bundled test file {name} is missing"
    return str(path)


@pytest.fixture(scope="session")
def ct_small_path() -> str:
    """pydicom's CT_small.dcm (128x128 CT slice, RescaleSlope 1, RescaleIntercept -1024)."""
    return _bundled("CT_small.dcm")


@pytest.fixture(scope="session")
def ct5n_dir(ct_small_path: str) -> str:
    """pydicom's five-slice CT series dicomdirtests/98892001/CT5N."""
    path = os.path.join(os.path.dirname(ct_small_path), "dicomdirtests", "98892001", "CT5N")
    assert os.path.isdir(path), f"pydicom's bundled CT5N series is missing at {path}"
    return path


@pytest.fixture(scope="session")
def bundled() -> Callable[[str], str]:
    """Path of any pydicom bundled test file (never downloads)."""
    return _bundled


@pytest.fixture(scope="session")
def rsna_synth(tmp_path_factory: pytest.TempPathFactory) -> SyntheticDataset:
    """Eight synthetic RSNA-layout scans (6-9 slices, 32x32) of six patients, with duplicate label rows."""
    root = tmp_path_factory.mktemp("rsna_synth")
    return write_rsna_dataset(root, n_scans=8, slices=(6, 9), size=32, n_patients=6, seed=1, duplicate_rows=4)


@pytest.fixture(scope="session")
def rsna_cache(rsna_synth: SyntheticDataset, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A uint8 cache (3 windows, 24x24) of :func:`rsna_synth` -- read-only for tests."""
    cache_dir = tmp_path_factory.mktemp("rsna_cache")
    index = index_rsna(rsna_synth.image_dir, rsna_synth.labels_csv)
    build_cache(index, cache_dir, CacheParams(size=24), workers=0, progress=False)
    return str(cache_dir)


@pytest.fixture
def rsna_copy(rsna_synth: SyntheticDataset, tmp_path: Path) -> SyntheticDataset:
    """A private, modifiable copy of :func:`rsna_synth` (same ground truth, paths rebased)."""
    root = tmp_path / "rsna"
    shutil.copytree(rsna_synth.root, root)

    def rebase(p: str) -> str:
        return str(root / os.path.relpath(p, rsna_synth.root))

    scans = [
        type(s)(s.bag_id, s.patient_id, s.study_uid, s.series_uid, tuple(rebase(p) for p in s.paths), s.z_mm, s.slice_labels, s.bag_label)
        for s in rsna_synth.scans
    ]
    return SyntheticDataset("rsna", str(root), rebase(rsna_synth.image_dir), rebase(rsna_synth.labels_csv), scans)


@pytest.fixture
def write_series(tmp_path: Path) -> Callable[..., list[str]]:
    """Write a small phantom-free series (ramp images) into ``tmp_path/<name>``; returns paths in z order."""

    def write(name: str = "series", num_slices: int = 4, size: int = 16, series_uid: str = "1.2.3.4.5", **kwargs) -> list[str]:
        hu = np.broadcast_to(np.arange(num_slices, dtype=np.float32)[:, None, None] * 10.0, (num_slices, size, size)).copy()
        return write_ct_series(
            tmp_path / name, hu, [f"f{k:02d}.dcm" for k in np.random.default_rng(0).permutation(num_slices)],
            rng=np.random.default_rng(1), patient_id="P1", study_uid="1.2.3.4", series_uid=series_uid, **kwargs,
        )

    return write

