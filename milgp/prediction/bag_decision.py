"""A bag decision: a bag rule plus its calibration, chosen on held-out bags.

The held-out posterior is that of leave-one-bag-out cavities of the training bags
(:func:`milgp.variational.leave_bag_out.leave_bag_out_posterior`) or a validation set's predictive.
The default candidates (:func:`auto_bag_rules`) are rules whose score does not grow with the number
of instances, so the choice made on training bags carries over to longer test bags; the noisy-OR,
which compounds with bag length, can be passed explicitly (docs/core.md, cause 5).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from milgp.likelihoods.instance_link import InstanceLink
from milgp.metrics import log_loss
from milgp.prediction.bag_posterior import BagPosterior
from milgp.prediction.bag_rules import BagRule, MaxRule, TopKMeanRule, make_bag_rule
from milgp.prediction.calibration import BagCalibrator

__all__ = ["AUTO_BAG_RULES", "BagDecision", "auto_bag_rules", "best_decision", "fit_bag_decision", "score_bag_rules"]

AUTO_BAG_RULES = ("max", "top_k_mean", "mean")
"""The names of the candidates of ``bag_rule="auto"``, in the order :func:`auto_bag_rules` builds them."""


def auto_bag_rules(sizes: Tensor) -> tuple[BagRule, ...]:
    """The candidates of ``bag_rule="auto"`` for held-out bags of ``sizes`` ``(B,)`` instances:
    the max at the resolution of the longest of them (``MaxRule(reference_length=max sizes)``:
    unchanged for bags of the lengths the decision is fitted on, the mean of the top ``n_b / n₀``
    instances for longer ones), the mean of the top quarter and the mean of the bag."""
    sizes = torch.as_tensor(sizes)
    if sizes.numel() == 0:
        raise ValueError("auto_bag_rules needs the sizes of at least one held-out bag, got none")
    return (MaxRule(reference_length=float(sizes.max())), TopKMeanRule(fraction=0.25), TopKMeanRule(fraction=1.0))


@dataclass
class BagDecision:
    """A bag rule, its calibration and the held-out score that chose them.

    Attributes:
        rule: the chosen :class:`BagRule`.
        calibrator: fitted on the held-out scores of ``rule``.
        heldout_nll: mean held-out negative log-likelihood of the calibrated probabilities.
        candidates: ``{rule name: held-out NLL}`` of every candidate tried.
        heldout_proba: the calibrated held-out probabilities ``(B,)`` behind ``heldout_nll``
            (``None`` when the decision was not scored).
    """

    rule: BagRule
    calibrator: BagCalibrator
    heldout_nll: float
    candidates: dict[str, float]
    heldout_proba: Tensor | None = None

    def __call__(
        self, posterior: BagPosterior, link: InstanceLink, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        """Calibrated bag probabilities and their stds ``(B,)``."""
        return self.calibrator(*self.rule(posterior, link, generator))


def score_bag_rules(
    heldout: BagPosterior,
    link: InstanceLink,
    labels: Tensor,
    candidates: Sequence[str | BagRule] = AUTO_BAG_RULES,
    generator: torch.Generator | None = None,
    calibrate: bool = True,
) -> list[BagDecision]:
    """One scored decision per candidate rule on held-out bags: the rule, a calibration fitted to
    its held-out scores (identity with ``calibrate=False``), the calibrated held-out probabilities
    and their mean negative log-likelihood.

    Args:
        heldout: posterior of bags whose labels the model has not used (``B`` bags).
        labels: ``(B,)`` their labels in {0, 1}.
        candidates: rule names or :class:`BagRule` objects.
    """
    if len(candidates) == 0:
        raise ValueError("a bag decision needs at least one candidate bag rule")
    y = torch.as_tensor(labels, dtype=torch.float64).reshape(-1).cpu()
    out = []
    for cand in candidates:
        rule = make_bag_rule(cand)
        p, _ = rule(heldout, link, generator)  # marginal rules share the posterior's instance moments
        calibrator = BagCalibrator().fit(p, y) if calibrate else BagCalibrator()
        proba = calibrator(p.detach().to(torch.float64).cpu())[0]
        nll = log_loss(proba, y)
        out.append(BagDecision(rule, calibrator, nll, {repr(rule): nll}, proba))
    return out


def fit_bag_decision(
    heldout: BagPosterior,
    link: InstanceLink,
    labels: Tensor,
    candidates: Sequence[str | BagRule] = AUTO_BAG_RULES,
    generator: torch.Generator | None = None,
) -> BagDecision:
    """Choose and calibrate a bag rule on held-out bags: the candidate of
    :func:`score_bag_rules` with the smallest held-out NLL (ties go to the earlier one)."""
    scored = score_bag_rules(heldout, link, labels, candidates, generator)
    best = best_decision(scored)
    best.candidates = {repr(d.rule): d.heldout_nll for d in scored}
    return best


def best_decision(scored: Sequence[BagDecision]) -> BagDecision:
    """The decision with the smallest held-out NLL; ties go to the earlier one."""
    best = scored[0]
    for d in scored[1:]:
        if d.heldout_nll < best.heldout_nll - 1e-12:
            best = d
    return best
