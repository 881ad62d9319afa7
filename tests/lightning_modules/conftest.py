"""The session's tiny synthetic CT cache (helpers for in-memory data and configs: ``lm_helpers``)."""
from __future__ import annotations

import warnings
import pytest

warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*LeafSpec.*")


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 12-scan synthetic RSNA-layout CT dataset (32×32, 3–6 slices), cached with a
    patient-grouped 50/25/25 split, through the data path's real writer and ``milgp-cache``."""
    from milgp.ct import cache_cli
    from milgp.ct.synthetic import write_rsna_dataset

    root = tmp_path_factory.mktemp("ct")
    ds = write_rsna_dataset(root / "data", n_scans=12, slices=(3, 6), size=32, seed=3, n_patients=10, lesion_radius=(0.2, 0.3))
    rc = cache_cli.main(["rsna", "--images", ds.image_dir, "--labels", ds.labels_csv, "--out", str(root / "cache"),
                         "--size", "32", "--splits", "0.5,0.25,0.25", "--no-progress"])
    assert rc == 0
    return str(root / "cache")


