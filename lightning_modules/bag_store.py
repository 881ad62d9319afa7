"""Per-bag instance features collected during an epoch, keyed by bag id (gathered across DDP ranks)."""
from __future__ import annotations

import torch
from torch import Tensor

from lightning_modules.distributed import all_gather_objects
from milgp.data.bags import BagBatch, bag_index_from_sizes, split_by_bag

__all__ = ["BagStore"]


class BagStore:
    """The latest features ``(n_b, D)`` and label of every bag added, by bag id, on the CPU.

    The GP module keeps the training bags' features here to fit its bag decision on their
    leave-one-bag-out cavities, or the validation bags' features to fit it on those.
    """

    def __init__(self) -> None:
        self._bags: dict[str, tuple[Tensor, float]] = {}

    def add(self, batch: BagBatch, h: Tensor) -> None:
        """Store the features ``h`` ``(N, D)`` of the batch's bags (which need ids)."""
        if not batch.bag_ids:
            raise ValueError("bags without ids cannot be stored (the data module gives every bag an id)")
        parts = split_by_bag(h.detach().float().cpu(), batch.bag_index.cpu(), batch.num_bags)
        for bag_id, part, label in zip(batch.bag_ids, parts, batch.bag_labels.tolist()):
            self._bags[bag_id] = (part.clone(), float(label))

    def take(self) -> tuple[list[str], Tensor, Tensor, Tensor]:
        """Every rank's bags, sorted by id, and empty the store: ``(ids (B,), features (N, D) float64,
        bag_index (N,), labels (B,) float64)``."""
        merged = {k: v for part in all_gather_objects(self._bags) for k, v in part.items()}
        self._bags = {}
        ids = sorted(merged)
        h = torch.cat([merged[k][0] for k in ids]).to(torch.float64)
        bag_index = bag_index_from_sizes([len(merged[k][0]) for k in ids])
        labels = torch.tensor([merged[k][1] for k in ids], dtype=torch.float64)
        return ids, h, bag_index, labels
