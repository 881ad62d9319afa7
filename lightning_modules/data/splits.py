"""Patient-grouped splits for the data modules, by the data path's :func:`split_by_patient`."""
from __future__ import annotations

import math
from typing import Sequence

from milgp.ct.index import BagIndex, BagRecord, split_by_patient

__all__ = ["SPLIT_NAMES", "patient_split"]

SPLIT_NAMES = ("train", "val", "test")
UNLABELLED = -1.0
"""The stratum of unlabelled bags when splitting (bag labels are 0/1 or non-negative targets)."""


def patient_split(
    bag_ids: Sequence[str],
    patient_ids: Sequence[str],
    bag_labels: Sequence[float],
    fractions: Sequence[float] = (0.7, 0.15, 0.15),
    seed: int = 0,
) -> dict[str, str]:
    """``{bag_id: "train" | "val" | "test"}``: patient-grouped, label-stratified
    (:func:`milgp.ct.index.split_by_patient`; a bag without a patient id is its own patient,
    unlabelled bags — label NaN, e.g. new scans to predict — form a stratum of their own)."""
    records = [
        BagRecord(bag_id=str(b), patient_id=str(p) or f"bag:{b}", bag_label=float(y) if math.isfinite(float(y)) else UNLABELLED, slice_paths=(str(b),))
        for b, p, y in zip(bag_ids, patient_ids, bag_labels)
    ]
    parts = split_by_patient(BagIndex(records), tuple(fractions), seed=seed, names=SPLIT_NAMES)
    return {b: name for name, idx in parts.items() for b in idx.bag_ids}
