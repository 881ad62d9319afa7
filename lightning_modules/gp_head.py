"""The GP-MIL head as a plain ``nn.Module`` (float64): standardisation, sparse GP, bag likelihood.

Wraps :class:`milgp.models.SparseGP` and any :class:`milgp.likelihoods.AugmentedBagLikelihood`
with what a trainer needs around them; predictions go through the head's calibrated bag decision,
kept in its state dict (docs/lightning.md, "The bag decision and model selection").
:class:`~lightning_modules.aggregate_gp_head.AggregateGPHead` is the same head for aggregate
outputs. Everything here runs in float64; callers cast features with :meth:`GPHead.standardize`.
"""
from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Sequence

import torch
from torch import Tensor, nn

from lightning_modules.bag_module_base import records_metrics
from lightning_modules.input_error import InputError
from milgp.data.bags import BagBatch, Bags, segment_sum
from milgp.data.standardize import standardization_scale
from milgp.inducing import kmeans_pp_inducing, median_lengthscale
from milgp.likelihoods.base import AugmentedBagLikelihood
from milgp.likelihoods.instance_link import ProbitLink
from milgp.likelihoods.mil_bernoulli import MILBernoulliLikelihood
from milgp.metrics import log_loss
from milgp.models.closed_form_strategy import ClosedFormStrategy, WhitenedPosterior
from milgp.models.sparse_gp import SparseGP
from milgp.variational.fit import ClosedFormSteps
from milgp.prediction import (
    AUTO_BAG_RULES,
    BAG_RULES,
    DEFAULT_BAG_RULE,
    BagCalibrator,
    BagDecision,
    BagPosterior,
    BagRule,
    MaxRule,
    auto_bag_rules,
    fit_bag_decision,
    make_bag_rule,
    stratified_folds,
)
from milgp.variational.leave_bag_out import leave_bag_out_posterior
from milgp.variational.natural_update import NaturalStatistics

__all__ = ["GPHead", "OUTSIDE_TRAINING_VARIANCE", "RULE_NAMES"]

RULE_NAMES: tuple[str, ...] = tuple(BAG_RULES)
"""The bag rules a head can hold; the ``decision_rule`` buffer stores an index into this tuple."""

OUTSIDE_TRAINING_VARIANCE = 0.9
"""An instance lies outside the training data when its predictive variance of f is at least this
share of its prior variance (:meth:`GPHead.outside_training`; docs/lightning.md has its spread)."""


