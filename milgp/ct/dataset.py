"""Torch dataset of CT bags read from a preprocessed cache (:mod:`milgp.ct.cache`).

Each item is ``(slices (S, C, H, W) float32 in [0, 1], slice_labels (S,) float32 or None,
bag_label float, bag_id str)``, the tuple :func:`milgp.data.bags.collate_bags` batches into a
flat :class:`~milgp.data.bags.BagBatch`.
"""
from __future__ import annotations

import numbers
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from milgp.ct.augment import BagAugment
from milgp.ct.cache import CacheCorruptError, CTCache, read_manifest, repair_hint
from milgp.ct.index import read_splits
from milgp.ct.report_entry import printable

__all__ = ["CTBagDataset", "SplitNotCachedError", "uniform_subsample"]


def uniform_subsample(num_slices: int, max_slices: int | None) -> np.ndarray:
    """Indices of at most ``max_slices`` evenly spaced slices out of ``num_slices``, in order.

    The first and last slices are always kept; with ``max_slices`` ``None`` or ``>= num_slices``
    all slices are kept.

    Returns:
        ``(min(num_slices, max_slices),)`` strictly increasing int64 indices.
    """
    if max_slices is None or max_slices >= num_slices:
        return np.arange(num_slices, dtype=np.int64)
    if max_slices < 1:
        raise ValueError(f"max_slices must be at least 1, got {max_slices}")
    if max_slices == 1:
        return np.array([num_slices // 2], dtype=np.int64)
    # floor(x + 0.5) (not banker's rounding) keeps indices distinct when the spacing is >= 1
    return np.floor(np.linspace(0, num_slices - 1, max_slices) + 0.5).astype(np.int64)


class SplitNotCachedError(CacheCorruptError, KeyError):
    """``splits.json`` lists bags of a split that the cache's manifest lacks (a ``KeyError`` too, as
    the error was before); its message is one line, not a quoted ``KeyError`` text."""

    __str__ = BaseException.__str__


class CTBagDataset(torch.utils.data.Dataset):
    """Bags of a CT cache as tensors.

    Args:
        cache_dir: a cache built by :func:`milgp.ct.cache.build_cache` / ``milgp-cache``.
        bag_ids: the bags to serve, in this order (e.g. one split); default all cached bags.
        max_slices: keep at most this many evenly spaced slices per bag (order kept).
        augment: a :class:`BagAugment` for training; ``None`` (default) serves the cache as is.
        seed: augmentation seed; a bag's transform depends on ``(seed, epoch, bag position)``.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        bag_ids: Sequence[str] | None = None,
        max_slices: int | None = None,
        augment: BagAugment | None = None,
        seed: int = 0,
    ):
        self.cache = CTCache(cache_dir)
        self.bag_ids: list[str] = list(self.cache.bag_ids if bag_ids is None else bag_ids)
        for b in self.bag_ids:
            self.cache.entry(b)  # KeyError naming the bag and the cache
        if max_slices is not None and max_slices < 1:
            raise ValueError(f"max_slices must be at least 1, got {max_slices}")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        self.max_slices = max_slices
        self.augment = augment
        self.seed = int(seed)
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    @classmethod
    def from_split(cls, cache_dir: str | os.PathLike[str], split: str, **kwargs) -> "CTBagDataset":
        """The bags of one split from ``cache_dir/splits.json`` (written by ``milgp-cache --splits``).

        Raises:
            KeyError: naming the file when it has no such split.
            SplitNotCachedError: one line naming the split, the count and a bag, when the split
                lists bags the manifest lacks.
        """
        path = os.path.join(cache_dir, "splits.json")
        splits = read_splits(path)
        if split not in splits:
            raise KeyError(f"{printable(path)} has no split {split!r} (it has {sorted(splits)})")
        cached = {e.bag_id for e in read_manifest(cache_dir)}
        missing = [b for b in splits[split] if b not in cached]
        if missing:
            raise SplitNotCachedError(
                f"{printable(path)}: split {split!r} lists {len(missing)} of its {len(splits[split])} bags that "
                f"{printable(os.path.join(cache_dir, 'manifest.json'))} lacks (e.g. {printable(missing[0])!r}; an interrupted "
                f"or failed run cut the manifest): rerun the milgp-cache command to finish the build, or "
                f"{repair_hint(Path(cache_dir))} (which also takes them out of splits.json)"
            )
        return cls(cache_dir, bag_ids=splits[split], **kwargs)

    def __len__(self) -> int:
        return len(self.bag_ids)

    @property
    def epoch(self) -> int:
        """The epoch that seeds augmentation draws (see :meth:`set_epoch`)."""
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """Change the augmentation draw (call once per epoch for fresh, reproducible transforms).

        The value lives in shared memory, so DataLoader workers (also ``persistent_workers``)
        see it from their next item on.
        """
        self._epoch.fill_(int(epoch))

    @property
    def bag_labels(self) -> np.ndarray:
        """``(B,)`` float64 bag labels in dataset order."""
        return np.array([self.cache.entry(b).bag_label for b in self.bag_ids], dtype=np.float64)

    def slice_indices(self, i: int) -> np.ndarray:
        """Indices (into the cached bag) of the slices item ``i`` serves."""
        return uniform_subsample(self.cache.entry(self.bag_ids[i]).num_slices, self.max_slices)

    def slice_labels(self, i: int) -> np.ndarray | None:
        """``(S,)`` int64 labels of the slices item ``i`` serves, or ``None`` when unknown."""
        labels = self.cache.entry(self.bag_ids[i]).slice_labels
        return None if labels is None else np.asarray(labels, dtype=np.int64)[self.slice_indices(i)]

    def instance_labels(self) -> tuple[np.ndarray, np.ndarray] | None:
        """All served slice labels for instance metrics: ``(labels (N,), bag_index (N,))``.

        The order matches concatenating the items in dataset order. ``None`` when any bag lacks
        slice labels.
        """
        per_bag = [self.slice_labels(i) for i in range(len(self))]
        if any(lab is None for lab in per_bag):
            return None
        sizes = [len(lab) for lab in per_bag]
        return np.concatenate(per_bag), np.repeat(np.arange(len(per_bag)), sizes)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor | None, float, str]:
        """Item ``i``; a damaged cache file (truncated, another shape or dtype, non-finite values) raises
        :class:`milgp.ct.cache.CacheCorruptError` naming the bag and the file."""
        if not 0 <= i < len(self):
            raise IndexError(f"bag index {i} out of range for {len(self)} bags")
        bag_id = self.bag_ids[i]
        entry = self.cache.entry(bag_id)
        stored = np.asarray(self.cache.load(bag_id)[self.slice_indices(i)])
        # float16 caches only: uint8 values are always finite (the test cost most of a uint8 bag's read)
        if np.issubdtype(stored.dtype, np.floating) and not np.isfinite(stored).all():
            raise CacheCorruptError(
                f"cached bag {bag_id!r}: {printable(self.cache.path(bag_id))} holds non-finite values; {repair_hint(self.cache.root)}"
            )
        x = torch.from_numpy(self.cache.params.decode(stored))
        if self.augment is not None:
            state = np.random.SeedSequence([self.seed, self.epoch, i]).generate_state(1, dtype=np.uint64)[0]
            generator = torch.Generator().manual_seed(int(state) & 0x7FFF_FFFF_FFFF_FFFF)
            x = self.augment(x, generator)
        labels = self.slice_labels(i)
        label_t = None if labels is None else torch.from_numpy(labels.astype(np.float32))
        return x, label_t, float(entry.bag_label), bag_id
