"""Data module over a feature file (:mod:`lightning_modules.features`) for the two-stage GP."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from lightning_modules.data.bag_array_datamodule import BagArrayDataModule
from lightning_modules.features import load_features
from lightning_modules.input_error import InputError

__all__ = ["FeatureDataModule"]


class FeatureDataModule(BagArrayDataModule):
    """Bags of extracted features, split as recorded in the file (``splits`` column) or, when the
    file has none, patient-grouped with ``fractions``.

    The file is read in :meth:`setup` and checked there as :class:`BagArrayDataModule` checks its
    bags, each error naming the file; a missing file is reported when the data module is made.

    Args:
        path: ``.npz`` or ``.csv`` feature file.
        batch_size: training bags per batch; ``None`` (default) = all training bags in one batch,
            i.e. full-batch closed-form natural updates (CAVI).
        test_split: ``"all"`` tests every bag of the file (an external set without split names,
            which would otherwise be split and only its test part scored).
        other arguments: as :class:`BagArrayDataModule`.
    """

    def __init__(
        self,
        path: str,
        fractions: tuple[float, float, float] = (0.6, 0.2, 0.2),
        split_seed: int = 0,
        batch_size: int | None = None,
        eval_batch_size: int | None = None,
        shuffle: bool = False,
        predict_split: str = "test",
        num_workers: int = 0,
        seed: int = 0,
        test_split: str = "test",
    ):
        if not Path(path).is_file():
            raise InputError(f"{path}: no such feature file")
        super().__init__(
            bags=[], bag_labels=[], fractions=fractions, split_seed=split_seed, batch_size=batch_size,
            eval_batch_size=eval_batch_size, shuffle=shuffle, predict_split=predict_split, num_workers=num_workers, seed=seed,
            test_split=test_split,
        )
        self.path = str(path)
        self.source = self.path
        self._slice_index: dict[str, np.ndarray] = {}

    def setup(self, stage: str) -> None:
        """Read the file (once) and check it (class docstring)."""
        if not self.bags:
            try:
                table = load_features(self.path)
            except (KeyError, ValueError) as err:  # load_features' own messages name the file already
                raise InputError(str(err) if str(err).startswith(self.path) else f"{self.path}: not a readable feature file ({err})") from err
            rows = table.bag_rows()
            self._assign([table.features[r] for r in rows], table.bag_labels.tolist(), [table.instance_labels[r] for r in rows],
                         table.bag_ids, table.patient_ids, table.splits)
            self._slice_index = {b: table.slice_index[r] for b, r in zip(table.bag_ids, rows)}
        super().setup(stage)

    def slice_positions(self, bag_id: str) -> tuple[np.ndarray, str] | None:
        """The ``slice_index`` of a bag's rows (scan order), for reports."""
        found = self._slice_index.get(bag_id)
        return None if found is None else (found, "slice index (feature file)")

    def describe(self, subcommand: str) -> dict[str, Any]:
        return {**super().describe(subcommand), "path": self.path}
