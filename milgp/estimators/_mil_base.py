"""What the MIL classifiers share: validation, standardisation, inducing points, the kernel search,
the calibrated and averaged bag decision, and the prediction API.

**Fit.** Features are z-scored and the inducing points placed by
:func:`~milgp.inducing.mil_inducing` (k-means++, half on instances of positive bags and half on
negative, as the VGPMIL reference code; on features wider than ``M`` a share ``bag_mean_inducing``
at the bags' mean instances). The ``(kernel, likelihood variant)`` pairs of
:meth:`MILClassifierBase._plan` (by default over :data:`KERNEL_GRID`) are fitted by closed-form
coordinate ascent (Algorithm 1 of Castro-Macías et al. 2024 without hyperparameter steps): the
first from scratch for ``max_iter`` sweeps, the others warm-started from its local variables for
``search_iter`` sweeps, all sharing the inner products ``Z xᵀ``
(:class:`~milgp.models.shared_gram.SharedGram`); linear kernels on features narrower than ``M``
sit on the points of :meth:`MILClassifierBase._inducing_for`. No hyperparameter is learned by
gradient steps by default: on a few dozen bags that collapses the kernel (docs/core.md, cause 1).

**Out-of-bag scores, calibration and averaging.** For each fit the leave-one-bag-out cavity
predictive of every training bag (:func:`~milgp.variational.leave_bag_out.leave_bag_out_posterior`,
about one sweep) is scored by every candidate bag rule, with a Platt calibration fitted to each
(:func:`~milgp.prediction.bag_decision.score_bag_rules`). The (fit, rule) candidates are then
averaged with pseudo-BMA+ weights from their out-of-bag likelihoods
(:class:`~milgp.prediction.model_average.ModelAverage`); ``average=False`` keeps the one with the
smallest out-of-bag negative log-likelihood.

**Instance probabilities.** The averaged instance score is mapped to the MIL fits' posterior
instance labels ``q(y_n = 1)`` (weighted as the bag decision's candidates are) by
:class:`~milgp.prediction.InstanceCalibrator` (why: :mod:`milgp.prediction.instance_calibration`).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Sequence

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.utils.validation import check_is_fitted

from milgp.data.bags import BagBatch, Bags, flatten_bags, split_by_bag
from milgp.estimators._validation import (
    FeatureScaler, check_bags, check_binary_bag_labels, check_positive, check_seed, check_settings, keeps_state_on_error,
    torch_dtype,
)
from milgp.inducing import linear_span_inducing, mil_inducing
from milgp.likelihoods.base import AugmentedBagLikelihood
from milgp.models.shared_gram import SharedGram
from milgp.models.sparse_gp import SparseGP
from milgp.prediction import (
    BAG_RULES,
    AveragedFit,
    BagCalibrator,
    BagDecision,
    BagRule,
    InstanceCalibrator,
    ModelAverage,
    auto_bag_rules,
    best_decision,
    make_bag_rule,
    score_bag_rules,
)
from milgp.variational.fit import fit_closed_form
from milgp.variational.fit_result import FitResult
from milgp.variational.leave_bag_out import leave_bag_out_posterior

__all__ = ["MILClassifierBase"]

KERNEL_GRID: tuple[tuple[str, float, float], ...] = (
    ("rbf", 1.0, 1.0),
    ("rbf", 1.0, 10.0),
    ("rbf", 2.0, 10.0),
    ("linear", 1.0, 10.0),
)
"""The candidate kernels ``(kernel, lengthscale in units of √D, variance)``. ``√D`` is the scale of
distances between z-scored ``D``-dimensional instances (the reference code's fixed lengthscale);
variances 1 and 10 span σ(±1) to σ(±3) at one prior standard deviation (docs/core.md, cause 1)."""
SHARED_GRAM_MAX_ENTRIES = 50_000_000
"""The kernel search shares ``Z xᵀ`` (``M·N`` floats) across candidates up to this size."""
FLAGS = ("calibrate", "average", "standardize", "learn_hyperparameters", "ard", "learn_inducing_locations", "verbose")
"""The True/False settings of the MIL classifiers."""


class CandidateFit(NamedTuple):
    """One fitted candidate of the search: a model and likelihood at one kernel and π rule, the
    fit's result, one bag rule's decision scored on out-of-bag predictions, and whether the
    likelihood is single-instance learning (whose instance probability is that of the bag's label)."""

    model: SparseGP
    likelihood: AugmentedBagLikelihood
    fit: FitResult
    decision: BagDecision
    single_instance: bool


@dataclass(eq=False, repr=False, kw_only=True)  # a scikit-learn __init__ (stores the settings as given); BaseEstimator's repr
class MILClassifierBase(ClassifierMixin, BaseEstimator, ABC):
    """Base of :class:`VGPMILClassifier` and :class:`ProbitMILClassifier` (see the module docstring).

    Its fields are the ``__init__`` arguments both classifiers share (documented at
    :class:`VGPMILClassifier`); subclasses, dataclasses too, add their own and implement
    :meth:`_make_likelihood`; they may override :attr:`kernel_grid`, :meth:`_likelihood_variants`,
    :meth:`_after_fit` and :meth:`_bag_probability`.
    """

    num_inducing: int = 100
    bag_mean_inducing: float = 0.25
    bag_size_cap: float | str | None = "median"
    bag_rule: str | BagRule = "auto"
    calibrate: bool = True
    average: bool = True
    kernel: str = "auto"
    lengthscale: float | None = None
    outputscale: float | None = None
    max_iter: int = 24
    search_iter: int = 8
    tol: float = 1e-4
    learn_hyperparameters: bool = False
    lr: float = 0.05
    hyper_steps: int = 5
    ard: bool = False
    learn_inducing_locations: bool = False
    standardize: bool = True
    bags_per_batch: int | None = None
    dtype: str = "float64"
    device: str = "cpu"
    random_state: int | np.random.RandomState | np.random.Generator | None = 0
    verbose: bool = False

    kernel_grid: ClassVar[tuple[tuple[str, float, float], ...]] = KERNEL_GRID
    """The candidate kernels of the search (:data:`KERNEL_GRID` for the logistic models)."""

    # -- what subclasses provide -----------------------------------------------------------------
    @abstractmethod
    def _make_likelihood(self, variant: Any = None) -> AugmentedBagLikelihood:
        """A fresh likelihood for one candidate fit (``variant``: one of :meth:`_likelihood_variants`)."""

    def _after_fit(self, batch: BagBatch) -> None:
        """Hook after the kernel and the bag decision are chosen (e.g. a Gibbs sampler)."""

    # -- fit ---------------------------------------------------------------------------------------
    def _kernel_candidates(self, dim: int) -> list[tuple[str, float, float]]:
        """``(kernel, lengthscale, outputscale)`` candidates from :data:`KERNEL_GRID`; ``kernel``,
        ``lengthscale`` or ``outputscale`` given fix that axis."""
        kinds = tuple(dict.fromkeys(kind for kind, _, _ in self.kernel_grid))
        if self.kernel != "auto" and self.kernel not in kinds:
            raise ValueError(f"kernel must be 'auto' or one of {kinds}, got {self.kernel!r}")
        lengthscale = check_positive("lengthscale", self.lengthscale, none="searched")
        outputscale = check_positive("outputscale", self.outputscale, none="searched")
        out: list[tuple[str, float, float]] = []
        for kind, factor, scale in self.kernel_grid:
            if self.kernel not in ("auto", kind):
                continue
            ls = 1.0 if kind != "rbf" else lengthscale if lengthscale is not None else factor * math.sqrt(dim)
            out.append((kind, ls, outputscale if outputscale is not None else scale))
        return list(dict.fromkeys(out))  # in grid order, each candidate once

    def _likelihood_variants(self) -> tuple[Any, ...]:
        """Variants of the likelihood to choose among at the first kernel (``(None,)``: one)."""
        return (None,)

    def _plan(self, candidates: list[tuple[str, float, float]]) -> list[tuple[tuple[str, float, float], Any]]:
        """The ``(kernel, likelihood variant)`` pairs the search fits, in order (the first is fitted
        from scratch and warm-starts the others): every variant at every candidate kernel, except
        that single-instance learning (the variant ``"single"`` of both classifiers) is fitted only
        at the most flexible kernels, the largest prior variance and, for RBF, the shortest
        lengthscale among the candidates (docs/core.md, cause 9), with an intercept in its linear
        kernel (``"affine"``, ``s² (xᵀx'/D + 1)``): a zero-mean linear latent on z-scored features
        cannot represent the base rate of instances labelled with their bag's label (cause 7)."""
        largest_variance = max(c[2] for c in candidates)
        shortest = min((c[1] for c in candidates if c[0] == "rbf"), default=math.inf)
        flexible = [c for c in candidates if c[2] == largest_variance and (c[0] != "rbf" or c[1] == shortest)]
        plan = []
        for v in self._likelihood_variants():
            if v != "single":
                plan += [(c, v) for c in candidates]
            else:
                plan += [(("affine", *c[1:]) if c[0] == "linear" else c, v) for c in flexible]
        return plan

    def _resolve_bag_size_cap(self, sizes: np.ndarray) -> float | None:
        """``bag_size_cap``: ``"median"`` → the median training bag size, a number as is, or ``None``."""
        cap = self.bag_size_cap
        if cap == "median":
            return float(np.median(sizes))
        if cap is None or (isinstance(cap, (int, float)) and cap >= 1):
            return None if cap is None else float(cap)
        raise ValueError(f"bag_size_cap must be 'median', None or a number >= 1, got {cap!r}")

    def _rule_candidates(self, sizes: np.ndarray) -> Sequence[str | BagRule]:
        """The bag rules to score on the training bags of ``sizes`` instances (``"auto"``:
        :func:`~milgp.prediction.bag_decision.auto_bag_rules`)."""
        if isinstance(self.bag_rule, str) and self.bag_rule == "auto":
            return auto_bag_rules(torch.as_tensor(sizes))
        if isinstance(self.bag_rule, str) and self.bag_rule not in (*BAG_RULES, "joint"):
            raise ValueError(f"bag_rule must be 'auto', one of {sorted(BAG_RULES)} or a BagRule instance, got {self.bag_rule!r}")
        return (self._bag_rule_object(),)

    def _bag_rule_object(self) -> BagRule:
        return make_bag_rule(self.bag_rule)

    def _averages(self) -> bool:
        """Whether the candidates are averaged (``average``) rather than the best one kept."""
        return bool(self.average)

    @keeps_state_on_error
    def fit(self, bags: Sequence[Any], y: Any) -> "MILClassifierBase":
        """Fit on ``bags`` (sequence of ``(n_b, d)`` arrays) with bag labels ``y`` ``(B,)``: 0/1, −1/1 or booleans (1 = positive)."""
        check_settings(self, FLAGS, {"num_inducing": 1, "max_iter": 1, "search_iter": 1, "hyper_steps": 0})
        # what the fitted state lives in: predictions use these, whatever set_params changes later
        self.dtype_, self.device_ = torch_dtype(self.dtype), torch.device(self.device)
        bags_np = check_bags(bags)
        y_np = check_binary_bag_labels(y, len(bags_np))
        self.seed_ = check_seed(self.random_state)
        rules = self._rule_candidates(np.array([len(b) for b in bags_np]))  # an unknown bag_rule is refused here, before any fitting
        self.n_features_in_ = bags_np[0].shape[1]
        self.classes_ = np.unique(np.asarray(y))  # the negative label (0, −1 or False), then the positive
        plan = self._plan(self._kernel_candidates(self.n_features_in_))  # unknown settings refused here too
        batch, Z = self._prepare(bags_np, y_np)
        fits = self._search(batch, Z, plan, rules)
        if self.learn_hyperparameters:
            best = min(fits, key=lambda c: c.decision.heldout_nll)
            # Adam steps on the kernel (on the objective of hyperparameter_terms) alternating with the
            # natural steps, from the best candidate and its local variables (Algorithm 1)
            self.fit_result_ = fit_closed_form(
                best.model, best.likelihood, batch, max_iter=self.max_iter, tol=self.tol, learn_hyperparameters=True,
                lr=self.lr, hyper_steps=self.hyper_steps, initial_locals=best.fit.locals,
                bags_per_batch=self.bags_per_batch, seed=self.seed_, progress=self.verbose,
            ).after(best.fit)
            heldout = leave_bag_out_posterior(best.model, best.likelihood, batch, self.fit_result_.locals)
            scored = score_bag_rules(heldout, best.likelihood.instance_link, batch.bag_labels, rules, self._generator(batch.x), self.calibrate)
            self.ensemble_ = ModelAverage([AveragedFit(best.model, best.likelihood, best_decision(scored), 1.0)])
        else:
            self.ensemble_ = self._average(fits, batch.bag_labels)
            self.fit_result_ = next(c.fit for c in fits if c.model is self.ensemble_.top.model)
        self.instance_calibrator_ = self._instance_calibration(fits, batch)
        top = self.ensemble_.top
        self.model_, self.likelihood_, self.decision_ = top.model, top.likelihood, top.decision
        self.elbo_ = self.fit_result_.objective[-1]
        self._after_fit(batch)
        return self

    def _average(self, fits: list[CandidateFit], labels: torch.Tensor) -> ModelAverage:
        """``fits`` averaged with pseudo-BMA+ weights (``average``, more than one candidate), or the
        one with the smallest out-of-bag NLL."""
        if self._averages() and len(fits) > 1:
            return ModelAverage.from_candidates([(c.model, c.likelihood, c.decision) for c in fits], labels, self.seed_)
        best = min(fits, key=lambda c: c.decision.heldout_nll)
        return ModelAverage([AveragedFit(best.model, best.likelihood, best.decision, 1.0)])

    def _instance_calibration(self, fits: list[CandidateFit], batch: BagBatch) -> InstanceCalibrator | None:
        """The map of the module docstring's "Instance probabilities"; ``None`` where no fit is a
        MIL fit. The MIL fits are weighted (or the best kept) as the bag decision's candidates are."""
        mil = [c for c in fits if not c.single_instance]
        if not mil:
            return None
        target = self._average(mil, batch.bag_labels)
        results = {id(c.model): c.fit for c in fits}  # q(f) and the locals at the training instances
        if self.learn_hyperparameters:
            results[id(self.ensemble_.top.model)] = self.fit_result_
        marginals = {k: r.moments for k, r in results.items()}
        with torch.no_grad():
            score = self.ensemble_.instance_moments(batch.x, marginals)[0]
            labels = sum(
                m.weight * m.likelihood.instance_label_posterior(*marginals[id(m.model)], batch.bags, batch.bag_labels, results[id(m.model)].locals)
                for m in target.members
            )
            return InstanceCalibrator().fit(score, labels)

    def _prepare(self, bags_np: list[np.ndarray], y_np: np.ndarray) -> tuple[BagBatch, torch.Tensor]:
        """The bag-size cap, the standardisation and the inducing points (both weighted by the cap),
        and the standardised training batch."""
        sizes = np.array([len(b) for b in bags_np])
        self.bag_size_cap_ = self._resolve_bag_size_cap(sizes)
        weights = np.repeat(np.minimum(1.0, self.bag_size_cap_ / sizes) if self.bag_size_cap_ else np.ones(len(sizes)), sizes)
        self.scaler_ = FeatureScaler(self.standardize).fit(np.concatenate(bags_np, 0), weights)
        x, bag_index = self._to_tensor(bags_np)
        batch = BagBatch(x, bag_index, torch.as_tensor(y_np, dtype=x.dtype, device=self.device))
        index_np = bag_index.cpu().numpy()
        Z = mil_inducing(
            x.detach().cpu().numpy(), index_np, y_np[index_np], self.num_inducing, self.bag_mean_inducing,
            seed=self.seed_, weights=weights,
        )
        return batch, torch.as_tensor(Z, dtype=x.dtype, device=self.device)

    def _generator(self, x: torch.Tensor) -> torch.Generator:
        return torch.Generator(device=x.device).manual_seed(self.seed_)

    def _search(
        self, batch: BagBatch, Z: torch.Tensor, plan: list[tuple[Any, Any]], rules: Sequence[str | BagRule]
    ) -> list[CandidateFit]:
        """Fit the ``(kernel, likelihood variant)`` pairs ``plan`` of :meth:`_plan` (module docstring) and
        score every bag rule of each on its out-of-bag predictions. Returns one :class:`CandidateFit`
        per fit and rule; every fit is recorded in :attr:`search_` with its best rule."""
        share = not self.learn_inducing_locations and not self.ard and Z.shape[0] * batch.num_instances <= SHARED_GRAM_MAX_ENTRIES
        points = {kind: self._inducing_for(kind, Z) for (kind, _, _), _ in plan}
        distinct = {id(Zk): Zk for Zk in points.values()}
        grams = {key: SharedGram(Zk, batch.x) for key, Zk in distinct.items()} if share else {}
        generator = self._generator(batch.x)
        self.search_: list[dict[str, Any]] = []
        fits: list[CandidateFit] = []
        projections: dict[tuple[str, float, float], Any] = {}
        warm = None
        for i, ((kind, ls, scale), variant) in enumerate(plan):
            model = SparseGP(
                points[kind], kernel=kind, lengthscale=ls, outputscale=scale, ard=self.ard,
                learn_inducing_locations=self.learn_inducing_locations,
            ).to(self.device)
            likelihood = self._make_likelihood(variant)
            likelihood.bag_size_cap = self.bag_size_cap_
            if share and (kind, ls, scale) not in projections:  # one per kernel, shared by the variants
                projections[(kind, ls, scale)] = grams[id(points[kind])].projection(model)
            projection = projections.get((kind, ls, scale))
            result = fit_closed_form(
                model, likelihood, batch,
                max_iter=max(1, self.max_iter if i == 0 else self.search_iter), tol=self.tol, learn_hyperparameters=False,
                initial_locals=warm, projection=projection, bags_per_batch=self.bags_per_batch, seed=self.seed_,
                progress=self.verbose,
            )
            if i == 0:
                warm = result.locals
            if len(plan) == 1 and len(rules) == 1 and not self.calibrate:  # nothing to choose or fit
                scored = [BagDecision(make_bag_rule(rules[0]), BagCalibrator(), float("nan"), {})]
            else:
                heldout = leave_bag_out_posterior(model, likelihood, batch, result.locals, projection=projection, moments=result.moments)
                scored = score_bag_rules(heldout, likelihood.instance_link, batch.bag_labels, rules, generator, self.calibrate)
            best = best_decision(scored)
            self.search_.append(
                {"kernel": kind, "lengthscale": ls if kind == "rbf" else None, "outputscale": scale, "likelihood": variant,
                 "heldout_nll": best.heldout_nll, "rule": repr(best.rule), "iterations": result.iterations}
            )
            fits.extend(CandidateFit(model, likelihood, result, d, variant == "single") for d in scored)
        return fits

    def _inducing_for(self, kind: str, Z: torch.Tensor) -> torch.Tensor:
        """``Z``, or for a linear or affine kernel on fewer features (plus one for the intercept)
        than ``M`` the points of :func:`~milgp.inducing.linear_span_inducing`: the same exact linear
        model, for a fraction of the work."""
        dim, affine = Z.shape[1], kind == "affine"
        if kind not in ("linear", "affine") or self.learn_inducing_locations or dim + affine >= Z.shape[0]:
            return Z
        return torch.as_tensor(linear_span_inducing(dim, affine), dtype=Z.dtype, device=Z.device)

    # -- data --------------------------------------------------------------------------------------
    def _to_tensor(self, bags: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        x, bag_index = flatten_bags(bags)
        bag_index = bag_index.to(self.device_)
        return self.scaler_.transform(x.to(device=self.device_), bag_index, self.dtype_), bag_index

    def _features(self, bags: Sequence[Any]) -> tuple[torch.Tensor, Bags]:
        """Standardised instances ``(N, D)`` and their :class:`Bags`."""
        check_is_fitted(self, "ensemble_")
        bags_np = check_bags(bags, n_features=self.n_features_in_)
        x, bag_index = self._to_tensor(bags_np)
        return x, Bags(bag_index, len(bags_np))

    # -- predictions ---------------------------------------------------------------------------------
    def _bag_probability(self, x: torch.Tensor, bags: Bags) -> tuple[torch.Tensor, torch.Tensor]:
        """Calibrated bag probability and std ``(B,)``: the weighted candidates (:attr:`ensemble_`)."""
        return self.ensemble_.bag_probability(x, bags, self._generator(x))

    def predict_bag_proba(self, bags: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        """Positive-bag probability and its standard deviation, each ``(B,)``: each candidate's bag
        rule, calibrated on out-of-bag predictions of the training bags, averaged with the
        candidates' weights (:attr:`ensemble_`)."""
        x, bag_struct = self._features(bags)
        with torch.no_grad():
            p, s = self._bag_probability(x, bag_struct)
        return p.cpu().numpy(), s.cpu().numpy()

    def predict_proba(self, bags: Sequence[Any]) -> np.ndarray:
        """``(B, 2)`` calibrated bag class probabilities."""
        p = self.predict_bag_proba(bags)[0]
        return np.stack([1 - p, p], 1)

    def predict(self, bags: Sequence[Any]) -> np.ndarray:
        """Bag labels ``(B,)`` in the labels of the training set (:attr:`classes_`): the positive one
        where the calibrated positive-bag probability exceeds ½."""
        positive = self.predict_proba(bags)[:, 1] > 0.5
        return self.classes_[positive.astype(int)]

    def _instance_moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p, s = self.ensemble_.instance_moments(x)
        return (p, s) if self.instance_calibrator_ is None else self.instance_calibrator_(p, s)

    def predict_instance_proba(self, bags: Sequence[Any], return_std: bool = False) -> list[np.ndarray] | tuple[list[np.ndarray], list[np.ndarray]]:
        """Per-bag lists of instance probabilities ``(n_b,)`` (and their stds): the models' own
        ``E[p(y=1|f*)]`` averaged with the candidates' weights, mapped to the MIL fits' posterior
        instance labels (:attr:`instance_calibrator_`, :meth:`_instance_calibration`)."""
        x, bag_struct = self._features(bags)
        with torch.no_grad():
            p, s = self._instance_moments(x)
        probs = [t.cpu().numpy() for t in split_by_bag(p, bag_struct.index, bag_struct.num_bags)]
        if not return_std:
            return probs
        return probs, [t.cpu().numpy() for t in split_by_bag(s, bag_struct.index, bag_struct.num_bags)]
