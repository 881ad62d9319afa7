"""The training sampler of the data modules: order and augmentation seeded by ``(seed, epoch)``."""
from __future__ import annotations

from typing import Sized

import pytorch_lightning as pl
import torch

__all__ = ["EpochSampler"]


class EpochSampler(torch.utils.data.DistributedSampler):
    """Training order of a dataset as a function of ``(seed, epoch)`` only: shuffled by a generator
    seeded with ``seed + epoch`` (never the global RNG), sharded under DDP (a ``DistributedSampler``,
    used as is by Lightning), each epoch handed on to the dataset (docs/lightning.md, "GPU and DDP").

    Args:
        dataset: the (sized) dataset.
        shuffle: permute the order every epoch; otherwise dataset order.
        seed: shuffle seed.
        num_replicas, rank: the DDP shard (default: one process serving everything).
    """

    def __init__(self, dataset: Sized, shuffle: bool = False, seed: int = 0, num_replicas: int = 1, rank: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)

    @classmethod
    def for_trainer(cls, dataset: Sized, trainer: pl.Trainer | None, shuffle: bool, seed: int) -> "EpochSampler":
        """A sampler sharded as ``trainer``'s strategy asks (one shard without a parallel strategy)."""
        shard = None if trainer is None else trainer.distributed_sampler_kwargs
        return cls(dataset, shuffle=shuffle, seed=seed, **(shard or {}))

    def set_epoch(self, epoch: int) -> None:
        """Select the order of ``epoch`` and pass ``epoch`` on to the dataset's ``set_epoch``, if any."""
        super().set_epoch(epoch)
        dataset_set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(dataset_set_epoch):
            dataset_set_epoch(epoch)
