"""scikit-learn-style estimators over bags (``clone``, ``GridSearchCV``, ``cross_val_score`` work).

Bags are given as a sequence of ``(n_b, d)`` arrays; bag targets as a ``(B,)`` array.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.utils.validation import check_is_fitted

from milgp.data.bags import BagBatch, flatten_bags, split_by_bag
from milgp.inducing import kmeans_pp_inducing, median_lengthscale
from milgp.likelihoods.mil_bernoulli import MILBernoulliLikelihood
from milgp.likelihoods.psi import GSMDensity
from milgp.models.sparse_gp import SparseGP
from milgp.variational.fit import FitResult, fit_closed_form

__all__ = ["VGPMILClassifier", "check_bags", "check_binary_bag_labels"]


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
        raise ValueError(f"bag {int(bad[0])} has label {y[bad[0]]!r}; bag labels must be 0 or 1")
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
        max_iter, tol, warmup_iter: iteration budget and relative ELBO tolerance.
        learn_hyperparameters, lr, hyper_steps: Adam on kernel hyperparameters.
        ard: one lengthscale per feature. learn_inducing_locations: train Z too.
        standardize: z-score features with training statistics.
        bags_per_batch: minibatch size in bags for stochastic natural steps (None: full batch).
        dtype: ``"float64"`` (default) or ``"float32"``. device: e.g. ``"cpu"``, ``"cuda"``.
    """

    def __init__(
        self,
        psi: str | GSMDensity = "pg",
        num_inducing: int = 100,
        H: float = 100.0,
        max_rule: str = "exact",
        bag_rule: str = "noisy_or",
        max_iter: int = 200,
        tol: float = 1e-5,
        warmup_iter: int = 20,
        learn_hyperparameters: bool = True,
        lr: float = 0.01,
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

    # -- scikit-learn API -----------------------------------------------------------------------
    def fit(self, bags: Sequence[Any], y: Any) -> "VGPMILClassifier":
        """Fit on ``bags`` (sequence of ``(n_b, d)`` arrays) with bag labels ``y`` ``(B,)`` in {0, 1}."""
        bags_np = check_bags(bags)
        y_np = check_binary_bag_labels(y, len(bags_np))
        if self.bag_rule not in ("noisy_or", "max", "joint"):
            raise ValueError(f"bag_rule must be 'noisy_or', 'max' or 'joint', got {self.bag_rule!r}")
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
        warm = fit_closed_form(
            self.model_, self.likelihood_, batch, max_iter=max(1, self.warmup_iter), learn_hyperparameters=False, **common
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
                **common,
            )
            main.elbo = warm.elbo + main.elbo
            main.iterations += warm.iterations
            main.seconds += warm.seconds
            self.fit_result_ = main
        self.elbo_ = self.fit_result_.elbo[-1]
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
        lik = self.likelihood_
        with torch.no_grad():
            if self.bag_rule == "noisy_or":
                p, s = lik.bag_probability_noisy_or(mean, var, bag_index, B)
            elif self.bag_rule == "max":
                p, s = lik.bag_probability_max(mean, var, bag_index, B)
            else:
                mean_pad, cov_pad, mask = self.model_.bag_covariances(x, bag_index, B)
                gen = torch.Generator(device=x.device).manual_seed(self.random_state)
                p, s = lik.bag_probability_joint(mean_pad, cov_pad, mask, generator=gen)
        return p.cpu().numpy(), s.cpu().numpy()

    def predict(self, bags: Sequence[Any]) -> np.ndarray:
        """Bag labels ``(B,)``: 1 where the positive-bag probability exceeds ½."""
        return (self.predict_proba(bags)[:, 1] > 0.5).astype(int)

    def predict_instance_proba(self, bags: Sequence[Any], return_std: bool = False) -> list[np.ndarray] | tuple[list[np.ndarray], list[np.ndarray]]:
        """Per-bag lists of instance probabilities ``(n_b,)`` (and their stds), seed 000 Eqs. 31–33."""
        _, bag_index, mean, var, B = self._latent(bags)
        with torch.no_grad():
            p, s = self.likelihood_.instance_probability(mean, var)
        probs = [t.cpu().numpy() for t in split_by_bag(p, bag_index, B)]
        if not return_std:
            return probs
        return probs, [t.cpu().numpy() for t in split_by_bag(s, bag_index, B)]
