"""Data module over a feature file (:mod:`lightning_modules.features`) for the two-stage GP."""
from __future__ import annotations

from lightning_modules.data.bag_array_datamodule import BagArrayDataModule
from lightning_modules.features import load_features

__all__ = ["FeatureDataModule"]


class FeatureDataModule(BagArrayDataModule):
    """Bags of extracted features, split as recorded in the file (``splits`` column) or, when the
    file has none, patient-grouped with ``fractions``.

    Args:
        path: ``.npz`` or ``.csv`` feature file.
        batch_size: training bags per batch; ``None`` (default) = all training bags in one batch,
            i.e. full-batch closed-form natural updates (CAVI).
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
    ):
        table = load_features(path)
        rows = table.bag_rows()
        super().__init__(
            bags=[table.features[r] for r in rows],
            bag_labels=table.bag_labels.tolist(),
            instance_labels=[table.instance_labels[r] for r in rows],
            bag_ids=table.bag_ids,
            patient_ids=table.patient_ids,
            splits=table.splits,
            fractions=fractions, split_seed=split_seed, batch_size=batch_size, eval_batch_size=eval_batch_size,
            shuffle=shuffle, predict_split=predict_split, num_workers=num_workers, seed=seed,
        )
        self.path = path
        self.feature_dim = table.feature_dim
