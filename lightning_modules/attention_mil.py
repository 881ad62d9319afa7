"""AttCNN: per-slice CNN → (gated) attention pooling → bag classifier.

The attention-based deep MIL classifier of Ilse, Tomczak & Welling, *Attention-based deep multiple
instance learning* (ICML 2018), used as the CT baseline by Castro-Macías et al., *Hyperbolic secant
representation of the logistic function: application to probabilistic multiple instance learning
for CT intracranial hemorrhage detection* (Artificial Intelligence, 2024), Section 6.3.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from pytorch_lightning.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_modules.attention_pooling import AttentionPooling
from lightning_modules.bag_module_base import BagModuleBase, records_metrics
from lightning_modules.extractors.small_cnn import SmallCNN
from lightning_modules.setting_checks import check_at_least, check_rate
from milgp.data.bags import BagBatch, Bags
from milgp.metrics import log_loss
from milgp.prediction import BagCalibrator, cross_fitted_calibration

__all__ = ["AttentionMILModule"]


class AttentionMILModule(BagModuleBase):
    """The AttCNN baseline, trained on bag labels with binary cross-entropy.

    Inputs are CT slices ``(N, C, H, W)`` through the extractor, or precomputed slice features
    ``(N, D)`` (a feature file), flat with a bag index: only the attention softmax pads
    (:class:`AttentionPooling`), so a bag's prediction does not depend on the other bags in its batch.

    Exports per slice: the attention weight (``slice_scores``, used for the instance AUROC as in
    the literature) and ``slice_probs = sigmoid(classifier(h_n))``, the bag classifier applied to one
    slice's embedding. ``predict`` also returns the per-slice features ``h_n`` (``D`` columns) that
    the two-stage GP is fitted on (:class:`lightning_modules.callbacks.FeatureWriter`).

    Bag probabilities are the bag output ``σ(logit)`` Platt-calibrated on the validation bags
    (:meth:`stage_metrics`; docs/lightning.md, "The bag decision and model selection").

    Args:
        extractor: the per-slice CNN (any module ``(N, C, H, W) -> (N, D)`` with ``feature_dim``);
            default :class:`SmallCNN` with D = 32.
        attention_dim: hidden size of the attention network.
        gated: gated attention (default) or plain attention.
        dropout: dropout on the bag embedding.
        lr, weight_decay: AdamW (docs/lightning.md says why lr is 3e-4).
        pos_weight: weight of positive bags in the loss (``None``: 1).
        instance_score: ``"attention"`` or ``"classifier"``: which per-slice score feeds the
            instance AUROC.
    """

    optional_state: ClassVar[tuple[str, ...]] = ("calibrator.slope", "calibrator.intercept", "calibrator.fitted")
    """State entries older checkpoints lack (:func:`lightning_modules.checkpoints.check_state`)."""

    def __init__(
        self,
        extractor: nn.Module | None = None,
        attention_dim: int = 64,
        gated: bool = True,
        dropout: float = 0.0,
        lr: float = 3e-4,
        weight_decay: float = 1e-4,
        pos_weight: float | None = None,
        instance_score: str = "attention",
    ):
        super().__init__()
        self.save_hyperparameters(ignore=self._ignored_hparams(["extractor"]))
        if instance_score not in ("attention", "classifier"):
            raise ValueError(f"instance_score must be 'attention' or 'classifier', got {instance_score!r}")
        check_at_least("attention_dim", attention_dim, 1)
        check_rate("lr", lr)
        check_rate("weight_decay", weight_decay, zero=True)
        if pos_weight is not None:
            check_rate("pos_weight", pos_weight)
        self.extractor = self._built(extractor) if extractor is not None else SmallCNN(feature_dim=32)
        dim = int(getattr(self.extractor, "feature_dim"))
        self.pooling = AttentionPooling(dim, attention_dim, gated)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(dim, 1)
        self.calibrator = BagCalibrator()
        self.lr, self.weight_decay = lr, weight_decay
        self.pos_weight = pos_weight
        self.instance_score = instance_score

    def forward(self, x: Tensor, bags: Bags) -> dict[str, Tensor]:
        """``x (N, C, H, W)`` or ``(N, D)`` of ``bags`` → ``{"logits" (B,), "attention" (N,), "features" (N, D)}``."""
        h = self.features(x)
        pooled, weights = self.pooling(h, bags)
        logits = self.classifier(self.dropout(pooled)).squeeze(-1)
        return {"logits": logits, "attention": weights, "features": h}

    def training_step(self, batch: BagBatch, batch_idx: int) -> Tensor:
        out = self(batch.x, batch.bags)
        target = batch.bag_labels.to(out["logits"].dtype)
        pw = None if self.pos_weight is None else torch.tensor(self.pos_weight, device=target.device, dtype=target.dtype)
        loss = F.binary_cross_entropy_with_logits(out["logits"].float(), target.float(), pos_weight=pw)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.num_bags)
        return loss

    @torch.no_grad()
    def predict_records(self, batch: BagBatch) -> list[dict]:
        out = self(batch.x, batch.bags)
        bag_score = torch.sigmoid(out["logits"].float())
        slice_p = torch.sigmoid(self.classifier(out["features"]).squeeze(-1).float())
        scores = out["attention"] if self.instance_score == "attention" else slice_p
        records = self.make_records(
            batch, self.calibrator(bag_score)[0], None, slice_p, None, slice_scores=scores,
            extra={"features": out["features"].float(), "attention": out["attention"]},
        )
        for record, score in zip(records, bag_score.tolist()):
            record["bag_score"] = score  # the uncalibrated σ(logit), refitted on at validation
        return records

    def stage_metrics(self, records: list[dict], stage: str) -> dict[str, float]:
        """The records' metrics; at a validation epoch of ``fit`` the calibration is first refitted
        on the validation bags (their records' bag probabilities rewritten with it) and ``bag_nll``
        is the cross-fitted one. A validation set of one class keeps the previous calibration (a
        warning says so); the sanity check, ``validate`` and ``test`` never refit it."""
        if stage != "val" or self.trainer.state.fn != "fit" or self.trainer.sanity_checking:
            return records_metrics(records)
        labelled = [r for r in records if math.isfinite(float(r["bag_label"]))]
        scores = torch.tensor([r["bag_score"] for r in labelled], dtype=torch.float64)
        labels = torch.tensor([r["bag_label"] for r in labelled], dtype=torch.float64)
        if labels.numel() == 0 or labels.min() == labels.max():
            rank_zero_warn("the validation bags are all of one class: the bag calibration is not refitted this epoch")
            return records_metrics(records)
        probs = self.calibrator.fit(scores, labels)(scores)[0]
        for record, p in zip(labelled, probs.tolist()):
            record["bag_prob"] = p
        metrics = records_metrics(records)
        heldout = cross_fitted_calibration(scores, labels)
        if heldout is None:
            rank_zero_warn("fewer than two validation bags of a class: val/bag_nll is computed on the bags the calibration was fitted on")
        else:
            metrics["bag_nll"] = log_loss(heldout, labels)
        return metrics

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # checkpoints written before the module had a calibration load as uncalibrated
        for key, value in BagCalibrator().state_dict(prefix=prefix + "calibrator.").items():
            state_dict.setdefault(key, value)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "attention_dim": self.pooling.V.out_features, "gated": self.pooling.gated,
                "calibrated": bool(self.calibrator.fitted), "calibration_slope": float(self.calibrator.slope),
                "calibration_intercept": float(self.calibrator.intercept)}

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
