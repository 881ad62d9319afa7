"""VBAgg: individual-level GP regression from bag-level aggregate outputs."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.metrics import r2_score
from sklearn.model_selection import KFold
from sklearn.utils.validation import check_is_fitted

from milgp.data.bags import BagBatch, Bags, bag_index_from_sizes, flatten_bags
from milgp.estimators._validation import (
    FeatureScaler, as_float_array, check_bag_weights, check_bags, check_positive, check_seed, check_settings, keeps_state_on_error,
    torch_dtype,
)
from milgp.inducing import kmeans_pp_inducing, median_lengthscale
from milgp.likelihoods.aggregate_exponential import ExponentialAggregateLikelihood
from milgp.likelihoods.aggregate_normal import NormalAggregateLikelihood
from milgp.likelihoods.aggregate_poisson import PoissonAggregateLikelihood
from milgp.models.sparse_gp import SparseGP
from milgp.variational.aggregate_fit import fit_aggregate, predict_bag_moments

__all__ = ["VBAggRegressor", "target_scale"]

SEARCH_OUTPUTSCALES = (0.3, 1.0, 3.0, 10.0)
"""Kernel variances ``outputscale=None`` chooses among (Normal model: in units of ``target_scale_²``)."""
SEARCH_NOISES = (1.0, 0.3, 0.1, 0.03, 0.01)
"""Initial Normal noise τ ``noise=None`` chooses among, in units of ``target_scale_²``."""
CV_FOLDS = 3
"""Folds (over bags) of the cross-validation that chooses the kernel variance."""
_VBAGG_DEFAULT_LINK = {"poisson": "exp", "normal": "identity", "exponential": "exp"}
"""The link of each likelihood when ``link=None``."""


@dataclass(eq=False, repr=False)  # only for its __init__, which stores the parameters as given (scikit-learn); repr stays BaseEstimator's
class VBAggRegressor(RegressorMixin, BaseEstimator):
    """VBAgg: individual-level GP regression from bag-level aggregate outputs (Law et al., *Variational
    Learning on Aggregate Outputs with Gaussian Processes*, NeurIPS 2018).

    ``y_a ~ p(y | η_a)``, ``η_a = Σ_{i∈a} w_i Ψ(f(x_i))`` with ``f`` a sparse GP (RBF kernel,
    constant mean, M inducing points by k-means++), fitted by natural-gradient steps on ``q(u)``
    (:func:`milgp.variational.aggregate_fit.fit_aggregate`) at a fixed kernel: lengthscale the median
    pairwise distance, kernel variance chosen among ``SEARCH_OUTPUTSCALES`` by 3-fold
    cross-validation over bags on the held-out bag-level predictive NLL: the ELBO's variance
    penalty (Lemma 1 of the paper for the exp link) falls monotonically with the kernel variance,
    so learning the kernel on it collapses the GP to a constant (docs/aggregate.md).
    After ``warmup_iter`` natural steps, Adam steps on the constant mean and the Normal noise τ
    alternate with them (the kernel stays fixed; ``learn_hyperparameters=True`` learns it too).

    The Normal model is fitted on ``y / s``, ``s`` the targets' spread per unit weight
    (:func:`target_scale`), with its initial noise chosen beside the kernel variance
    (``SEARCH_NOISES``); the fitted GP and noise are then rescaled to the targets' units, so that
    multiplying ``y`` by a constant multiplies every prediction by it (docs/aggregate.md).

    Args:
        likelihood: ``"poisson"`` (counts, populations), ``"normal"`` or ``"exponential"``.
        link: ``"exp"`` (Poisson, Exponential; Lemma-1 / A.4 bounds), ``"square"`` (Poisson;
            Taylor approximation Eq. 11) or ``"identity"`` (Normal). ``None``: the default per model.
        num_inducing: M.
        lengthscale, outputscale: the RBF kernel's (initial) values on standardised features;
            ``lengthscale=None``: the median pairwise distance of the training instances;
            ``outputscale=None``: chosen by the cross-validation (Normal: in the targets' units).
        lr, hyper_steps: Adam on hyperparameters, each step on random whole bags
            holding at most ``hyper_max_instances`` instances.
        max_iter, tol, warmup_iter: natural-step iterations (epochs with ``bags_per_batch``).
        noise: initial τ of the Normal model, in the targets' units (variance per unit weight);
            ``None``: chosen by the cross-validation among ``SEARCH_NOISES × target_scale_²``.
        constant_mean: learn a constant prior mean of f, initialised at the link value of the
            pooled rate ``Σy / Σw`` (default); ``False``: zero-mean GP, as in Law et al.'s models.
        bags_per_batch: minibatches of whole bags (stochastic natural steps); ``None``: full batch
            (still chunked: ``chunk_instances``, ``block_budget``).
        random_state: as :class:`~milgp.estimators.VGPMILClassifier`'s (``None``: a fresh seed, ``seed_``).
        ard, learn_inducing_locations, standardize, dtype, device, verbose.

    Fitted attributes: ``model_`` (:class:`~milgp.models.SparseGP`), ``likelihood_``, ``seed_``,
    ``fit_result_`` (Normal: the fit on ``y / target_scale_``), ``elbo_`` (in the targets' units),
    ``n_features_in_``, ``dtype_`` and ``device_`` (of the fit, used by every prediction),
    ``fitted_with_weights_`` (populations other than 1 were given:
    :meth:`predict_bags` and :meth:`score` then need them too), ``target_scale_`` (1 but for the
    Normal model), ``search_`` (``(outputscale, noise)`` → cross-validated NLL per bag, in the
    targets' units; ``noise`` ``None`` for the models without one).
    """

    likelihood: str = "poisson"
    link: str | None = None
    num_inducing: int = 100
    lengthscale: float | None = None
    outputscale: float | None = None
    max_iter: int = 100
    tol: float = 1e-6
    warmup_iter: int = 10
    learn_hyperparameters: bool = False
    lr: float = 0.05
    hyper_steps: int = 3
    hyper_max_instances: int = 5000
    noise: float | None = None
    constant_mean: bool = True
    ard: bool = False
    learn_inducing_locations: bool = False
    standardize: bool = True
    bags_per_batch: int | None = None
    chunk_instances: int = 32768
    block_budget: int = 2_000_000
    dtype: str = "float64"
    device: str = "cpu"
    random_state: int | np.random.RandomState | np.random.Generator | None = 0
    verbose: bool = False

    def _make_likelihood(self, noise: float | None = None, scale: float = 1.0) -> Any:
        """The likelihood; the Normal one with initial noise ``noise`` (default 1) and its lower
        bound, both in units of ``scale²``."""
        if self.likelihood not in _VBAGG_DEFAULT_LINK:
            raise ValueError(f"likelihood must be 'poisson', 'normal' or 'exponential', got {self.likelihood!r}")
        link = self.link or _VBAGG_DEFAULT_LINK[self.likelihood]
        if self.likelihood == "poisson":
            return PoissonAggregateLikelihood(link)
        if self.likelihood == "normal":
            return NormalAggregateLikelihood(link, noise=(1.0 if noise is None else noise) * scale**2, noise_lower_bound=1e-6 * scale**2)
        return ExponentialAggregateLikelihood(link)

    def _flat(self, bags: list[np.ndarray], weights: list[np.ndarray]) -> tuple[torch.Tensor, ...]:
        x, bag_index = flatten_bags(bags)
        bag_index = bag_index.to(self.device_)
        x = self._transform(x, bag_index)
        return x, bag_index, torch.as_tensor(np.concatenate(weights), dtype=x.dtype, device=self.device_)

    def _transform(self, x: np.ndarray | torch.Tensor, bag_index: torch.Tensor | None = None) -> torch.Tensor:
        """Validated float64 instances ``(n, d)``, standardised, in the model's dtype and on its device
        (an instance that overflows is named by its bag, given ``bag_index`` ``(n,)``)."""
        return self.scaler_.transform(torch.as_tensor(x, dtype=torch.float64).to(self.device_), bag_index, self.dtype_)

    @keeps_state_on_error
    def fit(self, bags: Sequence[Any], y: Any, weights: Sequence[Any] | None = None) -> "VBAggRegressor":
        """Fit on ``bags`` (sequence of ``(n_b, d)`` arrays), aggregate targets ``y`` ``(B,)`` and
        optional per-bag populations ``weights`` (sequence of ``(n_b,)``, default ones)."""
        check_settings(
            self, ("learn_hyperparameters", "constant_mean", "ard", "learn_inducing_locations", "standardize", "verbose"),
            {"num_inducing": 1, "max_iter": 0, "warmup_iter": 0, "hyper_steps": 0},
        )
        # what the fitted state lives in: predictions use these, whatever set_params changes later
        self.dtype_, self.device_ = torch_dtype(self.dtype), torch.device(self.device)
        bags_np = check_bags(bags)
        y_np = np.asarray(y, dtype=np.float64)
        if y_np.ndim != 1 or len(y_np) != len(bags_np):
            raise ValueError(f"y must be a 1-D array with one target per bag ({len(bags_np)}), got shape {y_np.shape}")
        w_list = check_bag_weights(weights, bags_np)
        self.fitted_with_weights_ = any((w != 1).any() for w in w_list)
        sizes = [len(b) for b in bags_np]
        self._make_likelihood().check_data(y_np, np.concatenate(w_list), Bags(bag_index_from_sizes(sizes), len(sizes)))
        self.seed_ = check_seed(self.random_state)
        given_lengthscale = check_positive("lengthscale", self.lengthscale, none="the median heuristic")
        given_outputscale = check_positive("outputscale", self.outputscale, none="chosen by cross-validation")
        given_noise = check_positive("noise", self.noise, none="chosen by cross-validation")
        normal = self.likelihood == "normal"
        self.target_scale_ = scale = target_scale(y_np, w_list) if normal else 1.0
        flat = np.concatenate(bags_np, 0)
        self.n_features_in_ = flat.shape[1]
        self.scaler_ = FeatureScaler(self.standardize).fit(flat)
        x, bag_index, w = self._flat(bags_np, w_list)
        x_np = x.detach().cpu().numpy()
        Z = torch.as_tensor(
            kmeans_pp_inducing(x_np, np.zeros(len(x_np)), min(self.num_inducing, len(x_np)), seed=self.seed_),
            dtype=x.dtype, device=self.device,
        )
        lengthscale = median_lengthscale(x_np, seed=self.seed_) if given_lengthscale is None else given_lengthscale
        batch = BagBatch(x, bag_index, torch.as_tensor(y_np / scale, dtype=x.dtype, device=self.device), instance_weights=w)
        # the candidates (kernel variance, Normal noise) in units of scale²
        outputscales = SEARCH_OUTPUTSCALES if given_outputscale is None else (given_outputscale / scale**2,)
        noises = (None,) if not normal else SEARCH_NOISES if given_noise is None else (given_noise / scale**2,)
        candidates = [(s, n) for s in outputscales for n in noises]
        self.search_: dict[tuple[float, float | None], float] = {}
        if len(candidates) > 1 and len(bags_np) >= 2 * CV_FOLDS:
            nll = {c: self._cross_validated_nll(batch, Z, lengthscale, *c) for c in candidates}
            outputscale, noise = min(nll, key=nll.get)
            self.search_ = {(s * scale**2, n if n is None else n * scale**2): v + math.log(scale) for (s, n), v in nll.items()}
        else:
            outputscale = outputscales[0] if len(outputscales) == 1 else 1.0
            noise = noises[0] if len(noises) == 1 else 1.0
        self.model_, self.likelihood_, self.fit_result_ = self._fit_one(batch, Z, lengthscale, outputscale, noise)
        self.elbo_ = self.fit_result_.elbo[-1] - len(bags_np) * math.log(scale)  # each bag's density in the targets' units
        if scale != 1.0:
            self._to_target_units(scale)
        return self

    def _to_target_units(self, scale: float) -> None:
        """The model fitted on ``y / scale`` in the targets' units: ``f`` × ``scale`` (kernel variance,
        jitter and noise × ``scale²``, constant mean × ``scale``; whitened ``q(v)`` unchanged)."""
        model = self.model_
        model.covar_module.outputscale = model.covar_module.outputscale.detach() * scale**2
        if self.constant_mean:
            model.mean_module.constant = model.mean_module.constant.detach() * scale
        strategy = model.variational_strategy
        strategy.jitter_val = strategy.jitter * scale**2
        strategy.clear_caches()
        noise = self.likelihood_.noise.item()
        self.likelihood_ = self._make_likelihood(noise, scale).to(device=self.device_, dtype=self.dtype_)

    def _fit_one(
        self, batch: BagBatch, Z: torch.Tensor, lengthscale: float, outputscale: float, noise: float | None, learn: bool = True
    ) -> tuple[SparseGP, Any, Any]:
        """One model fitted on ``batch`` at these kernel values and initial Normal noise as the class docstring says (``learn=False``, or nothing to learn:
        natural steps alone, up to ``max_iter``)."""
        model = SparseGP(
            Z, ard=self.ard, constant_mean=self.constant_mean, learn_inducing_locations=self.learn_inducing_locations,
            lengthscale=lengthscale, outputscale=outputscale,
        ).to(self.device)
        likelihood = self._make_likelihood(noise).to(device=self.device, dtype=batch.x.dtype)
        if self.constant_mean:  # at the rate that explains the total: Σy = Σ w Ψ(c)
            model.mean_module.constant.data.fill_(likelihood.pooled_latent(batch.bag_labels, batch.instance_weights))
        if not self.learn_hyperparameters:
            for p in model.covar_module.parameters():
                p.requires_grad_(False)
        common = dict(
            tol=self.tol, bags_per_batch=self.bags_per_batch, chunk_instances=self.chunk_instances,
            block_budget=self.block_budget, seed=self.seed_, progress=self.verbose,
        )
        learn = learn and bool(model.variational_strategy.hyperparameters() or list(likelihood.parameters()))
        result = fit_aggregate(
            model, likelihood, batch, max_iter=max(1, self.warmup_iter if learn else self.max_iter), learn_hyperparameters=False, **common
        )
        if learn and self.max_iter > 0:
            result = fit_aggregate(
                model, likelihood, batch, max_iter=self.max_iter, learn_hyperparameters=True,
                lr=self.lr, hyper_steps=self.hyper_steps, hyper_max_instances=self.hyper_max_instances,
                rho0=result.rho, **common,
            ).after(result)
        return model, likelihood, result

    def _cross_validated_nll(
        self, batch: BagBatch, Z: torch.Tensor, lengthscale: float, outputscale: float, noise: float | None
    ) -> float:
        """Mean held-out negative log-likelihood of the bag targets under the Gaussian predictive
        ``N(E[y_a], Var[y_a])`` (a proper score that includes the predictive uncertainty), by
        ``CV_FOLDS``-fold cross-validation over bags."""
        folds = KFold(CV_FOLDS, shuffle=True, random_state=self.seed_).split(np.zeros(batch.num_bags))
        total = 0.0
        for train, test in folds:
            tr, te = batch.select_bags(torch.as_tensor(train)), batch.select_bags(torch.as_tensor(test))
            model, likelihood, _ = self._fit_one(tr, Z, lengthscale, outputscale, noise, learn=False)
            moments = predict_bag_moments(
                model, likelihood, te.x, te.bags, te.instance_weights, self.chunk_instances, self.block_budget
            )
            var = moments["y_var"].clamp_min(1e-12)
            nll = 0.5 * (torch.log(2 * math.pi * var) + (te.bag_labels - moments["y_mean"]) ** 2 / var)
            total += float(nll.sum())
        return total / batch.num_bags

    # -- predictions ------------------------------------------------------------------------
    def predict_latent(self, X: Any) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and variance of ``f`` ``(n,)`` at instances ``X`` ``(n, d)``."""
        mean, var = self._latent(X)
        return mean.cpu().numpy(), var.cpu().numpy()

    def _latent(self, X: Any) -> tuple[torch.Tensor, torch.Tensor]:
        check_is_fitted(self, "model_")
        try:
            X = as_float_array(X)
        except ValueError:  # ragged: a sequence of bags
            X = None
        if X is None or X.ndim != 2 or X.shape[1] != self.n_features_in_ or X.shape[0] == 0:
            got = "a sequence of bags" if X is None or X.ndim == 3 else f"shape {X.shape}"
            raise ValueError(f"X must be an (n, {self.n_features_in_}) array of individual covariates, got {got}; bag aggregates: predict_bags")
        if not np.isfinite(X).all():
            raise ValueError(f"X has NaN or inf features (first in row {int(np.nonzero(~np.isfinite(X).all(1))[0][0])})")
        return self.model_.variational_strategy.predict_marginals(self._transform(X))

    def predict(self, X: Any) -> np.ndarray:
        """Posterior mean of the individual rate / mean parameter ``Ψ(f(x))`` ``(n,)``."""
        mean, var = self._latent(X)
        with torch.no_grad():
            return self.likelihood_.rate_mean(mean, var).cpu().numpy()

    def predict_quantiles(self, X: Any, q: Any) -> np.ndarray:
        """Posterior quantiles of ``Ψ(f(x))``: ``(n,)`` for a scalar ``q``, else ``(n, len(q))``
        (log-normal for ``exp``, scaled non-central χ² for ``square``, Gaussian for ``identity``)."""
        mean, var = self._latent(X)
        out = self.likelihood_.rate_quantiles(mean, var, q)
        return out[:, 0] if np.ndim(q) == 0 else out

    def predict_bags(self, bags: Sequence[Any], weights: Sequence[Any] | None = None) -> dict[str, np.ndarray]:
        """Bag-level predictive moments ``(B,)`` with the full within-bag covariance:
        ``rate_mean``/``rate_var`` of ``η_a = Σ w_i Ψ(f_i)`` and ``y_mean``/``y_var`` of ``y_a``.

        ``weights``: the bags' populations, required when the fit had them (without them every
        instance would count as a population of 1)."""
        check_is_fitted(self, "model_")
        if weights is None and self.fitted_with_weights_:
            raise ValueError("the model was fitted with populations (weights): give each bag's populations to predict_bags / score too")
        bags_np = check_bags(bags, n_features=self.n_features_in_)
        w_list = check_bag_weights(weights, bags_np)
        x, bag_index, w = self._flat(bags_np, w_list)
        out = predict_bag_moments(
            self.model_, self.likelihood_, x, Bags(bag_index, len(bags_np)), w, self.chunk_instances, self.block_budget
        )
        return {k: v.cpu().numpy() for k, v in out.items()}

    def score(self, bags: Sequence[Any], y: Any, weights: Sequence[Any] | None = None) -> float:
        """R² of the predicted bag aggregates ``E[y_a]`` against ``y`` (bag level)."""
        return float(r2_score(np.asarray(y, dtype=np.float64), self.predict_bags(bags, weights)["y_mean"]))


def target_scale(y: np.ndarray, weights: Sequence[np.ndarray]) -> float:
    """The spread of aggregate targets per unit weight, ``s = sqrt(Σ_a (y_a − W_a ȳ)² / Σ_a W2_a)``
    with ``W_a = Σ_{i∈a} w_i``, ``W2_a = Σ_{i∈a} w_i²`` and the pooled rate ``ȳ = Σ_a y_a / Σ_a W_a``:
    the standard deviation of independent instances that would spread the bags' targets as much
    as they are spread (for ``y`` ``(B,)`` and each bag's weights ``(n_b,)``). Multiplying ``y`` by
    ``c`` multiplies ``s`` by ``|c|``. Targets with no spread: ``|ȳ|``, else 1."""
    W = np.array([w.sum() for w in weights])
    W2 = np.array([(w * w).sum() for w in weights])
    rate = float(y.sum() / W.sum())
    s = math.sqrt(float(((y - W * rate) ** 2).sum() / W2.sum()))
    if s > 1e-9 * abs(rate):  # a spread, not rounding
        return s
    return abs(rate) if rate != 0 else 1.0
