"""Per-bag instance features (and weights) collected during an epoch, keyed by bag id (gathered across DDP ranks)."""
from __future__ import annotations

import torch
from torch import Tensor

from lightning_modules.distributed import all_gather_objects
from milgp.data.bags import BagBatch, bag_index_from_sizes, split_by_bag

__all__ = ["BagStore"]


class BagStore:
    """The latest features ``(n_b, D)``, label and instance weights of every bag added, by bag id,
    on the CPU, in the store's ``dtype``.

    The GP module keeps the training bags' features here to fit its bag decision on their
    leave-one-bag-out cavities, or the validation bags' features to fit it on those, and collects
    the training bags (float64, with their weights) here to initialise the GP.
    """

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self._bags: dict[str, tuple[Tensor, float, Tensor | None]] = {}

    def __len__(self) -> int:
        return len(self._bags)

    def add(self, batch: BagBatch, h: Tensor, weights: Tensor | None = None, ids: list[str] | None = None) -> None:
        """Store the features ``h`` ``(N, D)`` and instance weights ``(N,)`` (``None``: ones) of the
        batch's bags under ``ids`` (default: the batch's bag ids; bags need ids)."""
        if ids is None:
            ids = batch.bag_ids
            if not ids:
                raise ValueError("bags without ids cannot be stored (the data module gives every bag an id)")
        index, B = batch.bag_index.cpu(), batch.num_bags
        parts = split_by_bag(h.detach().to(self.dtype).cpu(), index, B)
        w_parts = [None] * B if weights is None else split_by_bag(weights.detach().to(self.dtype).cpu(), index, B)
        for bag_id, part, label, w in zip(ids, parts, batch.bag_labels.tolist(), w_parts):
            self._bags[bag_id] = (part.clone(), float(label), w)

    def take(self) -> tuple[list[str], Tensor, Tensor, Tensor, Tensor]:
        """Every rank's bags, sorted by id, and empty the store: ``(ids (B,), features (N, D) float64,
        bag_index (N,), labels (B,) float64, weights (N,) float64)``."""
        merged = {k: v for part in all_gather_objects(self._bags) for k, v in part.items()}
        self._bags = {}
        ids = sorted(merged)
        parts = [merged[k] for k in ids]
        h = torch.cat([part for part, _, _ in parts]).to(torch.float64)
        bag_index = bag_index_from_sizes([len(part) for part, _, _ in parts])
        labels = torch.tensor([label for _, label, _ in parts], dtype=torch.float64)
        weights = torch.cat([torch.ones(len(part), dtype=torch.float64) if w is None else w.to(torch.float64) for part, _, w in parts])
        return ids, h, bag_index, labels, weights
