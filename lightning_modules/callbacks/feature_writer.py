"""Write per-slice features from a ``predict`` run to a feature file (:mod:`lightning_modules.features`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pytorch_lightning as pl
from pytorch_lightning.callbacks import BasePredictionWriter

from lightning_modules.bag_module_base import BagModuleBase
from lightning_modules.callbacks.prediction_writer import flatten_records
from lightning_modules.callbacks.run_metadata import output_folder
from lightning_modules.features import FeatureTable, save_features
from lightning_modules.input_error import InputError

__all__ = ["FeatureWriter"]

_SPLIT_ORDER = {"train": 0, "val": 1, "test": 2}


class FeatureWriter(BasePredictionWriter):
    """At the end of ``predict``, write every predicted bag's slice features to a feature file.

    The model's ``predict_step`` must return per-bag records with a ``"features"`` entry
    (:class:`AttentionMILModule`, or :class:`GPMILModule` with an extractor). Bag splits and
    patient ids come from the data module's ``split_of``/``patient_of`` (dict lookups in the
    project's data modules) when it has them, so the GP can be trained on ``train`` and evaluated
    on ``val``/``test`` of the same file. Under DDP the ranks' bags are gathered and rank 0 writes.

    Args:
        output_path: ``.npz`` (default format) or ``.csv``; a relative path lies in the run's version
            folder (default ``<run>/predict/version_<n>/features.npz``); the file it names must not
            exist yet (a feature file is never overwritten): an absolute path is checked here, a
            relative one (``../../f.npz`` leaves the version folder) at :meth:`setup`, before predicting.
    """

    def __init__(self, output_path: str = "features.npz"):
        super().__init__(write_interval="epoch")
        if Path(output_path).suffix not in (".npz", ".csv"):
            raise InputError(f"FeatureWriter output_path {output_path}: feature files end in .npz or .csv")
        if Path(output_path).is_absolute() and Path(output_path).exists():
            raise InputError(f"FeatureWriter output_path {output_path} exists: feature files are never overwritten, choose another path")
        self.output_path = output_path
        self.written: str | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "predict" and self._target(trainer).exists():
            raise InputError(f"FeatureWriter output_path {self.output_path} ({self._target(trainer)}) exists: "
                             "feature files are never overwritten, choose another path")

    def _target(self, trainer: pl.Trainer) -> Path:
        """The file written: ``output_path`` in the run's version folder (an absolute path as it is)."""
        return (output_folder(trainer) / self.output_path).resolve()

    def write_on_epoch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, predictions: Sequence[Any], batch_indices: Sequence[Any]
    ) -> None:
        records = {r["bag_id"]: r for r in BagModuleBase.gather_records(flatten_records(predictions))}
        missing = [b for b, r in records.items() if "features" not in r]
        if missing:
            raise ValueError(f"{type(pl_module).__name__}.predict_step returned records without 'features' (bag {missing[0]!r})")
        if trainer.global_rank != 0:
            return
        dm = trainer.datamodule
        split_of = getattr(dm, "split_of", lambda b: "")
        patient_of = getattr(dm, "patient_of", lambda b: "")
        split = {b: split_of(b) for b in records}  # one (dict) lookup per bag
        ids = sorted(records, key=lambda b: (_SPLIT_ORDER.get(split[b], 3), b))
        table = FeatureTable.from_bags(
            [np.asarray(records[b]["features"], np.float32) for b in ids],
            ids,
            [records[b]["bag_label"] for b in ids],
            [records[b]["slice_labels"] for b in ids],
            [patient_of(b) for b in ids],
            [split[b] for b in ids],
        )
        path = save_features(self._target(trainer), table)
        self.written = path
        print(f"wrote features of {table.num_bags} bags ({len(table.features)} slices, D={table.feature_dim}) to {path}")
