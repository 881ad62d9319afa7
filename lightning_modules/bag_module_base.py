"""Shared machinery of the bag classifiers: batches, per-bag prediction records, metrics, checkpoints.

A *record* is one bag's prediction, a plain dict::

    {"bag_id": str, "bag_label": float, "bag_prob": float, "bag_std": float (nan if none),
     "slice_probs": [float], "slice_stds": [float] or None, "slice_labels": [float] or None,
     "slice_scores": [float]}   # what instance AUROC uses (probabilities or attention weights)

Validation and test records are gathered across DDP ranks (deduplicated by bag id, sorted) before
the metrics are computed, so every rank logs the same numbers for the whole split.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch import Tensor

from lightning_modules.distributed import all_gather_objects
from milgp.data.bags import BagBatch, split_by_bag
from milgp.metrics import classification_metrics, json_safe

__all__ = ["BagModuleBase", "records_metrics"]


def records_metrics(records: list[dict]) -> dict[str, float]:
    """Bag metrics (``bag_auc``, ``bag_accuracy``, ``bag_f1``, ``bag_ece``) and, when slice labels are
    known, instance metrics (``instance_auc`` from ``slice_scores``; accuracy/F1/ECE from
    ``slice_probs`` when those are probabilities)."""
    if not records:
        return {}
    bag_p = np.array([r["bag_prob"] for r in records], dtype=float)
    bag_y = np.array([r["bag_label"] for r in records], dtype=float)
    out = classification_metrics(bag_p, bag_y, prefix="bag_")
    labelled = [r for r in records if r.get("slice_labels") is not None]
    if labelled:
        y = np.concatenate([np.asarray(r["slice_labels"], dtype=float) for r in labelled])
        s = np.concatenate([np.asarray(r["slice_scores"], dtype=float) for r in labelled])
        p = np.concatenate([np.asarray(r["slice_probs"], dtype=float) for r in labelled])
        inst = classification_metrics(p, y, prefix="instance_")
        from milgp.metrics import auroc

        inst["instance_auc"] = auroc(s, y)
        out.update(inst)
    return out


class BagModuleBase(pl.LightningModule, ABC):
    """Base of :class:`AttentionMILModule` and :class:`GPMILModule` (not used on its own)."""

    def __init__(self) -> None:
        super().__init__()
        self._val_records: list[dict] = []
        self._test_records: list[dict] = []
        self.test_records: list[dict] = []
        self.test_metrics: dict[str, float] = {}
        self.val_metrics: dict[str, float] = {}

    @staticmethod
    def _ignored_hparams(module_args: list[str]) -> list[str]:
        """Module-valued init args to leave out of ``hparams``: none when the LightningCLI built the
        module (it records them as ``class_path``/``init_args`` dicts), else the objects themselves
        (they live in the state dict; pass them again to ``load_from_checkpoint``)."""
        try:
            from pytorch_lightning.core.mixins.hparams_mixin import _given_hyperparameters
        except ImportError:  # pragma: no cover - other Lightning versions
            return list(module_args)
        return [] if _given_hyperparameters.get() is not None else list(module_args)

    # -- batches ---------------------------------------------------------------------------------
    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        if isinstance(batch, BagBatch):
            return batch.to(device)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    # -- records ---------------------------------------------------------------------------------
    @staticmethod
    def make_records(
        batch: BagBatch,
        bag_prob: Tensor,
        bag_std: Tensor | None,
        slice_probs: Tensor,
        slice_stds: Tensor | None,
        slice_scores: Tensor | None = None,
        extra: dict[str, Tensor] | None = None,
    ) -> list[dict]:
        """Per-bag records of one batch (see the module docstring); ``extra`` adds per-instance
        tensors (e.g. ``"features"``) as per-bag lists/arrays."""
        B = batch.num_bags
        per = lambda t: None if t is None else [v.detach().float().cpu().numpy() for v in split_by_bag(t, batch.bag_index, B)]  # noqa: E731
        probs, stds = per(slice_probs), per(slice_stds)
        scores = per(slice_scores) if slice_scores is not None else probs
        labels = per(batch.instance_labels) if batch.instance_labels is not None else None
        extras = {k: per(v) for k, v in (extra or {}).items()}
        ids = batch.bag_ids or [f"bag_{i}" for i in range(B)]
        out = []
        for b in range(B):
            lab = None
            if labels is not None and not np.isnan(labels[b]).any():
                lab = labels[b].tolist()
            rec = {
                "bag_id": ids[b],
                "bag_label": float(batch.bag_labels[b]),
                "bag_prob": float(bag_prob[b]),
                "bag_std": float("nan") if bag_std is None else float(bag_std[b]),
                "slice_probs": probs[b].tolist(),
                "slice_stds": None if stds is None else stds[b].tolist(),
                "slice_scores": scores[b].tolist(),
                "slice_labels": lab,
            }
            for k, v in extras.items():
                rec[k] = v[b]
            out.append(rec)
        return out

    @staticmethod
    def gather_records(records: list[dict]) -> list[dict]:
        """All ranks' records, one per bag id (samplers may repeat bags to even out ranks), sorted."""
        merged: dict[str, dict] = {}
        for part in all_gather_objects(records):
            for r in part:
                merged.setdefault(r["bag_id"], r)
        return [merged[k] for k in sorted(merged)]

    @abstractmethod
    def predict_records(self, batch: BagBatch) -> list[dict]:
        """One record per bag of ``batch``: ``bag_id``, ``bag_label``, ``bag_prob`` (± ``bag_std``),
        ``slice_probs`` (± ``slice_stds``), ``slice_labels`` — what the metrics and reports read."""

    # -- validation / test -----------------------------------------------------------------------
    def validation_step(self, batch: BagBatch, batch_idx: int) -> None:
        self._val_records.extend(self.predict_records(batch))

    def on_validation_epoch_end(self) -> None:
        records = self.gather_records(self._val_records)
        self._val_records = []
        self.val_metrics = records_metrics(records)
        for k, v in self.val_metrics.items():
            if k.endswith("count"):
                continue
            self.log(f"val/{k}", float(v) if math.isfinite(v) else 0.0, prog_bar=k in ("bag_auc",), sync_dist=False)

    def test_step(self, batch: BagBatch, batch_idx: int) -> None:
        self._test_records.extend(self.predict_records(batch))

    def on_test_epoch_end(self) -> None:
        self.test_records = self.gather_records(self._test_records)
        self._test_records = []
        self.test_metrics = records_metrics(self.test_records)
        for k, v in self.test_metrics.items():
            if not k.endswith("count"):
                self.log(f"test/{k}", float(v) if math.isfinite(v) else float("nan"), sync_dist=False)

    def predict_step(self, batch: BagBatch, batch_idx: int, dataloader_idx: int = 0) -> list[dict]:
        return self.predict_records(batch)

    # -- checkpoints -----------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep only plain values in the saved hyperparameters so ``torch.load(weights_only=True)``
        works (modules passed as objects are replaced by their class path; the LightningCLI stores
        them as ``class_path``/``init_args`` dicts anyway)."""
        if "hyper_parameters" in checkpoint:
            checkpoint["hyper_parameters"] = _plain(dict(checkpoint["hyper_parameters"]))


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (np.generic, Tensor)):
        return json_safe(obj)
    return {"class_path": f"{type(obj).__module__}.{type(obj).__qualname__}", "repr": repr(obj)[:500]}
