"""Aggregate-output bag likelihoods (VBAgg: Law et al., *Variational Learning on
Aggregate Outputs with Gaussian Processes*, NeurIPS 2018): shared machinery.

Bag ``a`` holds instances ``x_i`` with known weights/populations ``w_i > 0`` and one observed
aggregate ``y_a`` whose mean parameter is ``η_a = Σ_i w_i Ψ(f_i)`` (Law et al. 2018, Eq. 2/17), with
``f ~ GP`` and a link ``Ψ`` (``exp``, ``square`` or ``identity``). Concrete likelihoods
(:mod:`~milgp.likelihoods.aggregate_poisson`, :mod:`~milgp.likelihoods.aggregate_normal`,
:mod:`~milgp.likelihoods.aggregate_exponential`) implement one method,
:meth:`AggregateLikelihood.bag_terms`: the per-bag expected log-likelihood (exact, a lower bound,
or the paper's Taylor approximation) as a differentiable function of ``q(f)``.

``q(f)`` is passed as instance marginals ``mean, var`` ``(N,)`` and, for the likelihoods that
need the within-bag covariance (``needs_covariance``: Poisson-square, Normal), as
:class:`PaddedBlocks` — the per-bag joint ``q(f_b) = N(m^a, S^a)`` (Law et al. 2018, Eq. 9) padded to the
largest bag of a group, ``S^a = K_bb + jitter·I − A_bᵀA_b + A_bᵀ S A_b`` (whitened), never N×N.

**GPyTorch pitfall** (docs/aggregate.md, "Plugging into plain GPyTorch"): a train-mode ``model(x)``
has invalid off-diagonal entries; :meth:`AggregateLikelihood.expected_log_prob` says what to pass.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import gpytorch
import numpy as np
import torch
from linear_operator.operators import DiagLinearOperator, SumLinearOperator
from scipy import stats
from torch import Tensor

from milgp.data.bags import Bags, identity_padded, to_padded, weights_or_ones
from milgp.likelihoods.base import bag_share, bags_from_keywords, refuse_empty_bags

__all__ = [
    "AggregateLikelihood",
    "ExpLink",
    "IdentityLink",
    "Link",
    "BlockBase",
    "PaddedBlocks",
    "SquareLink",
    "bag_blocks",
    "block_base",
    "blocks_from_base",
    "make_link",
    "whitened_marginals",
]


# -- links Ψ and the distribution of Ψ(f) for Gaussian f -----------------------------------------
class Link(ABC):
    """``η = Ψ(f)``; moments and quantiles of ``Ψ(f)`` for ``f ~ N(μ, σ²)``."""

    name: str = ""
    positive: bool = True
    """Whether ``Ψ`` takes positive values only (a zero rate has no finite latent value)."""

    @abstractmethod
    def __call__(self, f: Tensor) -> Tensor: ...

    @abstractmethod
    def mean(self, mu: Tensor, var: Tensor) -> Tensor: ...

    @abstractmethod
    def inverse(self, rate: float) -> float:
        """``Ψ⁻¹(rate)``: the latent value whose link is ``rate`` (positive where ``Ψ`` is), e.g.
        to start a constant mean at the pooled rate ``Σy / Σw``."""

    @abstractmethod
    def covariance(self, mu_i: Tensor, var_i: Tensor, mu_j: Tensor, var_j: Tensor, cov_ij: Tensor) -> Tensor:
        """``Cov(Ψ(f_i), Ψ(f_j))`` for jointly Gaussian ``f`` with means ``mu``, variances ``var`` and
        covariance ``cov_ij`` (broadcast)."""

    def variance(self, mu: Tensor, var: Tensor) -> Tensor:
        return self.covariance(mu, var, mu, var, var)

    @abstractmethod
    def quantile(self, mu: np.ndarray, var: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Quantiles of ``Ψ(f)``: ``mu, var`` ``(n,)``, ``q`` ``(k,)`` → ``(n, k)``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ExpLink(Link):
    """``Ψ(f) = e^f``: ``Ψ(f)`` is log-normal."""

    name = "exp"

    def __call__(self, f: Tensor) -> Tensor:
        return torch.exp(f)

    def inverse(self, rate: float) -> float:
        return math.log(rate)

    def mean(self, mu: Tensor, var: Tensor) -> Tensor:
        return torch.exp(mu + 0.5 * var)

    def covariance(self, mu_i: Tensor, var_i: Tensor, mu_j: Tensor, var_j: Tensor, cov_ij: Tensor) -> Tensor:
        """``E_i E_j (e^{S_ij} − 1)`` with the log-normal means ``E_i = E[e^{f_i}]``."""
        return self.mean(mu_i, var_i) * self.mean(mu_j, var_j) * torch.expm1(cov_ij)

    def variance(self, mu: Tensor, var: Tensor) -> Tensor:
        return torch.expm1(var) * torch.exp(2 * mu + var)

    def quantile(self, mu: np.ndarray, var: np.ndarray, q: np.ndarray) -> np.ndarray:
        return np.exp(mu[:, None] + np.sqrt(var)[:, None] * stats.norm.ppf(q)[None, :])


class SquareLink(Link):
    """``Ψ(f) = f²``: ``Ψ(f)/σ²`` is non-central χ² with 1 degree of freedom, ``nc = μ²/σ²``."""

    name = "square"

    def __call__(self, f: Tensor) -> Tensor:
        return f * f

    def inverse(self, rate: float) -> float:
        return math.sqrt(rate)

    def mean(self, mu: Tensor, var: Tensor) -> Tensor:
        return mu * mu + var

    def covariance(self, mu_i: Tensor, var_i: Tensor, mu_j: Tensor, var_j: Tensor, cov_ij: Tensor) -> Tensor:
        return 2 * cov_ij * cov_ij + 4 * mu_i * mu_j * cov_ij

    def quantile(self, mu: np.ndarray, var: np.ndarray, q: np.ndarray) -> np.ndarray:
        nc = (mu * mu / var)[:, None]
        qq = np.broadcast_to(q[None, :], (len(mu), len(q)))
        # scipy's ncx2 needs nc > 0 for stability; nc → 0 is the central χ².
        out = np.where(nc > 1e-10, stats.ncx2.ppf(qq, 1, np.maximum(nc, 1e-10)), stats.chi2.ppf(qq, 1))
        return var[:, None] * out


class IdentityLink(Link):
    """``Ψ(f) = f``: Gaussian."""

    name = "identity"
    positive = False

    def __call__(self, f: Tensor) -> Tensor:
        return f

    def inverse(self, rate: float) -> float:
        return rate

    def mean(self, mu: Tensor, var: Tensor) -> Tensor:
        return mu

    def covariance(self, mu_i: Tensor, var_i: Tensor, mu_j: Tensor, var_j: Tensor, cov_ij: Tensor) -> Tensor:
        return cov_ij

    def quantile(self, mu: np.ndarray, var: np.ndarray, q: np.ndarray) -> np.ndarray:
        return mu[:, None] + np.sqrt(var)[:, None] * stats.norm.ppf(q)[None, :]


def make_link(link: str | Link) -> Link:
    """``"exp"`` / ``"square"`` / ``"identity"`` or a :class:`Link` instance."""
    if isinstance(link, Link):
        return link
    links = {"exp": ExpLink, "square": SquareLink, "identity": IdentityLink}
    if link not in links:
        raise ValueError(f"unknown link {link!r}: use 'exp', 'square' or 'identity'")
    return links[link]()


# -- per-bag joint q(f_b) ------------------------------------------------------------------------
@dataclass
class PaddedBlocks:
    """Joint ``q(f_b)`` of a group of bags, padded to the largest bag.

    Attributes:
        mean: ``(B, n_max)``; cov: ``(B, n_max, n_max)`` (padding rows/columns: identity);
        weights: ``(B, n_max)`` with **zeros at padding**, so weighted sums ignore padded entries;
        mask: ``(B, n_max)`` ``True`` at real instances.
    """

    mean: Tensor
    cov: Tensor
    weights: Tensor
    mask: Tensor


def whitened_marginals(A: Tensor, prior_var: Tensor, prior_mean: Tensor, m: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """``q(f_n)`` mean and variance from the whitened ``q(v) = N(m, S)`` (differentiable in all)."""
    mean = prior_mean + A.mT @ m
    var = prior_var - (A * A).sum(0) + (A * (S @ A)).sum(0)
    return mean, var.clamp_min(1e-10)


@dataclass
class BlockBase:
    """The ``q``-independent part of a group's per-bag blocks: ``A_pad`` ``(B, n_max, M)``,
    ``base = K_bb + jitter·I − A_bᵀA_b`` ``(B, n_max, n_max)``, prior means ``(B, n_max)``,
    weights (zero-padded) and mask. Cache it while the hyperparameters are fixed."""

    A_pad: Tensor
    base: Tensor
    prior_mean: Tensor
    weights: Tensor
    mask: Tensor


def block_base(model: Any, x: Tensor, proj: Any, bags: Bags, weights: Tensor, kernel_grad: bool = True) -> BlockBase:
    """:class:`BlockBase` of the bags ``bags`` of instances ``x`` (``model``: an ``ApproximateGP`` on
    :class:`milgp.models.ClosedFormStrategy`, ``proj`` its projection of ``x``; the blocks are the
    strategy's :meth:`~milgp.models.ClosedFormStrategy.residual_blocks`). ``kernel_grad=False``
    builds the kernel block without a graph."""
    A_pad, _ = to_padded(proj.A.mT, bags)  # (B, n, M)
    mu0_pad, _ = to_padded(proj.prior_mean, bags)
    w_pad, _ = to_padded(weights, bags, fill=0.0)
    base, mask = model.variational_strategy.residual_blocks(x, bags, A_pad, kernel_grad)
    return BlockBase(A_pad=A_pad, base=base, prior_mean=mu0_pad, weights=w_pad, mask=mask)


def blocks_from_base(bb: BlockBase, m: Tensor, S: Tensor) -> PaddedBlocks:
    """``S^a = base + A_bᵀ S A_b`` and ``m^a = μ0 + A_bᵀ m`` (differentiable in ``m, S``)."""
    cov = identity_padded(bb.base + bb.A_pad @ S @ bb.A_pad.mT, bb.mask)
    mean = bb.prior_mean + (bb.A_pad @ m.unsqueeze(-1)).squeeze(-1)
    return PaddedBlocks(mean=mean, cov=cov, weights=bb.weights, mask=bb.mask)


def bag_blocks(
    model: Any,
    x: Tensor,
    proj: Any,
    bags: Bags,
    m: Tensor,
    S: Tensor,
    weights: Tensor,
    kernel_grad: bool = True,
) -> PaddedBlocks:
    """Per-bag blocks ``S^a = K_bb + jitter·I + A_bᵀ(S − I)A_b`` and means (Law et al. 2018, Eq. 9, whitened).

    Arguments as :func:`block_base`. Differentiable in ``m``, ``S`` and the kernel hyperparameters
    (``kernel_grad=False``: e.g. for natural steps). Memory ``O(B · n_max²)``: group bags of similar size.
    """
    return blocks_from_base(block_base(model, x, proj, bags, weights, kernel_grad), m, S)


def _blocks_from_distribution(function_dist: Any, bags: Bags, weights: Tensor) -> PaddedBlocks:
    """Index a full-covariance GPyTorch ``MultivariateNormal`` per bag (no N×N is formed)."""
    idx = torch.arange(bags.num_instances, device=bags.index.device)
    idx_pad, mask = to_padded(idx, bags, fill=0)  # long, as idx
    cov = function_dist.lazy_covariance_matrix[idx_pad[:, :, None], idx_pad[:, None, :]]
    cov = cov.to_dense() if hasattr(cov, "to_dense") else cov
    mean_pad, _ = to_padded(function_dist.mean, bags)
    w_pad, _ = to_padded(weights, bags, fill=0.0)
    return PaddedBlocks(mean=mean_pad, cov=identity_padded(cov, mask), weights=w_pad, mask=mask)


def _is_train_mode_diagonal(function_dist: Any) -> bool:
    """True when GPyTorch returned its train-mode ``diag=True`` covariance (invalid off-diagonals)."""
    cov = function_dist.lazy_covariance_matrix
    parts = cov.linear_ops if isinstance(cov, SumLinearOperator) else (cov,)
    return any(type(op) is DiagLinearOperator for op in parts)


# -- base class ----------------------------------------------------------------------------------
class AggregateLikelihood(gpytorch.likelihoods.Likelihood, ABC):
    """Base class of the aggregate-output bag likelihoods (see the module docstring).

    Subclasses set :attr:`needs_covariance` and implement :meth:`bag_terms`; optionally
    :meth:`check_targets`, :meth:`observation_moments` and, with :attr:`conjugate`,
    ``closed_form_statistics``.
    """

    needs_covariance: bool = False
    conjugate: bool = False
    """Whether ``closed_form_statistics(y, weights, A, prior_mean, bags)`` gives the exact natural
    statistics (the expected log-likelihood is quadratic in ``v``: Normal), so that a natural step
    with ρ = 1 on all bags is the optimum of q(v)."""
    target_name: str = "target"

    def __init__(self, link: str | Link):
        super().__init__()
        self.link = make_link(link)

    def pooled_latent(self, y: Tensor, weights: Tensor) -> float:
        """``Ψ⁻¹(Σ_a y_a / Σ_i w_i)``: the constant latent value whose rate explains the total of
        the targets ``y`` ``(B,)`` over the weights ``(N,)`` — where a constant mean starts.

        A positive link cannot start at a zero total (all counts 0): half a count stands in for it
        (a continuity correction), still relative to ``Σ_i w_i``, so scaling every population by
        one factor changes no prediction."""
        total = float(y.sum())
        if self.link.positive and total <= 0:
            total = 0.5
        return self.link.inverse(total / float(weights.sum()))

    # -- interface --------------------------------------------------------------------------
    @abstractmethod
    def bag_terms(
        self,
        y: Tensor,
        weights: Tensor,
        mean: Tensor,
        var: Tensor,
        bags: Bags,
        blocks: PaddedBlocks | None,
    ) -> Tensor:
        """Per-bag expected log-likelihood ``(B,)`` of the bags ``bags`` (exact, bound or approximation; includes the
        normalising constants so that it is comparable with ``E_q[log p(y_a | f_a)]``)."""

    @abstractmethod
    def log_prob_given_rate(self, y: Tensor, rate: Tensor, weight_sq_sum: Tensor) -> Tensor:
        """``log p(y_a | η_a)`` of the observed aggregate given its rate ``η_a = Σ w_i Ψ(f_i)``
        (broadcast over leading sample dimensions of ``rate``; ``weight_sq_sum`` ``(B,)`` is
        ``Σ w_i²``, the Normal model's noise scale). The bag's predictive log-likelihood is its
        average over the joint ``q(f_b)`` (:func:`milgp.variational.aggregate_fit.bag_log_predictive`)."""

    def check_targets(self, y: np.ndarray) -> None:
        """Raise ``ValueError`` naming the first bag whose (finite) target is invalid for this model
        (:meth:`refuse_bags`); every finite target is valid unless a subclass says otherwise."""

    def refuse_bags(self, invalid: np.ndarray, y: np.ndarray, rule: str) -> None:
        """``ValueError`` naming the first bag where ``invalid`` ``(B,)`` holds, its target ``y`` and
        the ``rule`` it breaks."""
        bad = np.nonzero(invalid)[0]
        if len(bad):
            raise ValueError(f"bag {int(bad[0])} has {self.target_name} {float(y[bad[0]])}; {rule}")

    def observation_moments(self, rate_mean: Tensor, rate_var: Tensor, weight_sq_sum: Tensor) -> tuple[Tensor, Tensor]:
        """Predictive mean and variance of the observed ``y_a`` given the mean and variance of
        ``η_a = Σ w_i Ψ(f_i)`` (law of total variance)."""
        return rate_mean, rate_var

    def bag_metrics(self, y: np.ndarray, y_mean: np.ndarray) -> dict[str, float]:
        """Metrics of predicted aggregates ``y_mean`` ``(B,)`` against the targets ``y`` ``(B,)``
        that only this observation model defines (e.g. the Poisson deviance), named without the
        ``bag_`` prefix; the squared and absolute errors are every model's and are not here."""
        return {}

    # -- validation ---------------------------------------------------------------------------
    def check_data(self, y: Any, weights: Any, bags: Bags) -> None:
        """Validate targets ``(B,)`` and weights ``(N,)`` of ``bags``: ``ValueError`` naming the bag."""
        num_bags = bags.num_bags
        y_np = np.asarray(y.detach().cpu().numpy() if isinstance(y, Tensor) else y, dtype=np.float64)
        if y_np.shape != (num_bags,):
            raise ValueError(f"expected one {self.target_name} per bag ({num_bags}), got shape {y_np.shape}")
        self.refuse_bags(~np.isfinite(y_np), y_np, "targets must be finite (no NaN/inf)")
        self.check_targets(y_np)
        w = np.asarray(weights.detach().cpu().numpy() if isinstance(weights, Tensor) else weights, dtype=np.float64)
        bad = np.nonzero(~(np.isfinite(w) & (w > 0)))[0]
        if len(bad):
            i = int(bad[0])
            raise ValueError(
                f"bag {int(bags.index[i])} has weight/population {float(w[i])} (instance {i}); "
                "populations must be finite and strictly positive"
            )

    def _check_layout(self, target: Tensor, weights: Tensor, bags: Bags, targets_given: bool) -> None:
        """``expected_log_prob``'s inputs against ``bag_index`` (its shape, ids and ``target``'s shape:
        :func:`bags_from_keywords`): one weight per instance, every bag with instances (a minibatch
        that kept its global bag ids gave a finite loss and NaN gradients) and, read from ``target``,
        one value per bag (individual observations would be replaced by one instance's); one-line
        ``ValueError``s."""
        index, n = bags.index, bags.num_instances
        if tuple(weights.shape) != (n,):
            raise ValueError(f"weights has shape {tuple(weights.shape)}; it must be ({n},), one population per instance")
        refuse_empty_bags(bags)
        if targets_given:
            return
        per_bag = target.new_zeros(bags.num_bags).scatter(0, index, target)
        differ = torch.nonzero(per_bag[index] != target).flatten()
        if len(differ):
            raise ValueError(f"bag {int(index[differ[0]])} has different targets on its instances; the target is the bag's "
                             "aggregate repeated on each instance (y[bag_index]), not individual observations")

    # -- GPyTorch entry point ---------------------------------------------------------------
    def expected_log_prob(self, target: Tensor, function_dist: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Expected log-likelihood per instance ``(N,)`` for ``gpytorch.mlls.VariationalELBO``.

        Each bag's term (:meth:`bag_terms`) is split evenly over its instances, so the sum over a
        minibatch of whole bags is the bag-level value and ``num_data`` = number of instances.

        Keyword args:
            bag_index: ``(N,)`` long, required.
            weights: ``(N,)`` populations (default ones).
            bag_targets: ``(B,)``; default: read from ``target`` (``y_a`` broadcast to instances).
            model, x: the :class:`~milgp.models.SparseGP` and its inputs. When given (and the
                likelihood needs within-bag covariances) the per-bag blocks are built from them —
                the recommended call in training mode: ``mll(model(x), y[bag_index],
                bag_index=bag_index, weights=w, model=model, x=x)``. Otherwise ``function_dist``
                must carry a full covariance: ``model(x, diag=False)`` or eval mode.
            check: validate targets and weights (default ``True``).
        """
        mean, var = function_dist.mean, function_dist.variance
        bags, y = bags_from_keywords(
            self, kwargs, "bag_targets", "mll(output, y[bag_index], bag_index=bag_index)", target, int(mean.shape[-1])
        )
        weights = weights_or_ones(kwargs.get("weights"), mean)
        check = kwargs.get("check", True)
        if check:
            self._check_layout(target, weights, bags, targets_given=y is not None)
        if y is None:
            y = target.new_zeros(bags.num_bags).scatter(0, bags.index, target)
        y = y.to(mean)
        if check:
            self.check_data(y, weights, bags)
        blocks = None
        model, x = kwargs.get("model"), kwargs.get("x")
        if self.needs_covariance:
            if model is not None and x is not None:
                q_u = model.variational_strategy.variational_distribution
                m, S = q_u.mean, q_u.covariance_matrix
                strategy = model.variational_strategy
                if not hasattr(strategy, "projection"):  # the likelihoods do not import the strategy's layer
                    raise TypeError(f"model=, x= need a model whose variational_strategy is milgp's ClosedFormStrategy, "
                                    f"got {type(strategy).__name__}; or pass model(x, diag=False) without them")
                proj = strategy.projection(x)
                mean, var = whitened_marginals(proj.A, proj.prior_var, proj.prior_mean, m, S)
                blocks = bag_blocks(model, x, proj, bags, m, S, weights)
            elif _is_train_mode_diagonal(function_dist) and bool((bags.sizes > 1).any()):
                raise ValueError(
                    f"{type(self).__name__} needs the within-bag covariance, but function_dist is GPyTorch's "
                    "train-mode diag=True output whose off-diagonal entries are not valid. "
                    "Pass model=model, x=x to expected_log_prob / the mll, or call model(x, diag=False)."
                )
            else:
                blocks = _blocks_from_distribution(function_dist, bags, weights)
        return bag_share(self.bag_terms(y, weights, mean, var, bags, blocks), bags)

    # -- predictions --------------------------------------------------------------------------
    def rate_mean(self, mean: Tensor, var: Tensor) -> Tensor:
        """Posterior mean of the individual rate/mean parameter ``Ψ(f)``."""
        return self.link.mean(mean, var)

    def rate_quantiles(self, mean: Tensor, var: Tensor, q: Any) -> np.ndarray:
        """Posterior quantiles of ``Ψ(f)`` ``(n, k)`` (log-normal / scaled ncχ² / Gaussian)."""
        q = np.atleast_1d(np.asarray(q, dtype=np.float64))
        if q.ndim != 1 or not ((q > 0) & (q < 1)).all():  # NaN fails the test too
            raise ValueError(f"quantile levels must be a number or a 1-D array in (0, 1), got {q.tolist()}")
        mu = mean.detach().cpu().double().numpy()
        v = var.detach().cpu().double().clamp_min(1e-300).numpy()
        return self.link.quantile(mu, v, q)

    def rate_covariance(self, mean_r: Tensor, var_r: Tensor, mean_c: Tensor, var_c: Tensor, cov_rc: Tensor) -> Tensor:
        """``Cov[Ψ(f_r), Ψ(f_c)]`` ``(..., n_r, n_c)`` for jointly Gaussian ``f`` with marginal means
        and variances ``(..., n_r)``, ``(..., n_c)`` and cross-covariance ``cov_rc``."""
        rows, cols = (mean_r.unsqueeze(-1), var_r.unsqueeze(-1)), (mean_c.unsqueeze(-2), var_c.unsqueeze(-2))
        return self.link.covariance(*rows, *cols, cov_rc)

    def bag_rate_moments(self, blocks: PaddedBlocks) -> tuple[Tensor, Tensor]:
        """Mean and variance ``(B,)`` of the bag aggregate ``η_a = Σ w_i Ψ(f_i)`` under the joint
        ``q(f_b)`` (full within-bag covariance)."""
        w = blocks.weights
        var_diag = torch.diagonal(blocks.cov, dim1=-2, dim2=-1)
        mu, var = blocks.mean * blocks.mask, var_diag * blocks.mask  # padding: finite, weight 0
        cov = self.rate_covariance(mu, var, mu, var, blocks.cov)
        mean = (w * self.link.mean(blocks.mean, var_diag)).sum(-1)
        variance = (w.unsqueeze(-1) * cov * w.unsqueeze(-2)).sum((-1, -2))
        return mean, variance.clamp_min(0)

    def extra_repr(self) -> str:
        return f"link={self.link.name!r}"

