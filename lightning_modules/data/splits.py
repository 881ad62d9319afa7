"""Patient-grouped splits for the data modules, by the data path's :func:`split_by_patient`, and
the base of the data modules that serve named splits."""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Sequence

import pytorch_lightning as pl
import torch

from milgp.ct.index import BagIndex, BagRecord, split_by_patient

__all__ = ["SPLIT_NAMES", "SplitDataModule", "patient_split"]

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


class SplitDataModule(pl.LightningDataModule, ABC):
    """Base of the data modules of named splits (not used on its own): the loaders of
    ``train_split``, ``val_split``, ``test_split`` and ``predict_split`` (``batch_size`` for
    training, ``eval_batch_size`` otherwise) from the subclass's :meth:`_loader`, the splits of each stage
    (:meth:`stage_splits`), and :meth:`split_of` from its ``_split_by_id`` mapping."""

    train_split, val_split, test_split = SPLIT_NAMES

    @abstractmethod
    def _loader(self, split: str, batch_size: int | None, train: bool = False) -> torch.utils.data.DataLoader:
        """The loader of the bags of ``split`` (``train``: the shuffled training loader)."""

    def stage_splits(self, stage: str) -> tuple[str, ...]:
        """The splits a trainer stage runs on, the first the stage's own: ``train_split`` and
        ``val_split`` for ``"fit"``, ``val_split`` for ``"validate"``, ``test_split`` for
        ``"test"``, ``predict_split`` for ``"predict"``; ``()`` for any other name."""
        return {
            "fit": (self.train_split, self.val_split),
            "validate": (self.val_split,),
            "test": (self.test_split,),
            "predict": (self.predict_split,),
        }.get(stage, ())

    def split_of(self, bag_id: str) -> str:
        """The split (``"train"``, ``"val"``, ``"test"``) of a bag, ``""`` when in none; a dict lookup."""
        return self._split_by_id.get(bag_id, "")

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(self.train_split, self.batch_size, train=True)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(self.val_split, self.eval_batch_size)

    def test_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(self.test_split, self.eval_batch_size)

    def predict_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(self.predict_split, self.eval_batch_size)
