"""scikit-learn-style estimators over bags (``clone``, ``GridSearchCV``, ``cross_val_score`` work).

Bags are given as a sequence of ``(n_b, d)`` arrays; bag targets as a ``(B,)`` array.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.utils.validation import check_is_fitted

from milgp.data.bags import BagBatch, flatten_bags, segment_sum, split_by_bag
from milgp.inducing import kmeans_pp_inducing, median_lengthscale
from milgp.likelihoods.mil_bernoulli import MILBernoulliLikelihood
from milgp.likelihoods.psi import GSMDensity
from milgp.models.sparse_gp import SparseGP
from milgp.prediction import BagPosterior, BagRule, OrthantRule, make_bag_rule
from milgp.variational.fit import FitResult, fit_closed_form

__all__ = [
    "ProbitMILClassifier",
    "VBAggRegressor",
    "VGPMILClassifier",
    "check_bag_weights",
    "check_bags",
    "check_binary_bag_labels",
]


def check_bags(bags: Sequence[Any], name: str = "bags") -> list[np.ndarray]:
    """Validate bags: a non-empty sequence of non-empty 2-D finite float arrays of equal width.

    Raises ``ValueError`` naming the offending bag.
    """
    if isinstance(bags, np.ndarray) and bags.dtype != object and bags.ndim == 2:
        raise ValueError(f"{name} must be a sequence of (n_b, d) arrays, one per bag, not a single 2-D array")
    if len(bags) == 0:
        raise ValueError(f"{name} is empty: need at least one bag")
    out = []
    width = None
    for b, bag in enumerate(bags):
        arr = np.asarray(bag, dtype=np.float64)
        if arr.ndim == 1:
            raise ValueError(f"{name}[{b}] is 1-D with shape {arr.shape}; each bag must be (n_b, d) — use reshape(1, -1) for a bag of one")
        if arr.ndim != 2:
            raise ValueError(f"{name}[{b}] must be 2-D (n_b, d), got shape {arr.shape}")
        if arr.shape[0] == 0:
            raise ValueError(f"{name}[{b}] is empty: every bag needs at least one instance")
        if not np.isfinite(arr).all():
            row = int(np.nonzero(~np.isfinite(arr).all(1))[0][0])
            raise ValueError(f"{name}[{b}] has NaN or inf features (first in instance {row})")
        if width is None:
            width = arr.shape[1]
        elif arr.shape[1] != width:
            raise ValueError(f"{name}[{b}] has {arr.shape[1]} features, but {name}[0] has {width}")
        out.append(arr)
    return out


def check_binary_bag_labels(y: Any, num_bags: int, require_both: bool = True) -> np.ndarray:
    """Validate ``(B,)`` bag labels in {0, 1}; raises ``ValueError`` naming the bad bag."""
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"y must be a 1-D array of bag labels, got shape {y.shape}")
    if len(y) != num_bags:
        raise ValueError(f"got {num_bags} bags but {len(y)} labels in y")
    yf = y.astype(np.float64)
    bad = np.nonzero(~np.isin(yf, (0.0, 1.0)))[0]
    if len(bad):
        raise ValueError(f"bag {int(bad[0])} has label {y[bad[0]].item()!r}; bag labels must be 0 or 1")
    if require_both and len(np.unique(yf)) < 2:
        raise ValueError(f"the training set has only bags of class {int(yf[0])}; MIL training needs positive and negative bags")
    return yf


def _dtype(name: str) -> torch.dtype:
    if name not in ("float64", "float32"):
        raise ValueError(f"dtype must be 'float64' or 'float32', got {name!r}")
    return torch.float64 if name == "float64" else torch.float32


class VGPMILClassifier(ClassifierMixin, BaseEstimator):
    """ψ-VGPMIL bag classifier: VGPMIL (``psi="pg"``) or G-VGPMIL (``psi="gamma"``), seed 000.

    Fitting runs Algorithm 1 with closed-form natural updates: ``warmup_iter`` CAVI sweeps at the
    initial hyperparameters (median-heuristic lengthscale, unit variance), then sweeps alternating
    with Adam steps on the kernel hyperparameters until the ELBO stops changing.

    Args:
        psi: ``"pg"``, ``"gamma"`` or a :class:`milgp.likelihoods.psi.GSMDensity`.
        num_inducing: M, placed by k-means++ half on instances of positive, half of negative bags.
        H: bag-label noise (seed 000 Eq. 4). max_rule: ``"exact"`` or ``"max"``.
        bag_rule: bag prediction, ``"noisy_or"`` (Eq. 34), ``"max"`` or ``"joint"`` (sampling q(f*_b)).
        max_iter, tol, warmup_iter: iteration budget and relative ELBO tolerance. ``warmup_iter``
            CAVI sweeps at the initial kernel come first; then up to ``max_iter`` sweeps, each
            followed by ``hyper_steps`` Adam steps (without hyperparameter learning: up to
            ``max_iter`` CAVI sweeps to convergence).
        learn_hyperparameters, lr, hyper_steps: Adam on the kernel hyperparameters, maximising the
            logistic MIL ELBO with exact (quadrature) expected log-likelihood at the current q(v),
            q(y) (:meth:`MILBernoulliLikelihood.hyperparameter_terms`). Defaults: 20 + 50 sweeps,
            250 Adam steps of 0.05 on the raw (softplus) kernel parameters (docs/core.md).
        ard: one lengthscale per feature. learn_inducing_locations: train Z too.
        standardize: z-score features with training statistics.
        bags_per_batch: minibatch size in bags for stochastic natural steps (None: full batch).
        dtype: ``"float64"`` (default) or ``"float32"``. device: e.g. ``"cpu"``, ``"cuda"``.

    Fitted attributes: ``model_``, ``likelihood_``, ``fit_result_`` (both ELBO traces),
    ``elbo_``: the final un-augmented ELBO (``fit_result_.objective[-1]``, a lower bound of
    ``log p(T)`` for the logistic MIL model whatever ψ is; use it to compare fits).
    """

    def __init__(
        self,
        psi: str | GSMDensity = "pg",
        num_inducing: int = 100,
        H: float = 100.0,
        max_rule: str = "exact",
        bag_rule: str = "noisy_or",
        max_iter: int = 50,
        tol: float = 1e-5,
        warmup_iter: int = 20,
        learn_hyperparameters: bool = True,
        lr: float = 0.05,
        hyper_steps: int = 5,
        ard: bool = False,
        learn_inducing_locations: bool = False,
        standardize: bool = True,
        bags_per_batch: int | None = None,
        dtype: str = "float64",
        device: str = "cpu",
        random_state: int = 0,
        verbose: bool = False,
    ):
        self.psi = psi
        self.num_inducing = num_inducing
        self.H = H
        self.max_rule = max_rule
        self.bag_rule = bag_rule
        self.max_iter = max_iter
        self.tol = tol
        self.warmup_iter = warmup_iter
        self.learn_hyperparameters = learn_hyperparameters
        self.lr = lr
        self.hyper_steps = hyper_steps
        self.ard = ard
        self.learn_inducing_locations = learn_inducing_locations
        self.standardize = standardize
        self.bags_per_batch = bags_per_batch
        self.dtype = dtype
        self.device = device
        self.random_state = random_state
        self.verbose = verbose

    # -- helpers --------------------------------------------------------------------------------
    def _to_tensor(self, bags: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        x, bag_index = flatten_bags(bags)
        x = x.to(dtype=_dtype(self.dtype), device=self.device)
        if self.standardize:
            x = (x - self.feature_mean_.to(x)) / self.feature_scale_.to(x)
        return x, bag_index.to(self.device)

    def _make_likelihood(self) -> MILBernoulliLikelihood:
        return MILBernoulliLikelihood(psi=self.psi, H=self.H, max_rule=self.max_rule)

    def _bag_rule(self) -> BagRule:
        return make_bag_rule(self.bag_rule)

    # -- scikit-learn API -----------------------------------------------------------------------
    def fit(self, bags: Sequence[Any], y: Any) -> "VGPMILClassifier":
        """Fit on ``bags`` (sequence of ``(n_b, d)`` arrays) with bag labels ``y`` ``(B,)`` in {0, 1}."""
        bags_np = check_bags(bags)
        y_np = check_binary_bag_labels(y, len(bags_np))
        make_bag_rule(self.bag_rule)  # fails early, naming the valid rules
        torch.manual_seed(self.random_state)
        flat = np.concatenate(bags_np, 0)
        self.n_features_in_ = flat.shape[1]
        self.classes_ = np.array([0, 1])
        mean = flat.mean(0) if self.standardize else np.zeros(flat.shape[1])
        scale = flat.std(0) if self.standardize else np.ones(flat.shape[1])
        scale = np.where(scale > 1e-12, scale, 1.0)
        self.feature_mean_ = torch.as_tensor(mean)
        self.feature_scale_ = torch.as_tensor(scale)
        x, bag_index = self._to_tensor(bags_np)
        labels = torch.as_tensor(y_np, dtype=x.dtype, device=self.device)
        x_np = x.detach().cpu().numpy()
        inst_labels = y_np[bag_index.cpu().numpy()]
        Z = kmeans_pp_inducing(x_np, inst_labels, min(self.num_inducing, len(x_np)), seed=self.random_state)
        self.model_ = SparseGP(
            torch.as_tensor(Z, dtype=x.dtype, device=self.device),
            ard=self.ard,
            learn_inducing_locations=self.learn_inducing_locations,
            lengthscale=median_lengthscale(x_np, seed=self.random_state),
            outputscale=1.0,
        ).to(self.device)
        self.likelihood_ = self._make_likelihood()
        batch = BagBatch(x, bag_index, labels)
        common = dict(
            tol=self.tol, bags_per_batch=self.bags_per_batch, seed=self.random_state, progress=self.verbose
        )
        # without hyperparameter learning the CAVI phase runs to convergence (up to max_iter)
        warm_iter = max(1, self.warmup_iter) if self.learn_hyperparameters else max(1, self.max_iter)
        warm = fit_closed_form(
            self.model_, self.likelihood_, batch, max_iter=warm_iter, learn_hyperparameters=False, **common
        )
        self.fit_result_: FitResult = warm
        if self.learn_hyperparameters and self.max_iter > 0:
            main = fit_closed_form(
                self.model_,
                self.likelihood_,
                batch,
                max_iter=self.max_iter,
                learn_hyperparameters=True,
                lr=self.lr,
                hyper_steps=self.hyper_steps,
                initial_locals=warm.locals,
                **common,
            )
            main.elbo = warm.elbo + main.elbo
            main.objective = warm.objective + main.objective
            main.iterations += warm.iterations
            main.seconds += warm.seconds
            self.fit_result_ = main
        self.elbo_ = self.fit_result_.objective[-1]
        return self

    def _latent(self, bags: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        check_is_fitted(self, "model_")
        bags_np = check_bags(bags)
        if bags_np[0].shape[1] != self.n_features_in_:
            raise ValueError(f"bags have {bags_np[0].shape[1]} features, the model was fitted on {self.n_features_in_}")
        x, bag_index = self._to_tensor(bags_np)
        mean, var = self.model_.predict_marginals(x)
        return x, bag_index, mean, var, len(bags_np)

    def predict_proba(self, bags: Sequence[Any]) -> np.ndarray:
        """``(B, 2)`` bag class probabilities by :attr:`bag_rule`."""
        return np.stack([1 - (p := self.predict_bag_proba(bags)[0]), p], 1)

    def predict_bag_proba(self, bags: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        """Positive-bag probability and its standard deviation, each ``(B,)``."""
        x, bag_index, mean, var, B = self._latent(bags)
        posterior = BagPosterior(mean, var, bag_index, B, lambda inst, local, n: self.model_.bag_covariances(x[inst], local, n))
        gen = torch.Generator(device=x.device).manual_seed(self.random_state)
        p, s = self._bag_rule()(posterior, self.likelihood_.instance_link, gen)
        return p.cpu().numpy(), s.cpu().numpy()

    def predict(self, bags: Sequence[Any]) -> np.ndarray:
        """Bag labels ``(B,)``: 1 where the positive-bag probability exceeds ½."""
        return (self.predict_proba(bags)[:, 1] > 0.5).astype(int)

    def predict_instance_proba(self, bags: Sequence[Any], return_std: bool = False) -> list[np.ndarray] | tuple[list[np.ndarray], list[np.ndarray]]:
        """Per-bag lists of instance probabilities ``(n_b,)`` (and their stds), seed 000 Eqs. 31–33."""
        _, bag_index, mean, var, B = self._latent(bags)
        with torch.no_grad():
            p, s = self.likelihood_.instance_link.moments(mean, var)
        probs = [t.cpu().numpy() for t in split_by_bag(p, bag_index, B)]
        if not return_std:
            return probs
        return probs, [t.cpu().numpy() for t in split_by_bag(s, bag_index, B)]


# ---------------------------------------------------------------------------------------------
# VBAgg: aggregate outputs (seed 001)
# ---------------------------------------------------------------------------------------------

def check_bag_weights(weights: Any, bags: list[np.ndarray], name: str = "weights") -> list[np.ndarray]:
    """Per-bag populations ``(n_b,)``: finite and strictly positive; ``None`` → ones.

    Raises ``ValueError`` naming the offending bag.
    """
    if weights is None:
        return [np.ones(len(b)) for b in bags]
    if len(weights) != len(bags):
        raise ValueError(f"got {len(bags)} bags but {len(weights)} entries in {name}")
    out = []
    for b, (w, bag) in enumerate(zip(weights, bags)):
        w = np.asarray(w, dtype=np.float64).reshape(-1)
        if w.shape[0] != bag.shape[0]:
            raise ValueError(f"{name}[{b}] has {w.shape[0]} entries but bag {b} has {bag.shape[0]} instances")
        if not (np.isfinite(w).all() and (w > 0).all()):
            i = int(np.nonzero(~(np.isfinite(w) & (w > 0)))[0][0])
            raise ValueError(f"bag {b} has weight/population {float(w[i])} (instance {i}); populations must be finite and > 0")
        out.append(w)
    return out


_VBAGG_DEFAULT_LINK = {"poisson": "exp", "normal": "identity", "exponential": "exp"}


class VBAggRegressor(RegressorMixin, BaseEstimator):
    """VBAgg: individual-level GP regression from bag-level aggregate outputs (seed 001).

    ``y_a ~ p(y | η_a)``, ``η_a = Σ_{i∈a} w_i Ψ(f(x_i))`` with ``f`` a sparse GP (RBF kernel,
    constant mean, M inducing points by k-means++). Fitting alternates natural-gradient steps on
    ``q(u)`` with Adam on the kernel, mean and (Normal) noise τ (:func:`milgp.variational.
    aggregate_fit.fit_aggregate`), after ``warmup_iter`` natural steps at the initial values.

    Args:
        likelihood: ``"poisson"`` (counts, populations), ``"normal"`` or ``"exponential"``.
        link: ``"exp"`` (Poisson, Exponential; Lemma-1 / A.4 bounds), ``"square"`` (Poisson;
            Taylor approximation Eq. 11) or ``"identity"`` (Normal). ``None``: the default per model.
        num_inducing: M. lr, hyper_steps: Adam on hyperparameters, each step on random whole bags
            holding at most ``hyper_max_instances`` instances.
        max_iter, tol, warmup_iter: natural-step iterations (epochs with ``bags_per_batch``).
        noise: initial τ of the Normal model.
        constant_mean: learn a constant prior mean of f, initialised at the link value of the
            pooled rate ``Σy / Σw`` (default); ``False``: zero-mean GP, as seed 001's models.
        bags_per_batch: minibatches of whole bags (stochastic natural steps); ``None``: full batch
            (still chunked: ``chunk_instances``, ``block_budget``).
        ard, learn_inducing_locations, standardize, dtype, device, random_state, verbose.

    Fitted attributes: ``model_`` (:class:`~milgp.models.SparseGP`), ``likelihood_``,
    ``fit_result_``, ``elbo_``, ``n_features_in_``.
    """

    def __init__(
        self,
        likelihood: str = "poisson",
        link: str | None = None,
        num_inducing: int = 100,
        max_iter: int = 100,
        tol: float = 1e-6,
        warmup_iter: int = 10,
        learn_hyperparameters: bool = True,
        lr: float = 0.05,
        hyper_steps: int = 3,
        hyper_max_instances: int = 5000,
        noise: float = 1.0,
        constant_mean: bool = True,
        ard: bool = False,
        learn_inducing_locations: bool = False,
        standardize: bool = True,
        bags_per_batch: int | None = None,
        chunk_instances: int = 32768,
        block_budget: int = 2_000_000,
        dtype: str = "float64",
        device: str = "cpu",
        random_state: int = 0,
        verbose: bool = False,
    ):
        self.likelihood = likelihood
        self.link = link
        self.num_inducing = num_inducing
        self.max_iter = max_iter
        self.tol = tol
        self.warmup_iter = warmup_iter
        self.learn_hyperparameters = learn_hyperparameters
        self.lr = lr
        self.hyper_steps = hyper_steps
        self.hyper_max_instances = hyper_max_instances
        self.noise = noise
        self.constant_mean = constant_mean
        self.ard = ard
        self.learn_inducing_locations = learn_inducing_locations
        self.standardize = standardize
        self.bags_per_batch = bags_per_batch
        self.chunk_instances = chunk_instances
        self.block_budget = block_budget
        self.dtype = dtype
        self.device = device
        self.random_state = random_state
        self.verbose = verbose

    def _make_likelihood(self) -> Any:
        from milgp.likelihoods.aggregate_exponential import ExponentialAggregateLikelihood
        from milgp.likelihoods.aggregate_normal import NormalAggregateLikelihood
        from milgp.likelihoods.aggregate_poisson import PoissonAggregateLikelihood

        if self.likelihood not in _VBAGG_DEFAULT_LINK:
            raise ValueError(f"likelihood must be 'poisson', 'normal' or 'exponential', got {self.likelihood!r}")
        link = self.link or _VBAGG_DEFAULT_LINK[self.likelihood]
        if self.likelihood == "poisson":
            return PoissonAggregateLikelihood(link)
        if self.likelihood == "normal":
            return NormalAggregateLikelihood(link, noise=self.noise)
        return ExponentialAggregateLikelihood(link)

    def _flat(self, bags: list[np.ndarray], weights: list[np.ndarray] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        x, bag_index = flatten_bags(bags)
        x = self._transform(x)
        w = None if weights is None else torch.as_tensor(np.concatenate(weights), dtype=x.dtype, device=self.device)
        return x, bag_index.to(self.device), w

    def _transform(self, x: Any) -> torch.Tensor:
        x = torch.as_tensor(np.asarray(x, dtype=np.float64) if not isinstance(x, torch.Tensor) else x)
        x = x.to(dtype=_dtype(self.dtype), device=self.device)
        if self.standardize:
            x = (x - self.feature_mean_.to(x)) / self.feature_scale_.to(x)
        return x

    def fit(self, bags: Sequence[Any], y: Any, weights: Sequence[Any] | None = None) -> "VBAggRegressor":
        """Fit on ``bags`` (sequence of ``(n_b, d)`` arrays), aggregate targets ``y`` ``(B,)`` and
        optional per-bag populations ``weights`` (sequence of ``(n_b,)``, default ones)."""
        from milgp.variational.aggregate_fit import fit_aggregate

        bags_np = check_bags(bags)
        y_np = np.asarray(y, dtype=np.float64)
        if y_np.ndim != 1 or len(y_np) != len(bags_np):
            raise ValueError(f"y must be a 1-D array with one target per bag ({len(bags_np)}), got shape {y_np.shape}")
        w_list = check_bag_weights(weights, bags_np)
        likelihood = self._make_likelihood()
        sizes = [len(b) for b in bags_np]
        likelihood.check_data(y_np, np.concatenate(w_list), np.repeat(np.arange(len(sizes)), sizes), len(sizes))
        torch.manual_seed(self.random_state)
        flat = np.concatenate(bags_np, 0)
        self.n_features_in_ = flat.shape[1]
        mean = flat.mean(0) if self.standardize else np.zeros(flat.shape[1])
        scale = flat.std(0) if self.standardize else np.ones(flat.shape[1])
        self.feature_mean_ = torch.as_tensor(mean)
        self.feature_scale_ = torch.as_tensor(np.where(scale > 1e-12, scale, 1.0))
        x, bag_index, w = self._flat(bags_np, w_list)
        x_np = x.detach().cpu().numpy()
        Z = kmeans_pp_inducing(x_np, np.zeros(len(x_np)), min(self.num_inducing, len(x_np)), seed=self.random_state)
        self.model_ = SparseGP(
            torch.as_tensor(Z, dtype=x.dtype, device=self.device),
            ard=self.ard,
            constant_mean=self.constant_mean,
            learn_inducing_locations=self.learn_inducing_locations,
            lengthscale=median_lengthscale(x_np, seed=self.random_state),
            outputscale=1.0,
        ).to(self.device)
        if self.constant_mean:  # at the rate that explains the total: Σy = Σ w Ψ(c)
            rate = float(y_np.sum() / np.concatenate(w_list).sum())
            self.model_.mean_module.constant.data.fill_(likelihood.link.inverse(rate))
        self.likelihood_ = likelihood.to(device=self.device, dtype=x.dtype)
        batch = BagBatch(x, bag_index, torch.as_tensor(y_np, dtype=x.dtype, device=self.device), instance_weights=w)
        common = dict(
            tol=self.tol,
            bags_per_batch=self.bags_per_batch,
            chunk_instances=self.chunk_instances,
            block_budget=self.block_budget,
            seed=self.random_state,
            progress=self.verbose,
        )
        result = fit_aggregate(self.model_, self.likelihood_, batch, max_iter=max(1, self.warmup_iter), learn_hyperparameters=False, **common)
        if self.learn_hyperparameters and self.max_iter > 0:
            main = fit_aggregate(
                self.model_, self.likelihood_, batch, max_iter=self.max_iter, learn_hyperparameters=True,
                lr=self.lr, hyper_steps=self.hyper_steps, hyper_max_instances=self.hyper_max_instances,
                rho0=result.rho, **common,
            )
            main.elbo = result.elbo + main.elbo
            main.iterations += result.iterations
            main.seconds += result.seconds
            result = main
        self.fit_result_ = result
        self.elbo_ = result.elbo[-1]
        return self

    # -- predictions ------------------------------------------------------------------------
    def predict_latent(self, X: Any) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and variance of ``f`` ``(n,)`` at instances ``X`` ``(n, d)``."""
        mean, var = self._latent(X)
        return mean.cpu().numpy(), var.cpu().numpy()

    def _latent(self, X: Any) -> tuple[torch.Tensor, torch.Tensor]:
        check_is_fitted(self, "model_")
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2 or X.shape[1] != self.n_features_in_:
            raise ValueError(f"X must be (n, {self.n_features_in_}) individual covariates, got shape {X.shape}")
        if not np.isfinite(X).all():
            raise ValueError(f"X has NaN or inf features (first in row {int(np.nonzero(~np.isfinite(X).all(1))[0][0])})")
        return self.model_.predict_marginals(self._transform(X))

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
        ``rate_mean``/``rate_var`` of ``η_a = Σ w_i Ψ(f_i)`` and ``y_mean``/``y_var`` of ``y_a``."""
        from milgp.variational.aggregate_fit import predict_bag_moments

        check_is_fitted(self, "model_")
        bags_np = check_bags(bags)
        if bags_np[0].shape[1] != self.n_features_in_:
            raise ValueError(f"bags have {bags_np[0].shape[1]} features, the model was fitted on {self.n_features_in_}")
        w_list = check_bag_weights(weights, bags_np)
        x, bag_index, w = self._flat(bags_np, w_list)
        out = predict_bag_moments(
            self.model_, self.likelihood_, x, bag_index, len(bags_np), w, self.chunk_instances, self.block_budget
        )
        return {k: v.cpu().numpy() for k, v in out.items()}

    def score(self, bags: Sequence[Any], y: Any, weights: Sequence[Any] | None = None) -> float:
        """R² of the predicted bag aggregates ``E[y_a]`` against ``y`` (bag level)."""
        from sklearn.metrics import r2_score

        return float(r2_score(np.asarray(y, dtype=np.float64), self.predict_bags(bags, weights)["y_mean"]))


# ---------------------------------------------------------------------------------------------
# MIL-GP-Probit (seed 003)
# ---------------------------------------------------------------------------------------------
class ProbitMILClassifier(VGPMILClassifier):
    """MIL-GP-Probit bag classifier (Wang & Pinar 2021, seed 003) with VI or Gibbs inference.

    Shares :class:`VGPMILClassifier`'s data handling (validation, standardisation, k-means++
    inducing points split between positive and negative bags, median-heuristic lengthscale) and
    its Algorithm-1 loop, with :class:`milgp.likelihoods.MILProbitLikelihood` in place of the
    logistic one. By default the kernel stays at its initial hyperparameters (median-heuristic
    lengthscale, unit variance) and CAVI runs to convergence, as seed 003 §4 fixes the kernel for
    every method: the collapsed bound ``Σ log Z_b(μ) − ½Σσ²`` penalises predictive variance, so
    maximising it over the kernel shrinks the output scale and under-fits (digits bags: bag AUC
    0.61 learned vs 0.82 fixed, docs/probit.md). ``learn_hyperparameters=True`` runs
    ``warmup_iter`` CAVI sweeps, then sweeps alternating with Adam steps on that bound.

    ``inference="gibbs"`` then runs the collapsed Gibbs sampler (seed 003 §3.5) at the same
    hyperparameters, started from over-dispersed draws around the VI posterior, and predicts by
    averaging over its draws (:attr:`gibbs_` holds the draws, :attr:`gibbs_summary_` split-R̂ and
    ESS). Gibbs bag predictions use the FITC conditional (instances of a bag independent given the
    inducing values) while VI's ``"joint"`` rule uses the full within-bag covariance, so the two
    differ at bag level by construction when ``M ≪ N``.

    Args:
        inference: ``"vi"`` or ``"gibbs"``.
        num_inducing: M.
        bag_rule: ``"joint"`` (default; ``1 − P(all m* < 0)`` with the full within-bag covariance —
            Genz/QMC orthant probability for VI, exact per-draw product for Gibbs), ``"noisy_or"``
            (instances independent) or ``"max"``.
        num_qmc_points, qmc_replicates: orthant integration (standard error from the replicates).
        num_samples, burn_in, thin, num_chains: Gibbs settings (kept draws per chain).
        init_dispersion: the Gibbs chains start from independent draws of the VI ``q(v) = N(m, S)``
            with covariance inflated to ``init_dispersion · S`` (default 4: over-dispersed, so that
            split-R̂ can flag chains that have not converged; see docs/probit.md).
        Other arguments as :class:`VGPMILClassifier`.
    """

    def __init__(
        self,
        inference: str = "vi",
        num_inducing: int = 100,
        bag_rule: str = "orthant",
        max_iter: int = 200,
        tol: float = 1e-5,
        warmup_iter: int = 20,
        learn_hyperparameters: bool = False,
        lr: float = 0.01,
        hyper_steps: int = 5,
        ard: bool = False,
        learn_inducing_locations: bool = False,
        standardize: bool = True,
        bags_per_batch: int | None = None,
        num_qmc_points: int = 1024,
        qmc_replicates: int = 8,
        num_samples: int = 1000,
        burn_in: int = 500,
        thin: int = 1,
        num_chains: int = 4,
        init_dispersion: float = 4.0,
        dtype: str = "float64",
        device: str = "cpu",
        random_state: int = 0,
        verbose: bool = False,
    ):
        self.inference = inference
        self.num_inducing = num_inducing
        self.bag_rule = bag_rule
        self.max_iter = max_iter
        self.tol = tol
        self.warmup_iter = warmup_iter
        self.learn_hyperparameters = learn_hyperparameters
        self.lr = lr
        self.hyper_steps = hyper_steps
        self.ard = ard
        self.learn_inducing_locations = learn_inducing_locations
        self.standardize = standardize
        self.bags_per_batch = bags_per_batch
        self.num_qmc_points = num_qmc_points
        self.qmc_replicates = qmc_replicates
        self.num_samples = num_samples
        self.burn_in = burn_in
        self.thin = thin
        self.num_chains = num_chains
        self.init_dispersion = init_dispersion
        self.dtype = dtype
        self.device = device
        self.random_state = random_state
        self.verbose = verbose

    def _make_likelihood(self) -> Any:
        from milgp.likelihoods.mil_probit import MILProbitLikelihood

        return MILProbitLikelihood()

    def _bag_rule(self) -> BagRule:
        if self.bag_rule in ("orthant", "joint"):
            return OrthantRule(num_points=self.num_qmc_points, replicates=self.qmc_replicates, seed=self.random_state)
        return make_bag_rule(self.bag_rule)

    def fit(self, bags: Sequence[Any], y: Any) -> "ProbitMILClassifier":
        """Fit on ``bags`` (sequence of ``(n_b, d)`` arrays) with bag labels ``y`` ``(B,)`` in {0, 1}."""
        from milgp.sampling.probit_gibbs import sample_probit_posterior

        if self.inference not in ("vi", "gibbs"):
            raise ValueError(f"inference must be 'vi' or 'gibbs', got {self.inference!r}")
        super().fit(bags, y)
        self.gibbs_ = None
        self.gibbs_summary_ = None
        if self.inference == "gibbs":
            bags_np = check_bags(bags)
            x, bag_index = self._to_tensor(bags_np)
            labels = torch.as_tensor(check_binary_bag_labels(y, len(bags_np)), dtype=x.dtype, device=self.device)
            self.gibbs_ = sample_probit_posterior(
                self.model_,
                BagBatch(x, bag_index, labels),
                num_samples=self.num_samples,
                burn_in=self.burn_in,
                thin=self.thin,
                num_chains=self.num_chains,
                init=self.model_.whitened_posterior(),
                init_dispersion=self.init_dispersion,
                seed=self.random_state,
                progress=self.verbose,
            )
            self.gibbs_summary_ = self.gibbs_.summary()
        return self

    def predict_bag_proba(self, bags: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        """Positive-bag probability ``(B,)`` and its error ``(B,)``: VI by the bag rule (the orthant
        rule's randomised-QMC standard error); Gibbs ``"joint"``/``"orthant"`` by the exact per-draw
        product averaged over draws (Monte-Carlo standard error ``sd/sqrt(ESS)``), other rules on the
        Gibbs instance probabilities."""
        if getattr(self, "gibbs_", None) is None:
            return super().predict_bag_proba(bags)
        x, bag_index, mean, var, B = self._latent(bags)
        with torch.no_grad():
            if self.bag_rule in ("joint", "joint_noisy_or", "orthant"):
                p, s = self.gibbs_.bag_probability(self.model_, x, bag_index, B)
            else:
                pi, _ = self.gibbs_.instance_probability(self.model_, x)
                if self.bag_rule == "noisy_or":
                    p = -torch.expm1(segment_sum(torch.log1p(-pi.clamp(max=1 - 1e-16)), bag_index, B))
                else:
                    p = pi.new_full((B,), -1.0).scatter_reduce(0, bag_index, pi, "amax", include_self=True)
                s = torch.zeros_like(p)
        return p.cpu().numpy(), s.cpu().numpy()

    def predict_instance_proba(self, bags: Sequence[Any], return_std: bool = False) -> list[np.ndarray] | tuple[list[np.ndarray], list[np.ndarray]]:
        """Per-bag lists of instance probabilities ``E[Φ(f*)]`` ``(n_b,)`` (and ``std[Φ(f*)]``)."""
        if getattr(self, "gibbs_", None) is None:
            return super().predict_instance_proba(bags, return_std=return_std)
        x, bag_index, _, _, B = self._latent(bags)
        with torch.no_grad():
            p, s = self.gibbs_.instance_probability(self.model_, x)
        probs = [t.cpu().numpy() for t in split_by_bag(p, bag_index, B)]
        if not return_std:
            return probs
        return probs, [t.cpu().numpy() for t in split_by_bag(s, bag_index, B)]
