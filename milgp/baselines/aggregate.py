"""Aggregate-output baselines of Law et al. 2018, Appendix B.

* :class:`ConstantRateRegressor` — "constant": the rate is constant within a bag,
  ``λ̂_i^a = y_a / p_a`` (``p_a = Σ_i p_i``); outside the training bags the pooled rate
  ``Σ_a y_a / Σ_a p_a``. It uses no covariates.
* :class:`BagPixelRegressor` — "bag-pixel": one pseudo-individual per bag at the population-weighted
  mean covariate ``x̄_a = Σ_i (p_i/p_a) x_i`` with population ``p_a``, i.e. the individual model
  ``y_a ~ p(y | p_a Ψ(f(x̄_a)))`` fitted at the bag level, then applied to individuals. It is exactly
  a :class:`~milgp.estimators.VBAggRegressor` on bags of size one, so the comparison isolates the
  effect of modelling individuals during training.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_is_fitted

from milgp.estimators import VBAggRegressor, check_bag_weights, check_bags

__all__ = ["BagPixelRegressor", "ConstantRateRegressor"]


def _bags_and_weights(bags: Sequence[Any], weights: Sequence[Any] | None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    bags_np = check_bags(bags)
    return bags_np, check_bag_weights(weights, bags_np)


class ConstantRateRegressor(RegressorMixin, BaseEstimator):
    """Constant rate per bag (Law et al. 2018, Appendix B, "Constant")."""

    def fit(self, bags: Sequence[Any], y: Any, weights: Sequence[Any] | None = None) -> "ConstantRateRegressor":
        bags_np, w = _bags_and_weights(bags, weights)
        y = np.asarray(y, dtype=np.float64)
        if y.shape != (len(bags_np),):
            raise ValueError(f"y must have one target per bag ({len(bags_np)}), got shape {y.shape}")
        if not np.isfinite(y).all():
            raise ValueError(f"bag {int(np.nonzero(~np.isfinite(y))[0][0])} has a NaN/inf target")
        pops = np.array([wb.sum() for wb in w])
        self.bag_rates_ = y / pops
        self.rate_ = float(y.sum() / pops.sum())
        self.n_features_in_ = bags_np[0].shape[1]
        return self

    def predict(self, X: Any) -> np.ndarray:
        """The pooled rate for individuals of unseen bags ``(n,)``."""
        check_is_fitted(self, "rate_")
        return np.full(len(np.asarray(X)), self.rate_)

    def predict_in_bags(self, bags: Sequence[Any] | None = None) -> list[np.ndarray]:
        """Per-bag individual rates ``y_a / p_a`` for the training bags (in their order)."""
        check_is_fitted(self, "bag_rates_")
        if bags is None or len(bags) != len(self.bag_rates_):
            raise ValueError("predict_in_bags needs the training bags (one rate per training bag)")
        return [np.full(len(b), r) for b, r in zip(bags, self.bag_rates_)]

    def predict_bags(self, bags: Sequence[Any], weights: Sequence[Any] | None = None) -> dict[str, np.ndarray]:
        """Bag means ``p_a · rate`` (pooled rate) as ``{"y_mean": (B,)}``."""
        bags_np, w = _bags_and_weights(bags, weights)
        return {"y_mean": np.array([self.rate_ * wb.sum() for wb in w])}


class BagPixelRegressor(RegressorMixin, BaseEstimator):
    """"bag-pixel" (Law et al. 2018, Appendix B): a VBAgg model trained on one weighted-mean covariate per
    bag, its kernel learned on the ELBO as in the paper (unit initial variance). Keyword arguments
    are those of :class:`~milgp.estimators.VBAggRegressor`."""

    def __init__(self, likelihood: str = "poisson", link: str | None = None, num_inducing: int = 50, max_iter: int = 100, random_state: int = 0):
        self.likelihood = likelihood
        self.link = link
        self.num_inducing = num_inducing
        self.max_iter = max_iter
        self.random_state = random_state

    @staticmethod
    def pseudo_individuals(bags: Sequence[Any], weights: Sequence[Any] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``x̄_a`` ``(B, d)`` and the bag populations ``p_a`` ``(B,)``."""
        bags_np, w = _bags_and_weights(bags, weights)
        xbar = np.stack([(wb[:, None] * b).sum(0) / wb.sum() for b, wb in zip(bags_np, w)])
        return xbar, np.array([wb.sum() for wb in w])

    def fit(self, bags: Sequence[Any], y: Any, weights: Sequence[Any] | None = None) -> "BagPixelRegressor":
        xbar, pops = self.pseudo_individuals(bags, weights)
        self.model_ = VBAggRegressor(
            likelihood=self.likelihood, link=self.link, num_inducing=min(self.num_inducing, len(xbar)),
            max_iter=self.max_iter, outputscale=1.0, learn_hyperparameters=True,
            hyper_max_instances=len(xbar), random_state=self.random_state,
        ).fit([x[None, :] for x in xbar], y, [np.array([p]) for p in pops])
        self.n_features_in_ = xbar.shape[1]
        return self

    def predict(self, X: Any) -> np.ndarray:
        check_is_fitted(self, "model_")
        return self.model_.predict(X)

    def predict_quantiles(self, X: Any, q: Any) -> np.ndarray:
        check_is_fitted(self, "model_")
        return self.model_.predict_quantiles(X, q)

    def predict_bags(self, bags: Sequence[Any], weights: Sequence[Any] | None = None) -> dict[str, np.ndarray]:
        check_is_fitted(self, "model_")
        return self.model_.predict_bags(bags, weights)
