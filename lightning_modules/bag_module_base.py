"""Shared machinery of the bag classifiers: batches, per-bag prediction records, metrics, checkpoints.

A *record* is one bag's prediction, a plain dict::

    {"bag_id": str, "bag_label": float (nan if unknown), "bag_prob": float, "bag_std": float (nan if none),
     "slice_probs": [float], "slice_stds": [float] or None, "slice_labels": [float] or None,
     "slice_scores": [float]}   # what instance AUROC uses (probabilities or attention weights)

Validation and test records are gathered from every DDP rank (:meth:`BagModuleBase.gather_records`)
and checked (:func:`check_records`) before the metrics, so every rank logs the same numbers.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Mapping

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.core.mixins.hparams_mixin import _given_hyperparameters
from torch import Tensor, nn

from lightning_modules.checkpoints import CHECKPOINT_KEY, check_state
from lightning_modules.distributed import all_gather_objects
from lightning_modules.input_error import InputError
from lightning_modules.module_config import instantiate, module_config
from milgp.data.bags import BagBatch, split_by_bag
from milgp.metrics import auroc, classification_metrics, json_safe

__all__ = ["BagModuleBase", "check_records", "records_metrics"]


def check_records(records: list[dict], stage: str) -> None:
    """Raise naming the first bag whose predicted bag or slice probability is not finite."""
    for r in records:
        values = [r["bag_prob"]] + list(r.get("slice_probs") or [])
        if not all(math.isfinite(float(v)) for v in values):
            raise ValueError(
                f"{stage} bag {r['bag_id']!r}: the model predicts a non-finite probability "
                f"(bag {r['bag_prob']}); its inputs or the model's state hold NaN or infinity"
            )


def records_metrics(records: list[dict]) -> dict[str, float]:
    """Bag metrics (``bag_auc``, ``bag_accuracy``, ``bag_f1``, ``bag_ece``, ``bag_nll``) and, when slice
    labels are known, instance metrics (``instance_auc`` from ``slice_scores``; accuracy/F1/ECE
    from ``slice_probs`` when those are probabilities). Records without a bag label (unlabelled
    scans) are left out; ``{}`` when none is labelled."""
    records = [r for r in records if math.isfinite(float(r["bag_label"]))]
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
        inst["instance_auc"] = auroc(s, y)
        out.update(inst)
    return out


class BagModuleBase(pl.LightningModule, ABC):
    """Base of :class:`AttentionMILModule` and :class:`GPMILModule` (not used on its own).

    Attributes:
        selection_metric: ``(logged name, "min" | "max")`` that ``best.ckpt`` and early stopping
            follow: the validation bag NLL, a proper score (bag AUROC is logged beside it).
        input_preprocessing: the CT preprocessing the model's inputs were made with
            (``{"windows": [[center, width], ...], "size": [H, W], "dtype": cache storage dtype}``,
            from the training data or the extractor checkpoint; ``None`` for feature inputs), saved
            in checkpoints so that new DICOM scans are prepared exactly as the training scans were.
    """

    selection_metric: tuple[str, str] = ("val/bag_nll", "min")

    def __init__(self) -> None:
        super().__init__()
        self._val_records: list[dict] = []
        self._test_records: list[dict] = []
        self.test_records: list[dict] = []
        self.test_metrics: dict[str, float] = {}
        self.val_records: list[dict] = []
        self.val_metrics: dict[str, float] = {}
        self.input_preprocessing: dict | None = None
        self._module_args: list[str] = []

    def _ignored_hparams(self, module_args: list[str]) -> list[str]:
        """Module-valued init args to leave out of ``hparams``: none when the LightningCLI built the
        module (it records them as ``class_path``/``init_args`` dicts), else the objects themselves;
        :meth:`on_save_checkpoint` then records their configuration (:func:`module_config`)."""
        self._module_args = list(module_args)
        return [] if _given_hyperparameters.get() is not None else list(module_args)

    @staticmethod
    def _built(obj: Any) -> Any:
        """A module argument as an object: configurations (``load_from_checkpoint`` without the
        CLI's instantiator passes the recorded ``{"class_path", "init_args"}``) are instantiated."""
        return instantiate(obj) if isinstance(obj, Mapping) else obj

    # -- inputs ----------------------------------------------------------------------------------
    extractor: nn.Module | None

    def input_source(self) -> str:
        """``"<file or folder>: "`` of the data the trainer serves (for an error message), else ``""``."""
        source = getattr(getattr(self._trainer, "datamodule", None), "source", None)
        return f"{source}: " if source else ""

    def features(self, x: Tensor, grad: bool | None = None) -> Tensor:
        """Instance features ``(N, D)``: ``x`` itself when it holds features (2-D: a feature file),
        else the extractor's output for slices ``(N, C, H, W)``; ``grad`` forces autograd on or off.
        A model without an extractor takes features only (slices: a one-line :class:`InputError`)."""
        if x.dim() == 2:
            return x
        if self.extractor is None:
            raise InputError(f"{self.input_source()}the inputs are slices {tuple(x.shape[1:])}, but the model has no extractor: "
                             "it was trained on features and takes feature files only")
        with torch.set_grad_enabled(torch.is_grad_enabled() if grad is None else grad):
            return self.extractor(x)

    def _check_preprocessing(self, which: str) -> dict | None:
        """The data module's CT preprocessing (``None`` for features), or a one-line
        :class:`InputError` when its windows or size differ from those the extractor was trained on;
        ``which`` names the data in the message."""
        data = getattr(getattr(self.trainer, "datamodule", None), "preprocessing", None)
        geometry = ("windows", "size")  # the storage dtype may differ (a rounding of 1/255 of a window at most)
        if data is not None and self.input_preprocessing is not None and any(self.input_preprocessing.get(k) != data.get(k) for k in geometry):
            raise InputError(
                f"the extractor was trained on CT slices preprocessed as {self.input_preprocessing}, "
                f"but the {which} data are {data}: rebuild the cache with the same windows and size"
            )
        return data

    def on_fit_start(self) -> None:
        """Record the CT preprocessing of the training data (checked against the extractor's)."""
        data = self._check_preprocessing("training")
        if data is not None:
            self.input_preprocessing = dict(data)

    def on_validation_start(self) -> None:
        """A ``validate`` run checks its data's CT preprocessing against the model's (during ``fit``
        :meth:`on_fit_start` did)."""
        if self.trainer.state.fn == "validate":
            self._check_preprocessing("validation")

    def on_test_start(self) -> None:
        """The test data's CT preprocessing must be the model's (a cache built with other windows
        was scored without a word)."""
        self._check_preprocessing("test")

    def on_predict_start(self) -> None:
        """The CT preprocessing of the scans to predict must be the model's."""
        self._check_preprocessing("prediction")

    def describe(self) -> dict[str, Any]:
        """What the model is, for reports: class, extractor, and the subclass's own details."""
        out: dict[str, Any] = {"class": f"{type(self).__module__}.{type(self).__qualname__}"}
        if getattr(self, "extractor", None) is not None:
            out["extractor"] = module_config(self.extractor)
        return out

    # -- batches ---------------------------------------------------------------------------------
    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        if isinstance(batch, BagBatch):  # asynchronous from pinned memory (the CT data module pins on a GPU)
            return batch.to(device, non_blocking=torch.device(device).type == "cuda")
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
        labels = per(batch.instance_labels)
        extras = {k: per(v) for k, v in (extra or {}).items()}
        ids = batch.bag_ids or [f"bag_{i}" for i in range(B)]
        return [
            {
                "bag_id": ids[b],
                "bag_label": float(batch.bag_labels[b]),
                "bag_prob": float(bag_prob[b]),
                "bag_std": float("nan") if bag_std is None else float(bag_std[b]),
                "slice_probs": probs[b].tolist(),
                "slice_stds": None if stds is None else stds[b].tolist(),
                "slice_scores": scores[b].tolist(),
                "slice_labels": None if labels is None or np.isnan(labels[b]).any() else labels[b].tolist(),
                **{k: v[b] for k, v in extras.items()},
            }
            for b in range(B)
        ]

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
        """One record per bag of ``batch`` (its fields: module docstring): what the metrics and reports read."""

    # -- validation / test -----------------------------------------------------------------------
    def log_metrics(self, prefix: str, metrics: dict[str, float], prog_bar: tuple[str, ...] = ()) -> None:
        """Log every defined metric (an AUROC of a one-class split is undefined and left out)."""
        for k, v in metrics.items():
            if not k.endswith("count") and math.isfinite(float(v)):
                self.log(f"{prefix}/{k}", float(v), prog_bar=k in prog_bar, sync_dist=False)

    def stage_metrics(self, records: list[dict], stage: str) -> dict[str, float]:
        """The metrics of a stage's gathered records (``stage``: ``"val"`` or ``"test"``):
        :func:`records_metrics` (binary bag labels); a module with other bag targets overrides it."""
        return records_metrics(records)

    def validation_step(self, batch: BagBatch, batch_idx: int) -> None:
        self._val_records.extend(self.predict_records(batch))

    def _end_stage(self, stage: str) -> None:
        """Gather the records of ``stage`` (``"val"`` or ``"test"``) from all ranks into
        ``{stage}_records``, check them, and compute and log ``{stage}_metrics``."""
        records = self.gather_records(getattr(self, f"_{stage}_records"))
        setattr(self, f"{stage}_records", records)
        setattr(self, f"_{stage}_records", [])
        check_records(records, "validation" if stage == "val" else "test")
        metrics = self.stage_metrics(records, stage)
        setattr(self, f"{stage}_metrics", metrics)
        self.log_metrics(stage, metrics, prog_bar=("bag_nll", "bag_auc") if stage == "val" else ())

    def on_validation_epoch_end(self) -> None:
        self._end_stage("val")

    def test_step(self, batch: BagBatch, batch_idx: int) -> None:
        self._test_records.extend(self.predict_records(batch))

    def on_test_epoch_end(self) -> None:
        self._end_stage("test")

    def predict_step(self, batch: BagBatch, batch_idx: int, dataloader_idx: int = 0) -> list[dict]:
        return self.predict_records(batch)

    # -- checkpoints -----------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Make the checkpoint self-contained and loadable with ``torch.load(weights_only=True)``:
        plain hyperparameters, the configuration of module arguments passed as objects
        (:func:`module_config`), no reference to an extractor checkpoint file (its weights are in the
        state dict), and ``checkpoint["milgp"]`` = the module's class and input preprocessing."""
        hparams = dict(checkpoint.get("hyper_parameters") or {})
        for name in self._module_args:
            value = hparams.get(name)
            obj = getattr(self, name, None) if name != "likelihood" else getattr(getattr(self, "gp", None), "likelihood", None)
            if obj is not None and not (isinstance(value, Mapping) and "init_args" in value):
                hparams[name] = module_config(obj)
        if "extractor_checkpoint" in hparams:
            hparams["extractor_checkpoint"] = None
        checkpoint["hyper_parameters"] = _plain(hparams)
        checkpoint[CHECKPOINT_KEY] = {"module": f"{type(self).__module__}.{type(self).__qualname__}",
                                      "preprocessing": self.input_preprocessing}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.input_preprocessing = (checkpoint.get(CHECKPOINT_KEY) or {}).get("preprocessing")

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict`` with a one-line error when the state does not fit (e.g. a
        checkpoint of another extractor architecture)."""
        if strict:
            check_state(self, state_dict, f"the checkpoint's {type(self).__name__}", "checkpoint")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


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
