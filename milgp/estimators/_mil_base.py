"""What the MIL classifiers share: validation, standardisation, inducing points, the kernel search
and the calibrated bag decision, and the prediction API.

**Fit.** Features are z-scored; ``M`` inducing points are placed by k-means++, half on instances of
positive bags and half on negative (as the VGPMIL reference code does). Each candidate kernel
(``kernel``, ``lengthscale``, ``outputscale``; by default a linear kernel and RBF kernels with
lengthscale ``√D`` and ``2√D``, each at outputscale 1 and 10) is fitted by closed-form coordinate
ascent (Algorithm 1 of Castro-Macías et al. 2024 without hyperparameter steps): the first from
scratch for ``max_iter`` sweeps, the others warm-started from its local variables for
``search_iter`` sweeps. The inner products ``Z xᵀ`` are computed once for all candidates
(:class:`~milgp.models.shared_gram.SharedGram`).

**Selection and calibration on out-of-bag predictions.** For each candidate the leave-one-bag-out
cavity predictive of every training bag (:func:`~milgp.variational.leave_bag_out.leave_bag_out_posterior`,
about one sweep) is scored by every candidate bag rule, a Platt calibration is fitted to each, and
the (kernel, rule, calibration) with the smallest out-of-bag negative log-likelihood is kept
(:func:`~milgp.prediction.bag_decision.fit_bag_decision`). No hyperparameter is learned by gradient
steps by default: on a few dozen bags that objective collapsed the kernel variance to a flat GP
(ucsb_breast_cancer: outputscale 0.007–0.08, every bag p = 1.000; docs/core.md).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Sequence

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.utils.validation import check_is_fitted

from milgp.data.bags import BagBatch, flatten_bags, split_by_bag
from milgp.estimators._validation import FeatureScaler, check_bags, check_binary_bag_labels, torch_dtype
from milgp.inducing import kmeans_pp_inducing
from milgp.likelihoods.base import AugmentedBagLikelihood
from milgp.models.shared_gram import SharedGram
from milgp.models.sparse_gp import KERNELS, SparseGP
from milgp.prediction import AUTO_BAG_RULES, BagCalibrator, BagDecision, BagPosterior, BagRule, fit_bag_decision, make_bag_rule
from milgp.variational.fit import FitResult, fit_closed_form
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
variances 1 and 10 span σ(±1) to σ(±3) at one prior standard deviation. The first is fitted from
scratch, the others warm-started from it. (Two more candidates — RBF 2√D and linear at variance
1 — were never chosen on the development data and cost a quarter of the fit; docs/core.md.)"""
SHARED_GRAM_MAX_ENTRIES = 50_000_000
"""The kernel search shares ``Z xᵀ`` (``M·N`` floats) across candidates up to this size."""


