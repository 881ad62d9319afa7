"""Data module over a preprocessed CT cache (:mod:`milgp.ct.cache`, built by ``milgp-cache``)."""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_modules.data.checks import check_bag_labels, check_split_names, label_kind
from lightning_modules.data.sampler import EpochSampler
from lightning_modules.data.splits import SPLIT_NAMES, SplitDataModule, patient_split
from lightning_modules.input_error import InputError
from lightning_modules.setting_checks import check_at_least
from milgp.ct.augment import BagAugment
from milgp.data.bags import collate_bags
from milgp.ct.cache import CTCache
from milgp.ct.dataset import CTBagDataset, uniform_subsample
from milgp.ct.index import read_splits

__all__ = ["CTCacheDataModule"]


class CTCacheDataModule(SplitDataModule):
    """CT bags ``(S, 3, H, W)`` from a cache, split by patient.

    Splits come from ``splits_file`` (default ``<cache_dir>/splits.json`` when present, as written
    by ``milgp-cache --splits``) or are made here with the data path's patient-grouped, stratified
    :func:`milgp.ct.index.split_by_patient` (``fractions``, ``split_seed``). An external test
    set (CQ500) is served whole with ``test_split: all``.

    Args:
        cache_dir: the cache folder.
        splits_file: JSON ``{"train": [bag ids], "val": [...], "test": [...]}``.
        fractions, split_seed: split made here when there is no splits file.
        batch_size: bags per training batch; eval_batch_size: bags per evaluation batch.
        max_slices: keep at most this many evenly spaced slices per bag (memory bound).
        augment: a :class:`milgp.ct.augment.BagAugment` for training bags (``None``: off).
        train_split, val_split, test_split, predict_split: split names (``"all"``: every bag).
        num_workers: DataLoader workers. seed: seed of the training order and the augmentation
            (both a function of ``(seed, epoch)``, see :class:`~lightning_modules.data.sampler.EpochSampler`).
        pin_memory: batches in page-locked memory, so that their copy to the GPU overlaps the
            computation (``None``: when a CUDA device is present).

    A folder that is not a cache is reported when the data module is made; :meth:`setup` checks the
    bag labels, naming the bag and the cache's ``manifest.json``, and the splits file (:attr:`splits`;
    docs/lightning.md, "Bad input").
    """

    def __init__(
        self,
        cache_dir: str,
        splits_file: str | None = None,
        fractions: tuple[float, float, float] = (0.7, 0.15, 0.15),
        split_seed: int = 0,
        batch_size: int = 4,
        eval_batch_size: int = 8,
        max_slices: int | None = None,
        augment: BagAugment | None = None,
        train_split: str = "train",
        val_split: str = "val",
        test_split: str = "test",
        predict_split: str = "all",
        num_workers: int = 0,
        seed: int = 0,
        pin_memory: bool | None = None,
    ):
        super().__init__()
        if not (Path(cache_dir) / "params.json").is_file():
            raise InputError(f"{cache_dir}: not a milgp CT cache (no params.json); build it with milgp-cache")
        check_at_least("batch_size", batch_size, 1)
        check_at_least("eval_batch_size", eval_batch_size, 1)
        check_at_least("max_slices", max_slices, 1, " (or None: every slice)")
        check_at_least("num_workers", num_workers, 0)
        self.cache_dir = self.source = str(cache_dir)
        self.splits_file = splits_file
        self.fractions, self.split_seed = tuple(fractions), split_seed
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.max_slices, self.augment = max_slices, augment
        self.train_split, self.val_split, self.test_split, self.predict_split = train_split, val_split, test_split, predict_split
        self.num_workers, self.seed = num_workers, seed
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._train: CTBagDataset | None = None

    @functools.cached_property
    def _cache(self) -> CTCache:
        """The cache's manifest and parameters, read once."""
        return CTCache(self.cache_dir)

    @functools.cached_property
    def splits(self) -> dict[str, list[str]]:
        """``{split name: bag ids}`` and ``"all"``: every cached bag (computed and checked once).

        A splits file is checked: a bag listed twice (in one split, or in two, which would test on a
        training bag) and a misspelt train/val/test are refused, and cached bags that it leaves in
        no split are announced (a warning: e.g. a cache grown after ``milgp-cache --splits``)."""
        cache = self._cache
        path = self.splits_file or os.path.join(self.cache_dir, "splits.json")
        if os.path.isfile(path):
            splits = read_splits(path)
            split_of: dict[str, str] = {}
            for name, ids in splits.items():
                for b in ids:
                    if b in split_of:
                        raise InputError(f"{path}: bag {b!r} is listed in split {split_of[b]!r} and again in {name!r}; "
                                         "each bag belongs to one split")
                    split_of[b] = name
            unlisted = [b for b in cache.bag_ids if b not in split_of]
            check_split_names(path, [*split_of, *unlisted], [*split_of.values(), *[""] * len(unlisted)])
        elif self.splits_file:
            raise FileNotFoundError(f"splits file {self.splits_file} does not exist")
        else:
            entries = cache.entries
            by_id = patient_split(
                [e.bag_id for e in entries], [e.patient_id for e in entries], [e.bag_label for e in entries],
                self.fractions, self.split_seed,
            )
            splits = {name: [e.bag_id for e in entries if by_id[e.bag_id] == name] for name in SPLIT_NAMES}
        splits["all"] = cache.bag_ids
        return splits

    def setup(self, stage: str) -> None:
        """Check the bag labels (class docstring)."""
        source, kind = os.path.join(self.cache_dir, "manifest.json"), label_kind(self.trainer)
        entries = self._cache.entries
        check_bag_labels(source, [e.bag_id for e in entries], [e.bag_label for e in entries], kind, required=False)
        names = self.stage_splits(stage) if stage != "predict" else ()
        ids = [b for name in names for b in self.splits.get(name, [])]
        check_bag_labels(source, ids, [self._cache.entry(b).bag_label for b in ids], kind)

    @property
    def preprocessing(self) -> dict[str, Any]:
        """The CT windows, slice size and storage dtype of the cache (what a model trained on it expects)."""
        params = self._cache.params.to_json_dict()
        return {"windows": params["windows"], "size": params["size"], "dtype": params["dtype"]}

    def slice_positions(self, bag_id: str) -> tuple[np.ndarray, str] | None:
        """Indices (in the cached scan) of the slices a bag is served with (``max_slices`` may thin them)."""
        entry = self._cache.entry(bag_id)
        return uniform_subsample(entry.num_slices, self.max_slices).astype(float), "slice index (cached scan)"

    def describe(self, subcommand: str) -> dict[str, Any]:
        """The data a run used, for its reports."""
        split = next(iter(self.stage_splits(subcommand)), None)
        return {"class": type(self).__qualname__, "cache_dir": self.cache_dir, "split": split,
                "bags": len(self.splits.get(split, [])) if split else None, "max_slices": self.max_slices}

    @functools.cached_property
    def _split_by_id(self) -> dict[str, str]:
        """``{bag_id: split name}`` over the train/val/test splits (built once; the first of train,
        val, test that lists a bag wins, hence the reversed order)."""
        return {b: name for name in reversed(SPLIT_NAMES) for b in self.splits.get(name, [])}

    @functools.cached_property
    def _patient_by_id(self) -> dict[str, str]:
        """``{bag_id: patient id}`` of the cached bags (the manifest read once)."""
        return {e.bag_id: e.patient_id for e in self._cache.entries}

    def patient_of(self, bag_id: str) -> str:
        """The patient of a cached bag (``KeyError`` for a bag not in the cache); a dict lookup."""
        try:
            return self._patient_by_id[bag_id]
        except KeyError:
            raise KeyError(f"bag {bag_id!r} is not in the cache {self.cache_dir}") from None

    def dataset(self, split: str, train: bool = False) -> CTBagDataset:
        ids = self.splits.get(split)
        if not ids:
            raise InputError(f"{self.cache_dir}: split {split!r} has no bags (splits: { {k: len(v) for k, v in self.splits.items()} })")
        return CTBagDataset(self.cache_dir, bag_ids=ids, max_slices=self.max_slices,
                            augment=self.augment if train else None, seed=self.seed)

    def _loader(self, split: str, batch_size: int, train: bool = False) -> torch.utils.data.DataLoader:
        """Loader of ``split``; the training one (its dataset made once) shuffles with an
        :class:`EpochSampler`, which gives the dataset every epoch's augmentation draw."""
        if train and self._train is None:
            self._train = self.dataset(split, train=True)
        ds = self._train if train else self.dataset(split)
        sampler = EpochSampler.for_trainer(ds, self.trainer, shuffle=True, seed=self.seed) if train else None
        return torch.utils.data.DataLoader(
            ds, batch_size=batch_size, sampler=sampler, collate_fn=collate_bags, num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0, pin_memory=self.pin_memory,
        )
