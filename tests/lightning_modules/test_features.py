"""The feature-file format round-trips in both encodings."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lightning_modules.features import FeatureTable, load_features, save_features


@pytest.mark.parametrize("suffix", [".npz", ".csv"])
def test_feature_file_round_trip(tmp_path: Path, suffix: str) -> None:
    """Features, bag structure, labels (unknown = NaN), patients and splits survive save/load.

    If this fails, the two-stage GP would train on features attached to the wrong bags/labels."""
    rng = np.random.default_rng(0)
    bags = [rng.standard_normal((n, 3)).astype(np.float32) for n in (1, 4, 2)]
    table = FeatureTable.from_bags(bags, ["a", "b/c", "d"], [0.0, 1.0, 1.0], [np.zeros(1), None, np.array([0, 1])],
                                   ["p1", "p2", ""], ["train", "test", "val"])
    save_features(tmp_path / f"f{suffix}", table)
    back = load_features(tmp_path / f"f{suffix}")
    assert back.bag_ids == table.bag_ids and back.splits == table.splits and back.patient_ids == table.patient_ids
    np.testing.assert_allclose(back.bag_labels, table.bag_labels)
    for r1, r2 in zip(back.bag_rows(), table.bag_rows()):
        np.testing.assert_allclose(back.features[r1], table.features[r2], rtol=1e-6)
        np.testing.assert_array_equal(np.isnan(back.instance_labels[r1]), np.isnan(table.instance_labels[r2]))