class GPHead(nn.Module):
    """Sparse-GP bag classifier on ``D``-dimensional instance features.

    Args:
        feature_dim: D.
        num_inducing: M.
        likelihood: any :class:`AugmentedBagLikelihood`; default VGPMIL
            (:class:`MILBernoulliLikelihood` with ``psi="pg"``, H = 100, ``max_rule="max"``: the
            largest-other-π rule of every shipped config).
        ard: one lengthscale per feature.
        learn_inducing_locations: make Z trainable.
        constant_mean: constant instead of zero GP mean (``None``: the head's
            :attr:`default_constant_mean`, zero here).
        standardize: z-score features with training statistics (features constant in training
            are ignored: :mod:`milgp.data.standardize`).
        lengthscale: initial RBF lengthscale (``None``: median pairwise distance of the
            standardised training features).
        outputscale: initial kernel variance.
        bag_rule: ``"auto"`` (default: the rule among :func:`milgp.prediction.auto_bag_rules` with
            the smallest held-out NLL after calibration, chosen by :meth:`fit_decision`; docs/lightning.md,
            "The bag decision and model selection") or a :mod:`milgp.prediction.bag_rules` name,
            calibrated the same way. Until a decision is fitted the head predicts with the named rule
            (``"auto"``: :data:`milgp.prediction.DEFAULT_BAG_RULE`) uncalibrated.
        seed: k-means++ and sampling seed.
        chunk_instances, block_budget: aggregate heads, memory bounds of one chunk of bags
            (see :func:`milgp.variational.aggregate_fit.fit_aggregate`).
        nll_samples: aggregate heads without a closed-form predictive (Poisson, Exponential),
            Monte Carlo samples of the joint ``q(f_b)`` for the bag predictive NLL.
    """

    bag_label_kind: ClassVar[str] = "binary"
    """What the bag labels are: ``"binary"`` (MIL) or ``"aggregate"`` (real-valued targets)."""
    makes_decision: ClassVar[bool] = True
    """Whether the head has a bag decision to fit on held-out bags (:meth:`fit_decision`)."""
    optional_state: ClassVar[tuple[str, ...]] = ("decision_reference_length",)
    """State entries older checkpoints lack (:func:`lightning_modules.checkpoints.check_state`)."""

    likelihood_type: ClassVar[type] = AugmentedBagLikelihood
    default_constant_mean: ClassVar[bool] = False

    def __init__(
        self,
        feature_dim: int,
        num_inducing: int = 64,
        likelihood: Any = None,
        ard: bool = False,
        learn_inducing_locations: bool = False,
        constant_mean: bool | None = None,
        standardize: bool = True,
        lengthscale: float | None = None,
        outputscale: float = 1.0,
        bag_rule: str = "auto",
        seed: int = 0,
        chunk_instances: int = 32768,
        block_budget: int = 2_000_000,
        nll_samples: int = 256,
    ):
        super().__init__()
        bag_rule = "joint_noisy_or" if bag_rule == "joint" else bag_rule
        if bag_rule != "auto" and bag_rule not in RULE_NAMES:
            raise ValueError(f"unknown bag rule {bag_rule!r}: use 'auto' or one of {list(RULE_NAMES)}")
        likelihood = likelihood if likelihood is not None else MILBernoulliLikelihood(psi="pg", H=100.0, max_rule="max")
        if not isinstance(likelihood, self.likelihood_type):
            raise TypeError(f"{type(self).__name__} needs a likelihood of type {self.likelihood_type.__name__}, got {type(likelihood).__name__} "
                            "(aggregate likelihoods: AggregateGPHead; MIL likelihoods: GPHead)")
        if bag_rule == "orthant" and not isinstance(getattr(likelihood, "instance_link", None), ProbitLink):
            raise ValueError(f"bag_rule 'orthant' is the MIL probit model's bag probability; the likelihood {type(likelihood).__name__} "
                             "has another link: choose another bag rule or a MILProbitLikelihood")
        constant_mean = self.default_constant_mean if constant_mean is None else bool(constant_mean)
        gen = torch.Generator().manual_seed(seed)
        Z0 = torch.randn(num_inducing, feature_dim, generator=gen, dtype=torch.float64)
        self.gp = SparseGP(
            Z0, ard=ard, constant_mean=constant_mean, learn_inducing_locations=learn_inducing_locations,
            natural=True, lengthscale=1.0 if lengthscale is None else lengthscale, outputscale=outputscale,
        )
        for p in self.gp.variational_parameters():  # q(v) is updated in closed form only
            p.requires_grad_(False)
        self.likelihood = likelihood
        self.likelihood.to(torch.float64)
        self.register_buffer("feature_mean", torch.zeros(feature_dim, dtype=torch.float64))
        self.register_buffer("feature_scale", torch.ones(feature_dim, dtype=torch.float64))
        self.register_buffer("initialized", torch.tensor(False))
        # the bag decision: index into RULE_NAMES of the fitted rule (-1: none fitted) and its calibration
        self.register_buffer("decision_rule", torch.tensor(-1, dtype=torch.long))
        # the fitted max rule's reference length (MaxRule(reference_length); 0: the plain max)
        self.register_buffer("decision_reference_length", torch.tensor(0.0, dtype=torch.float64))
        self.calibrator = BagCalibrator()
        self.feature_dim = feature_dim
        self.num_inducing = num_inducing
        self.standardize_features = standardize
        self.init_lengthscale = lengthscale
        self.bag_rule = bag_rule
        self.seed = seed
        self.chunk_instances = int(chunk_instances)
        self.block_budget = int(block_budget)
        self.nll_samples = int(nll_samples)

    # -- set-up ----------------------------------------------------------------------------------
    @torch.no_grad()
    def initialize(
        self,
        features: Tensor,
        instance_bag_labels: Tensor,
        bag_targets: Tensor | None = None,
        instance_weights: Tensor | None = None,
    ) -> None:
        """Standardisation statistics, inducing points (k-means++, half on instances of positive
        bags: ``instance_bag_labels`` ``(N,)``) and the initial lengthscale from training features
        ``(N, D)``; q(v) reset to the prior. The bags' targets ``bag_targets`` ``(B,)`` and instance
        weights ``(N,)`` are for heads that start their mean from them (aggregate outputs)."""
        x = features.detach().to(torch.float64).cpu()
        if self.standardize_features:
            scale = x.std(0, unbiased=False)
            self.feature_mean.copy_(x.mean(0))
            self.feature_scale.copy_(standardization_scale(self.feature_mean.cpu(), scale))  # constant features: inf, ignored
        z = ((x - self.feature_mean.cpu()) / self.feature_scale.cpu()).numpy()
        labels = instance_bag_labels.detach().cpu().numpy()
        Z = kmeans_pp_inducing(z, labels, self.num_inducing, seed=self.seed)  # M points, jittered copies when fewer are distinct
        device = self.feature_mean.device
        self.strategy.inducing_points.data.copy_(torch.as_tensor(Z, dtype=torch.float64, device=device))
        ls = self.init_lengthscale if self.init_lengthscale is not None else median_lengthscale(z, seed=self.seed)
        # a tensor, not a Python float: GPyTorch's setter would round a float through float32
        self.gp.covar_module.base_kernel.lengthscale = torch.as_tensor(float(ls), dtype=torch.float64, device=device)
        eye = torch.eye(self.num_inducing, dtype=torch.float64, device=device)  # q(v) ← N(0, I)
        self.strategy.set_whitened_posterior(WhitenedPosterior(m=eye.new_zeros(self.num_inducing), S=eye, precision=eye.clone()))
        self.initialized.fill_(True)

    def check_data(self, bag_targets: Tensor, instance_weights: Tensor, bags: Bags) -> None:
        """Check the training bags' targets ``(B,)`` and instance weights ``(N,)`` before
        :meth:`initialize` (``ValueError`` naming the bag by position). Nothing to add here: MIL
        bag labels are checked where the data modules read them (:mod:`lightning_modules.data.checks`)."""

    @torch.no_grad()
    def update_standardization(self, h: Tensor, momentum: float, reduce: Callable[[Tensor], Tensor]) -> None:
        """Exponential moving average of the standardisation statistics towards those of the
        features ``h`` ``(N, D)`` (end-to-end training, where the CNN's features drift).

        ``reduce`` sums ``[count, Σh, Σh²]`` over DDP ranks so every rank keeps the same statistics.
        """
        if not self.standardize_features or momentum <= 0:
            return
        h = h.detach().to(torch.float64)
        packed = reduce(torch.cat([h.new_tensor([h.shape[0]]), h.sum(0), (h * h).sum(0)]))
        n, (s1, s2) = packed[0], packed[1:].chunk(2)
        mean = s1 / n
        var = (s2 / n - mean * mean).clamp_min(0)
        self.feature_mean.mul_(1 - momentum).add_(momentum * mean)
        new_var = (1 - momentum) * self.feature_scale**2 + momentum * var
        # features constant at initialize stay ignored (inf scale; 0 · inf would be NaN at momentum 1)
        self.feature_scale.copy_(torch.where(self.feature_scale.isinf(), self.feature_scale, new_var.sqrt().clamp_min(1e-8)))

    @property
    def strategy(self) -> ClosedFormStrategy:
        """The GP's variational strategy: projections, ``q(v)`` in natural parameters, bag blocks."""
        return self.gp.variational_strategy

    def hyperparameters(self) -> list[nn.Parameter]:
        """Kernel (and mean, and Z when learned) parameters: everything Adam may update."""
        return [p for p in self.strategy.hyperparameters() if p.requires_grad] + [p for p in self.likelihood.parameters() if p.requires_grad]

    # -- computations ----------------------------------------------------------------------------
    def standardize(self, h: Tensor) -> Tensor:
        """Features ``(N, D)`` (any float dtype) → standardised float64."""
        return (h.to(torch.float64) - self.feature_mean) / self.feature_scale

    def posterior(self) -> WhitenedPosterior:
        return self.strategy.whitened_posterior()

    def moments(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """``q(f_n)`` mean and variance ``(N,)`` of standardised features; differentiable in ``z``
        and the hyperparameters (q(v) fixed)."""
        return self.strategy.marginals(self.strategy.projection(z), self.posterior())

    def outside_training(self, z: Tensor, var: Tensor, bags: Bags) -> Tensor:
        """``(B,)`` the share of each bag's instances (standardised features ``z`` ``(N, D)`` with
        predictive variances ``var`` ``(N,)`` of f) that lie outside the training data: ``var`` is at least
        :data:`OUTSIDE_TRAINING_VARIANCE` of their prior variance (far from every inducing point,
        or outside a linear kernel's span): the training data say nothing about them and their
        prediction is the prior's."""
        outside = (var >= OUTSIDE_TRAINING_VARIANCE * self.strategy.prior_variance(z)).to(var)
        return segment_sum(outside, bags.index, bags.num_bags) / bags.sizes.to(var)

    # -- bag decisions ---------------------------------------------------------------------------
    def bag_posterior(self, z: Tensor, bags: Bags) -> BagPosterior:
        """The predictive ``q(f*)`` of the bags ``bags`` of standardised features ``z`` ``(N, D)``:
        marginals, and the within-bag covariance blocks on demand (joint rules); no gradients."""
        return BagPosterior.from_model(self.gp, z.to(torch.float64), bags)

    @torch.no_grad()
    def leave_bag_out(self, z: Tensor, bags: Bags, bag_labels: Tensor, locals_: Any) -> BagPosterior:
        """Leave-one-bag-out cavity predictive of training bags (standardised features ``z``, their
        labels and locals at the current fit): an out-of-bag prediction of every training bag
        (:func:`milgp.variational.leave_bag_out.leave_bag_out_posterior`)."""
        batch = BagBatch(z.to(torch.float64), bags.index, bag_labels.to(torch.float64))
        return leave_bag_out_posterior(self.gp, self.likelihood, batch, locals_, block_budget=self.block_budget)

    @property
    def rule_name(self) -> str:
        """The rule the head predicts with: the fitted one, else the configured one (``"auto"``:
        :data:`~milgp.prediction.DEFAULT_BAG_RULE`)."""
        k = int(self.decision_rule)
        if k >= 0:
            return RULE_NAMES[k]
        return DEFAULT_BAG_RULE if self.bag_rule == "auto" else self.bag_rule

    @property
    def calibrated(self) -> bool:
        """Whether a bag decision has been fitted (the calibration is then in use)."""
        return bool(self.calibrator.fitted)

    def generator(self, device: torch.device) -> torch.Generator:
        """The seeded generator of sampling bag rules (the same draws at every prediction)."""
        return torch.Generator(device=device).manual_seed(self.seed)

    @torch.no_grad()
    def fit_decision(self, posterior: BagPosterior, labels: Tensor) -> tuple[str, BagDecision]:
        """Choose (``bag_rule="auto"``) and calibrate the bag rule on held-out bags.

        Args:
            posterior: the held-out predictive of ``B`` bags (leave-one-bag-out cavities of
                training bags, :meth:`leave_bag_out`, or validation bags, :meth:`bag_posterior`).
            labels: ``(B,)`` their labels in {0, 1}.

        Returns:
            ``(rule name, decision)``; the head is unchanged (:meth:`set_decision` adopts it).

        Raises:
            ValueError: the bags hold one class only (calibration needs both).
        """
        if self.bag_rule == "auto":
            names, rules = AUTO_BAG_RULES, list(auto_bag_rules(posterior.bags.sizes))
        else:
            names, rules = (self.bag_rule,), [make_bag_rule(self.bag_rule)]
        decision = fit_bag_decision(posterior, self.likelihood.instance_link, labels, rules, self.generator(posterior.mean.device))
        chosen = next(n for n, r in zip(names, rules) if r is decision.rule)
        return chosen, decision

    @torch.no_grad()
    def set_decision(self, rule_name: str, decision: BagDecision) -> None:
        """Predict from now on with ``rule_name`` calibrated by ``decision.calibrator``."""
        self.decision_rule.fill_(RULE_NAMES.index(rule_name))
        reference = decision.rule.reference_length if isinstance(decision.rule, MaxRule) else None
        self.decision_reference_length.fill_(reference or 0.0)
        self.calibrator.load_state_dict(decision.calibrator.state_dict())

    def decision_rule_object(self) -> BagRule:
        """The :class:`~milgp.prediction.BagRule` of :attr:`rule_name` (the max with its fitted
        reference length)."""
        reference = float(self.decision_reference_length)
        return MaxRule(reference) if self.rule_name == "max" and reference > 0 else make_bag_rule(self.rule_name)

    def check_bag_lengths(self, source: str, bag_ids: Sequence[str], sizes: Sequence[int]) -> None:
        """Every bag short enough for the head's bag rule: a joint rule (``joint_max``,
        ``joint_noisy_or``, ``orthant``) factorises each bag's ``n×n`` predictive covariance, up to
        its ``max_instances``; a longer bag is a one-line :class:`InputError` naming it (``source``:
        the data's name and ``": "``, or ``""``), before any work on it."""
        limit = getattr(self.decision_rule_object(), "max_instances", None)
        too_long = [(b, int(n)) for b, n in zip(bag_ids, sizes) if limit is not None and int(n) > limit]
        if too_long:
            bag_id, n = too_long[0]
            raise InputError(
                f"{source}bag {bag_id!r} has {n} instances, more than the {limit} that bag_rule {self.rule_name!r} reads jointly "
                f"(it factorises the bag's {n}×{n} predictive covariance): use a model fitted with a marginal bag_rule "
                "(auto, max, noisy_or, top_k_mean), or fewer slices per bag (max_slices)"
            )

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # checkpoints written before the max rule had a reference length hold the plain max
        state_dict.setdefault(prefix + "decision_reference_length", torch.tensor(0.0, dtype=torch.float64))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @torch.no_grad()
    def decide(self, posterior: BagPosterior) -> tuple[Tensor, Tensor]:
        """Calibrated bag probabilities and their stds ``(B,)`` by the head's decision."""
        p, std = self.decision_rule_object()(posterior, self.likelihood.instance_link, self.generator(posterior.mean.device))
        return self.calibrator(p, std)

    @torch.no_grad()
    def cross_fitted_nll(self, z: Tensor, bags: Bags, labels: Tensor, folds: int = 2) -> float | None:
        """Held-out NLL of bag decisions fitted on the same bags, by cross-fitting: the bags are
        dealt into ``folds`` folds stratified by label, each fold is predicted by a decision
        (:meth:`fit_decision`) fitted on the other folds, and the mean NLL of those out-of-fold
        calibrated probabilities is returned; ``None`` when a class has fewer bags than folds.

        ``z`` ``(N, D)`` are the bags' standardised features, ``labels`` ``(B,)`` in {0, 1}."""
        y = labels.to(torch.float64).cpu()
        fold = stratified_folds(y, folds)
        if fold is None:
            return None
        p_out = torch.empty(bags.num_bags, dtype=torch.float64)
        batch = BagBatch(z, bags.index, labels.to(z))
        for k in range(folds):
            fit_bags, out_bags = torch.nonzero(fold != k).flatten(), torch.nonzero(fold == k).flatten()
            fit, out = batch.select_bags(fit_bags), batch.select_bags(out_bags)  # each re-indexed 0..len-1
            _, decision = self.fit_decision(self.bag_posterior(fit.x, fit.bags), y[fit_bags])
            posterior = self.bag_posterior(out.x, out.bags)
            p_out[out_bags] = decision(posterior, self.likelihood.instance_link, self.generator(posterior.mean.device))[0].cpu()
        return log_loss(p_out, y)

    def records_metrics(self, records: list[dict]) -> dict[str, float]:
        """Validation/test metrics of the head's prediction records (:func:`records_metrics`)."""
        return records_metrics(records)

    def decision_summary(self) -> dict[str, Any] | None:
        """What the head decides with, for reports: rule (``repr`` of its object: the max with its
        reference length), whether calibrated, Platt slope and intercept."""
        return {"bag_rule": self.rule_name, "rule": repr(self.decision_rule_object()), "configured_bag_rule": self.bag_rule,
                "calibrated": self.calibrated, "calibration_slope": float(self.calibrator.slope),
                "calibration_intercept": float(self.calibrator.intercept)}

    # -- training steps and predictions ---------------------------------------------------------
    def fit_steps(
        self,
        z: Tensor,
        bags: Bags,
        bag_labels: Tensor,
        *,
        weights: Tensor | None = None,
        locals_: Any = None,
        rho: float = 1.0,
        rho_max: float = 1.0,
        reduce: Callable[[NaturalStatistics], NaturalStatistics] | None = None,
        reduce_value: Callable[[float], float] | None = None,
    ) -> Any:
        """The library's fit steps of the head's likelihood on a batch of standardised features ``z``
        ``(N, D)`` (detached for the natural step) with bag labels ``(B,)``:
        :class:`~milgp.variational.fit.ClosedFormSteps` (``locals_``: the batch's current locals,
        ``None`` to initialise them; ``reduce`` sums the statistics over DDP ranks). ``weights``,
        ``rho``, ``rho_max`` and ``reduce_value`` serve aggregate heads (populations, the adaptive
        full-batch step size, the data term's DDP sum)."""
        z = z.detach().to(torch.float64)
        return ClosedFormSteps(
            self.strategy, self.likelihood, BagBatch(z, bags.index, bag_labels.to(z)), chunk_size=max(1, len(z)),
            cache_bytes=math.inf, initial_locals=locals_, reduce=reduce,
        )

    @torch.no_grad()
    def predict(
        self, z: Tensor, bags: Bags, weights: Tensor | None = None, bag_targets: Tensor | None = None
    ) -> dict[str, Tensor | dict[str, Tensor]]:
        """Instance and bag predictions with uncertainty (the same keys on every head).

        Returns:
            ``"mean"``, ``"var"`` of ``q(f)`` and ``"instance"``, ``"instance_std"`` ``(N,)``; ``"bag"``,
            ``"bag_std"`` ``(B,)``; ``"bag_fields"``, further per-bag predictions ``(B,)`` by name.
            Here ``instance`` is ``p(y_n = 1)`` (the likelihood's :attr:`instance_link` moments),
            ``bag`` the calibrated probability of the head's bag decision (:meth:`decide`), and
            ``bag_fields`` holds ``outside_training`` (:meth:`outside_training`); ``weights`` and
            ``bag_targets`` serve aggregate heads.
        """
        z = z.to(torch.float64)
        posterior = self.bag_posterior(z, bags)
        out: dict[str, Any] = {"mean": posterior.mean, "var": posterior.var, "bag_fields": {"outside_training": self.outside_training(z, posterior.var, bags)}}
        out["instance"], out["instance_std"] = posterior.instance_moments(self.likelihood.instance_link)  # shared with a marginal bag rule
        out["bag"], out["bag_std"] = self.decide(posterior)
        return out