class MILClassifierBase(ClassifierMixin, BaseEstimator, ABC):
    """Base of :class:`VGPMILClassifier` and :class:`ProbitMILClassifier` (see the module docstring).

    Subclasses store their ``__init__`` arguments (scikit-learn style) and implement
    :meth:`_make_likelihood`; they may override :attr:`kernel_grid`, :meth:`_likelihood_variants`,
    :meth:`_after_fit` and :meth:`_bag_probability`.
    """

    kernel_grid: tuple[tuple[str, float, float], ...] = KERNEL_GRID
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
        if self.kernel != "auto" and self.kernel not in KERNELS:
            raise ValueError(f"kernel must be 'auto' or one of {KERNELS}, got {self.kernel!r}")
        for name in ("lengthscale", "outputscale"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be None (searched) or a positive number, got {value!r}")
        out: list[tuple[str, float, float]] = []
        for kind, factor, scale in self.kernel_grid:
            if self.kernel not in ("auto", kind):
                continue
            ls = 1.0 if kind == "linear" else float(self.lengthscale) if self.lengthscale is not None else factor * math.sqrt(dim)
            candidate = (kind, ls, float(self.outputscale) if self.outputscale is not None else scale)
            if candidate not in out:
                out.append(candidate)
        return out

    def _likelihood_variants(self) -> tuple[Any, ...]:
        """Variants of the likelihood to choose among at the first kernel (``(None,)``: one)."""
        return (None,)

    def _resolve_bag_size_cap(self, sizes: np.ndarray) -> float | None:
        """``bag_size_cap``: ``"median"`` → the median training bag size, a number as is, or ``None``."""
        cap = self.bag_size_cap
        if cap == "median":
            return float(np.median(sizes))
        if cap is None or (isinstance(cap, (int, float)) and cap >= 1):
            return None if cap is None else float(cap)
        raise ValueError(f"bag_size_cap must be 'median', None or a number >= 1, got {cap!r}")

    def _rule_candidates(self) -> Sequence[str | BagRule]:
        if isinstance(self.bag_rule, str) and self.bag_rule == "auto":
            return AUTO_BAG_RULES
        return (self._bag_rule_object(),)

    def _bag_rule_object(self) -> BagRule:
        return make_bag_rule(self.bag_rule)

    def fit(self, bags: Sequence[Any], y: Any) -> "MILClassifierBase":
        """Fit on ``bags`` (sequence of ``(n_b, d)`` arrays) with bag labels ``y`` ``(B,)`` in {0, 1}."""
        bags_np = check_bags(bags)
        y_np = check_binary_bag_labels(y, len(bags_np))
        rules = self._rule_candidates()  # an unknown bag_rule is refused here, before any fitting
        self.n_features_in_ = bags_np[0].shape[1]
        self.classes_ = np.array([0, 1])
        candidates = self._kernel_candidates(self.n_features_in_)
        batch, Z = self._prepare(bags_np, y_np)
        _, self.model_, self.likelihood_, self.fit_result_, decision = self._search(batch, Z, candidates, rules)
        if self.learn_hyperparameters:
            self._learn_hyperparameters(batch)
            heldout = leave_bag_out_posterior(self.model_, self.likelihood_, batch, self.fit_result_.locals)
            decision = fit_bag_decision(heldout, self.likelihood_.instance_link, batch.bag_labels, rules, self._generator(batch.x))
        if not self.calibrate:
            decision = BagDecision(decision.rule, BagCalibrator(), decision.heldout_nll, decision.candidates)
        self.decision_ = decision
        self.elbo_ = self.fit_result_.objective[-1]
        self._after_fit(batch)
        return self

    def _prepare(self, bags_np: list[np.ndarray], y_np: np.ndarray) -> tuple[BagBatch, torch.Tensor]:
        """The bag-size cap, the standardisation and the inducing points (both weighted by the cap),
        and the standardised training batch."""
        sizes = np.array([len(b) for b in bags_np])
        self.bag_size_cap_ = self._resolve_bag_size_cap(sizes)
        weights = np.repeat(np.minimum(1.0, self.bag_size_cap_ / sizes) if self.bag_size_cap_ else np.ones(len(sizes)), sizes)
        self.scaler_ = FeatureScaler(self.standardize).fit(np.concatenate(bags_np, 0), weights)
        x, bag_index = self._to_tensor(bags_np)
        batch = BagBatch(x, bag_index, torch.as_tensor(y_np, dtype=x.dtype, device=self.device))
        x_np = x.detach().cpu().numpy()
        Z = kmeans_pp_inducing(
            x_np, y_np[bag_index.cpu().numpy()], min(self.num_inducing, len(x_np)), seed=self.random_state, weights=weights
        )
        return batch, torch.as_tensor(Z, dtype=x.dtype, device=self.device)

    def _generator(self, x: torch.Tensor) -> torch.Generator:
        return torch.Generator(device=x.device).manual_seed(self.random_state)

    def _search(
        self, batch: BagBatch, Z: torch.Tensor, candidates: list[tuple[str, float, float]], rules: Sequence[str | BagRule]
    ) -> tuple[float, SparseGP, AugmentedBagLikelihood, FitResult, BagDecision]:
        """Fit every candidate kernel (the first from scratch, the others warm-started from the local
        variables of the best fit at the first kernel), score each by its out-of-bag decision, and
        return the best ``(NLL, model, likelihood, fit, decision)``; every fit is recorded in
        :attr:`search_`. With several likelihood variants (e.g. VGPMIL's π rules) each is fitted at
        the first kernel and the best one is used for the other kernels."""
        share = not self.learn_inducing_locations and not self.ard and Z.shape[0] * batch.num_instances <= SHARED_GRAM_MAX_ENTRIES
        gram = SharedGram(Z, batch.x) if share else None
        generator = self._generator(batch.x)
        self.search_: list[dict[str, Any]] = []
        best = None
        warm = None
        variants = self._likelihood_variants()
        # the likelihood variant is chosen at the first kernel, then the kernels with that variant
        plan = [(candidates[0], v) for v in variants] + [(c, None) for c in candidates[1:]]
        chosen_variant = variants[0]
        for i, ((kind, ls, scale), variant) in enumerate(plan):
            variant = chosen_variant if i >= len(variants) else variant
            model = SparseGP(
                Z, kernel=kind, lengthscale=ls, outputscale=scale, ard=self.ard, learn_inducing_locations=self.learn_inducing_locations
            ).to(self.device)
            likelihood = self._make_likelihood(variant)
            likelihood.bag_size_cap = self.bag_size_cap_
            projection = gram.projection(model) if gram is not None else None
            result = fit_closed_form(
                model, likelihood, batch,
                max_iter=max(1, self.max_iter if i == 0 else self.search_iter), tol=self.tol, learn_hyperparameters=False,
                initial_locals=warm, projection=projection, bags_per_batch=self.bags_per_batch, seed=self.random_state,
                progress=self.verbose,
            )
            if len(plan) == 1 and len(rules) == 1 and not self.calibrate:  # nothing to choose or fit
                decision = BagDecision(make_bag_rule(rules[0]), BagCalibrator(), float("nan"), {})
            else:
                heldout = leave_bag_out_posterior(model, likelihood, batch, result.locals, projection=projection, moments=result.moments)
                decision = fit_bag_decision(heldout, likelihood.instance_link, batch.bag_labels, rules, generator)
            self.search_.append(
                {"kernel": kind, "lengthscale": ls if kind == "rbf" else None, "outputscale": scale, "likelihood": variant,
                 "heldout_nll": decision.heldout_nll, "rule": repr(decision.rule), "iterations": result.iterations}
            )
            if best is None or decision.heldout_nll < best[0]:
                best = (decision.heldout_nll, model, likelihood, result, decision)
            if i == 0 or (i < len(variants) and best[2] is likelihood):
                warm, chosen_variant = result.locals, variant
        return best

    def _learn_hyperparameters(self, batch: BagBatch) -> None:
        """Adam steps on the kernel (on the objective of :meth:`hyperparameter_terms`) alternating
        with the natural steps, from the chosen kernel and its local variables (Algorithm 1)."""
        main = fit_closed_form(
            self.model_, self.likelihood_, batch, max_iter=self.max_iter, tol=self.tol, learn_hyperparameters=True,
            lr=self.lr, hyper_steps=self.hyper_steps, initial_locals=self.fit_result_.locals,
            bags_per_batch=self.bags_per_batch, seed=self.random_state, progress=self.verbose,
        )
        main.elbo = self.fit_result_.elbo + main.elbo
        main.iterations += self.fit_result_.iterations
        main.seconds += self.fit_result_.seconds
        self.fit_result_ = main

    # -- data --------------------------------------------------------------------------------------
    def _to_tensor(self, bags: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        x, bag_index = flatten_bags(bags)
        x = self.scaler_.transform(x.to(dtype=torch_dtype(self.dtype), device=self.device))
        return x, bag_index.to(self.device)

    def _posterior(self, bags: Sequence[Any]) -> tuple[torch.Tensor, BagPosterior]:
        check_is_fitted(self, "model_")
        bags_np = check_bags(bags)
        if bags_np[0].shape[1] != self.n_features_in_:
            raise ValueError(f"bags have {bags_np[0].shape[1]} features, the model was fitted on {self.n_features_in_}")
        x, bag_index = self._to_tensor(bags_np)
        return x, BagPosterior.from_model(self.model_, x, bag_index, len(bags_np))

    # -- predictions ---------------------------------------------------------------------------------
    def _bag_probability(self, x: torch.Tensor, posterior: BagPosterior) -> tuple[torch.Tensor, torch.Tensor]:
        """Calibrated bag probability and std ``(B,)`` by the chosen decision."""
        return self.decision_(posterior, self.likelihood_.instance_link, self._generator(x))

    def predict_bag_proba(self, bags: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        """Positive-bag probability and its standard deviation, each ``(B,)``: the chosen bag rule,
        calibrated on out-of-bag predictions of the training bags (:attr:`decision_`)."""
        x, posterior = self._posterior(bags)
        with torch.no_grad():
            p, s = self._bag_probability(x, posterior)
        return p.cpu().numpy(), s.cpu().numpy()

    def predict_proba(self, bags: Sequence[Any]) -> np.ndarray:
        """``(B, 2)`` calibrated bag class probabilities."""
        p = self.predict_bag_proba(bags)[0]
        return np.stack([1 - p, p], 1)

    def predict(self, bags: Sequence[Any]) -> np.ndarray:
        """Bag labels ``(B,)``: 1 where the calibrated positive-bag probability exceeds ½."""
        return (self.predict_proba(bags)[:, 1] > 0.5).astype(int)

    def _instance_moments(self, x: torch.Tensor, posterior: BagPosterior) -> tuple[torch.Tensor, torch.Tensor]:
        return self.likelihood_.instance_link.moments(posterior.mean, posterior.var)

    def predict_instance_proba(self, bags: Sequence[Any], return_std: bool = False) -> list[np.ndarray] | tuple[list[np.ndarray], list[np.ndarray]]:
        """Per-bag lists of instance probabilities ``(n_b,)`` (and their stds): the model's own
        ``E[p(y=1|f*)]`` (not recalibrated)."""
        x, posterior = self._posterior(bags)
        with torch.no_grad():
            p, s = self._instance_moments(x, posterior)
        probs = [t.cpu().numpy() for t in split_by_bag(p, posterior.bag_index, posterior.num_bags)]
        if not return_std:
            return probs
        return probs, [t.cpu().numpy() for t in split_by_bag(s, posterior.bag_index, posterior.num_bags)]
