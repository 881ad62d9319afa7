"""Data module over bags held in memory (NumPy arrays of features or images)."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from lightning_modules.data.checks import (
    check_bag_ids, check_bag_labels, check_features, check_instance_labels, check_split_names, label_kind,
)
from lightning_modules.data.in_memory_dataset import InMemoryBagDataset
from lightning_modules.data.sampler import EpochSampler
from lightning_modules.data.splits import SPLIT_NAMES, SplitDataModule, patient_split
from lightning_modules.input_error import InputError
from lightning_modules.setting_checks import check_at_least
from milgp.data.bags import collate_bags

__all__ = ["BagArrayDataModule"]


class BagArrayDataModule(SplitDataModule):
    """Bags in memory, split by patient into train/val/test (or by given split names).

    Args:
        bags: per-bag ``(n_b, ...)`` arrays.
        bag_labels: ``(B,)``.
        instance_labels: per-bag ``(n_b,)`` labels or ``None``.
        bag_ids, patient_ids: identifiers (default: ``bag_<i>``, one patient per bag).
        splits: per-bag split names; default a patient-grouped stratified split with ``fractions``.
        fractions, split_seed: the split when ``splits`` is not given.
        batch_size: bags per training batch (``None``: all training bags in one batch — full-batch
            natural updates for the GP).
        eval_batch_size: bags per validation/test/predict batch (``None``: all).
        shuffle: shuffle training bags each epoch (an order fixed by ``(seed, epoch)``, see
            :class:`~lightning_modules.data.sampler.EpochSampler`, so resuming from a checkpoint is exact).
        seed: shuffle seed.
        test_split: the split ``test`` serves (``"all"``: every bag, e.g. an external set that has
            no split names and would otherwise be split like a development set).
        predict_split: ``"train"``, ``"val"``, ``"test"`` or ``"all"``.
        num_workers: DataLoader workers.

    :meth:`setup` checks the bags first (docs/lightning.md, "Bad input"), each error naming the bag.
    """

    def __init__(
        self,
        bags: Sequence[Any],
        bag_labels: Sequence[float],
        instance_labels: Sequence[Any] | None = None,
        bag_ids: Sequence[str] | None = None,
        patient_ids: Sequence[str] | None = None,
        splits: Sequence[str] | None = None,
        fractions: tuple[float, float, float] = (0.6, 0.2, 0.2),
        split_seed: int = 0,
        batch_size: int | None = None,
        eval_batch_size: int | None = None,
        shuffle: bool = False,
        predict_split: str = "all",
        num_workers: int = 0,
        seed: int = 0,
        test_split: str = "test",
    ):
        super().__init__()
        for name, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
            check_at_least(name, value, 1, " (or None: all bags in one batch)")
        check_at_least("num_workers", num_workers, 0)
        self.fractions, self.split_seed = tuple(fractions), split_seed
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.shuffle, self.predict_split, self.num_workers, self.seed = shuffle, predict_split, num_workers, seed
        self.test_split = test_split
        self.source = "in-memory bags"
        self._checked_stages: set[str] = set()
        self._assign(bags, bag_labels, instance_labels, bag_ids, patient_ids, splits)

    def _assign(
        self,
        bags: Sequence[Any],
        bag_labels: Sequence[float],
        instance_labels: Sequence[Any] | None,
        bag_ids: Sequence[str] | None,
        patient_ids: Sequence[str] | None,
        splits: Sequence[str] | None,
    ) -> None:
        """Hold the bags and their split (given, or patient-grouped with ``fractions``)."""
        B = len(bags)
        self.bags = list(bags)
        self.labels = [float(y) for y in bag_labels]
        self.instance_labels = None if instance_labels is None else list(instance_labels)
        self.bag_ids = [str(b) for b in bag_ids] if bag_ids is not None else [f"bag_{i}" for i in range(B)]
        self.patient_ids = [str(p) for p in patient_ids] if patient_ids is not None else [""] * B
        if B and (splits is None or all(s == "" for s in splits)):
            by_id = patient_split(self.bag_ids, self.patient_ids, self.labels, self.fractions, self.split_seed)
            self.split_names = [by_id[b] for b in self.bag_ids]
        else:
            self.split_names = [str(s) for s in (splits or [])]
            check_split_names(self.source, self.bag_ids, self.split_names)
        self._split_by_id = dict(zip(self.bag_ids, self.split_names))
        self._patient_by_id = dict(zip(self.bag_ids, self.patient_ids))

    def setup(self, stage: str) -> None:
        """Check the bags (class docstring) before any work: features and any given labels once,
        and the labels each stage needs (train/val for fit, val, test) once per stage."""
        if stage in self._checked_stages:
            return
        kind = label_kind(self.trainer)
        if not self._checked_stages:
            check_bag_ids(self.source, self.bag_ids)
            check_features(self.source, self.bag_ids, self.bags)
            check_bag_labels(self.source, self.bag_ids, self.labels, kind, required=False)
            if kind == "binary" and self.instance_labels is not None:
                check_instance_labels(self.source, self.bag_ids, self.instance_labels)
        if stage != "predict":
            names = self.stage_splits(stage)
            keep = [i for i, s in enumerate(self.split_names) if s in names or "all" in names]
            ids, labels = [self.bag_ids[i] for i in keep], [self.labels[i] for i in keep]
            check_bag_labels(self.source, ids, labels, kind)
            model_check = getattr(getattr(self.trainer, "lightning_module", None), "check_bag_data", None)
            if model_check is not None:  # what the model's likelihood needs (aggregate counts, populations)
                model_check(self.source, ids, [self.bags[i] for i in keep], labels)
        self._checked_stages.add(stage)

    def describe(self, subcommand: str) -> dict[str, Any]:
        """The data a run used, for its reports."""
        split = next(iter(self.stage_splits(subcommand)), subcommand)
        count = len(self.bag_ids) if split == "all" else sum(s == split for s in self.split_names)
        return {"class": type(self).__qualname__, "source": self.source, "split": split, "bags": count}

    def patient_of(self, bag_id: str) -> str:
        """The patient of a bag (``""`` when unknown); a dict lookup."""
        return self._patient_by_id.get(bag_id, "")

    def dataset(self, split: str) -> InMemoryBagDataset:
        """The bags of ``split`` (``"all"``: every bag, in the order train, val, test)."""
        if split == "all":
            keep = [i for name in SPLIT_NAMES for i, s in enumerate(self.split_names) if s == name]
            keep += [i for i, s in enumerate(self.split_names) if s not in SPLIT_NAMES]
        else:
            keep = [i for i, s in enumerate(self.split_names) if s == split]
        if not keep:
            raise InputError(f"{self.source}: split {split!r} has no bags (splits present: {sorted(set(self.split_names))})")
        return InMemoryBagDataset(
            [self.bags[i] for i in keep], [self.labels[i] for i in keep],
            None if self.instance_labels is None else [self.instance_labels[i] for i in keep],
            [self.bag_ids[i] for i in keep],
        )

    def _loader(self, split: str, batch_size: int | None, train: bool = False) -> torch.utils.data.DataLoader:
        """Loader of ``split``; the training one samples with an :class:`EpochSampler` (Lightning
        shards evaluation loaders itself under DDP)."""
        ds = self.dataset(split)
        sampler = EpochSampler.for_trainer(ds, self.trainer, self.shuffle, self.seed) if train else None
        return torch.utils.data.DataLoader(
            ds, batch_size=len(ds) if batch_size is None else batch_size, sampler=sampler,
            collate_fn=collate_bags, num_workers=self.num_workers,
        )
