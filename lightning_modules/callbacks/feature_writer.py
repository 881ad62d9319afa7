"""Write per-slice features from a ``predict`` run to a feature file (:mod:`lightning_modules.features`)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pytorch_lightning as pl
from pytorch_lightning.callbacks import BasePredictionWriter

from lightning_modules.distributed import all_gather_objects
from lightning_modules.features import FeatureTable, save_features

__all__ = ["FeatureWriter"]

_SPLIT_ORDER = {"train": 0, "val": 1, "test": 2}


class FeatureWriter(BasePredictionWriter):
    """At the end of ``predict``, write every predicted bag's slice features to ``output_path``.

    The model's ``predict_step`` must return per-bag records with a ``"features"`` entry
    (:class:`AttentionMILModule`, or :class:`GPMILModule` with an extractor). Bag splits and
    patient ids come from the data module's ``split_of``/``patient_of`` (dict lookups in the
    project's data modules) when it has them, so the GP can be trained on ``train`` and evaluated
    on ``val``/``test`` of the same file. Under DDP the ranks' bags are gathered and rank 0 writes.

    Args:
        output_path: ``.npz`` (default format) or ``.csv``.
    """

    def __init__(self, output_path: str = "features.npz"):
        super().__init__(write_interval="epoch")
        self.output_path = output_path

    def write_on_epoch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, predictions: Sequence[Any], batch_indices: Sequence[Any]
    ) -> None:
        def flat(obj: Any) -> list[dict]:
            if isinstance(obj, dict):
                return [obj]
            return [r for item in obj for r in flat(item)]

        records: dict[str, dict] = {}
        for part in all_gather_objects(flat(predictions)):
            for r in part:
                if "features" not in r:
                    raise ValueError(f"{type(pl_module).__name__}.predict_step returned records without 'features'")
                records.setdefault(r["bag_id"], r)
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
        path = save_features(self.output_path, table)
        print(f"wrote features of {table.num_bags} bags ({len(table.features)} slices, D={table.feature_dim}) to {path}")
