"""A torch dataset of bags held in memory (features or images)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = ["InMemoryBagDataset"]


class InMemoryBagDataset(torch.utils.data.Dataset):
    """Items ``(x (n_b, ...), instance_labels (n_b,) or None, bag_label, bag_id)`` — the tuple
    :func:`milgp.data.bags.collate_bags` batches.

    Args:
        bags: per-bag arrays ``(n_b, ...)``.
        bag_labels: ``(B,)``.
        instance_labels: per-bag ``(n_b,)`` arrays or ``None`` (NaN entries also mean unknown).
        bag_ids: ``B`` identifiers (default ``bag_<i>``).
    """

    def __init__(
        self,
        bags: Sequence[Any],
        bag_labels: Sequence[float],
        instance_labels: Sequence[Any] | None = None,
        bag_ids: Sequence[str] | None = None,
    ):
        if len(bags) != len(bag_labels):
            raise ValueError(f"{len(bags)} bags but {len(bag_labels)} bag labels")
        self.bags = [torch.as_tensor(np.asarray(b)) for b in bags]
        for i, b in enumerate(self.bags):
            if b.ndim < 2 or b.shape[0] == 0:
                raise ValueError(f"bag {i} must be a non-empty (n_b, ...) array, got shape {tuple(b.shape)}")
        self.bag_labels = [float(y) for y in bag_labels]
        self.instance_labels: list[Tensor | None] = []
        for i, b in enumerate(self.bags):
            lab = None if instance_labels is None else instance_labels[i]
            if lab is not None:
                lab_t = torch.as_tensor(np.asarray(lab, dtype=np.float32)).reshape(-1)
                if len(lab_t) != len(b):
                    raise ValueError(f"bag {i}: {len(lab_t)} instance labels for {len(b)} instances")
                lab = None if torch.isnan(lab_t).any() else lab_t
            self.instance_labels.append(lab)
        self.bag_ids = [str(b) for b in bag_ids] if bag_ids is not None else [f"bag_{i}" for i in range(len(self.bags))]

    def __len__(self) -> int:
        return len(self.bags)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor | None, float, str]:
        return self.bags[i], self.instance_labels[i], self.bag_labels[i], self.bag_ids[i]
