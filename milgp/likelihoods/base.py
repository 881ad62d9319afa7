"""The interface every augmented bag likelihood implements.

An *augmented* bag likelihood is one whose expected log-likelihood, after introducing local
variables (Pólya-Gamma/GSM scales and instance labels for VGPMIL, truncated normals for the
probit model), is quadratic in ``f`` with coefficients available in closed form:

    E_q[log p(T | f, locals)] = Σ_n b_n f_n − ½ Σ_n λ_n f_n² + const(locals).

Subclasses implement four small methods; this base class turns them into :meth:`expected_log_prob`
for plain GPyTorch (``VariationalELBO`` + Adam or ``NGD``), and :func:`milgp.variational.fit_closed_form`
into the closed-form natural update and Algorithm 1.

Shapes: ``mean``, ``var`` are ``(N,)``; ``bag_labels`` is ``(B,)``; ``bags`` is the batch's
:class:`~milgp.data.bags.Bags` (``bags.index`` ``(N,)``, ``bags.num_bags`` ``B``).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import gpytorch
import torch
from torch import Tensor
from torch.distributions import Bernoulli

from milgp.data.bags import Bags, check_bag_index_dtype, segment_max
from milgp.likelihoods.instance_link import InstanceLink

__all__ = ["AugmentedBagLikelihood", "bag_share", "bags_from_keywords", "check_bag_size_cap", "refuse_empty_bags"]


def check_bag_size_cap(cap: float | None) -> float | None:
    """``None`` or a number ≥ 1 (a bag-size cap below one instance means nothing)."""
    if cap is not None and not cap >= 1:
        raise ValueError(f"bag_size_cap must be None or at least 1, got {cap!r}")
    return None if cap is None else float(cap)


def bags_from_keywords(
    likelihood: Any, kwargs: dict[str, Any], labels_key: str, example: str, target: Tensor, num_instances: int
) -> tuple[Bags, Tensor | None]:
    """The :class:`Bags` of ``expected_log_prob``'s keyword ``bag_index`` ``(N,)`` (required:
    ``ValueError`` citing the call ``example``) and its keyword ``labels_key`` ``(B,)``, whose length,
    when given, is the number of bags (no device synchronisation on ``bag_index.max()``).

    One-line ``ValueError``s unless ``bag_index`` has one entry per instance of the ``num_instances``
    of ``function_dist``, and, without ``labels_key``, ``target`` is ``(N,)`` (each bag's value
    repeated on its instances); with ``check`` (default), also unless the ids lie in ``0..B-1``
    (one synchronisation)."""
    bag_index = kwargs.get("bag_index")
    if bag_index is None:
        raise ValueError(
            f"{type(likelihood).__name__}.expected_log_prob needs bag_index=(N,) as a keyword argument, "
            f"e.g. {example}"
        )
    check_bag_index_dtype(bag_index)
    if tuple(bag_index.shape) != (num_instances,):
        raise ValueError(f"bag_index has shape {tuple(bag_index.shape)}; it must be ({num_instances},), the bag of each instance")
    labels = kwargs.get(labels_key)
    if labels is not None and labels.dim() != 1:
        raise ValueError(f"{labels_key} has shape {tuple(labels.shape)}; it must be (B,), one value per bag")
    if labels is None and tuple(target.shape) != (num_instances,):
        raise ValueError(f"target has shape {tuple(target.shape)}; it must be ({num_instances},), each bag's value on its "
                         f"instances (y[bag_index]), or pass {labels_key}=(B,)")
    bags = Bags.from_index(bag_index, None if labels is None else int(labels.shape[0]))
    if kwargs.get("check", True) and num_instances:
        low, high = torch.stack([bag_index.min(), bag_index.max()]).tolist()
        if low < 0 or high >= bags.num_bags:
            raise ValueError(f"bag_index holds bag {low if low < 0 else high}, but the {bags.num_bags} bags of {labels_key} "
                             f"are 0..{bags.num_bags - 1}" if labels is not None else f"bag_index holds bag {low}; bag ids start at 0")
    return bags, labels


def refuse_empty_bags(bags: Bags, of: str = "a minibatch") -> None:
    """One-line ``ValueError`` when a bag of ``bags`` has no instances: for ``expected_log_prob``'s
    ``bag_index``, a minibatch that kept its global bag ids (its loss was finite, its gradients or
    labels not); ``of`` names what the bags are in the advice."""
    empty = torch.nonzero(bags.sizes == 0).flatten()
    if len(empty):
        raise ValueError(f"bag {int(empty[0])} has no instances ({len(empty)} such bag(s)): number the bags of {of} "
                         "0..B-1 (torch.unique(bag_index, return_inverse=True)[1])")


def bag_share(bag_values: Tensor, bags: Bags) -> Tensor:
    """Spread per-bag values ``(B,)`` evenly over their instances ``(N,)``."""
    return (bag_values / bags.sizes.to(bag_values.dtype))[bags.index]


class AugmentedBagLikelihood(gpytorch.likelihoods.Likelihood, ABC):
    """Base class of bag likelihoods with closed-form local updates (see module docstring).

    **Bag-size cap.** With :attr:`bag_size_cap` ``= n̄`` set, the instance terms of a bag of
    ``n_b > n̄`` instances are tempered by ``w_b = n̄ / n_b`` (a power likelihood per bag) in the
    natural statistics, the ELBO and the locals' updates, so no bag carries more evidence about ``f``
    than ``n̄`` instances do; the objective is then no bound on ``log p(T)`` (docs/core.md, "Real MIL
    data: what went wrong", 8). ``None`` (the default here) is the model as published.
    """

    bag_size_cap: float | None = None
    instance_link: InstanceLink  # p(y = 1 | f) of one instance and its moments under q(f): the bag rules read it

    def instance_weights(self, bags: Bags, dtype: torch.dtype) -> Tensor | None:
        """``w_n = min(1, n̄ / n_b)`` ``(N,)`` for the bag-size cap ``n̄``, or ``None`` without one."""
        if self.bag_size_cap is None:
            return None
        return (self.bag_size_cap / bags.sizes.to(dtype)).clamp(max=1.0)[bags.index]

    def _tempered(self, values: Tensor, bags: Bags) -> Tensor:
        """``values`` ``(N,)`` multiplied by :meth:`instance_weights` (unchanged without a cap)."""
        w = self.instance_weights(bags, values.dtype)
        return values if w is None else w * values

    def quadratic_terms(self, mean: Tensor, var: Tensor, bags: Bags, bag_labels: Tensor, locals_: Any) -> tuple[Tensor, Tensor]:
        """``(b, λ)`` ``(N,), (N,)``: coefficients of the augmented expected log-likelihood
        (:meth:`_quadratic_terms` tempered by :meth:`instance_weights`)."""
        b, lam = self._quadratic_terms(mean, var, bags, bag_labels, locals_)
        return self._tempered(b, bags), self._tempered(lam, bags)

    @abstractmethod
    def init_locals(self, bags: Bags, bag_labels: Tensor, mean: Tensor) -> Any:
        """Initial state of the local factors that persist across iterations (``None`` if none)."""

    @abstractmethod
    def update_locals(self, mean: Tensor, var: Tensor, bags: Bags, bag_labels: Tensor, locals_: Any) -> Any:
        """Closed-form coordinate-ascent update of the persistent local factors given q(f)."""

    @abstractmethod
    def _quadratic_terms(self, mean: Tensor, var: Tensor, bags: Bags, bag_labels: Tensor, locals_: Any) -> tuple[Tensor, Tensor]:
        """``(b, λ)`` of the untempered model."""

    @abstractmethod
    def elbo_terms(self, mean: Tensor, var: Tensor, bags: Bags, bag_labels: Tensor, locals_: Any) -> Tensor:
        """Per-instance contributions ``(N,)`` to the closed-form ELBO's data part (everything but
        ``−KL``; bag-level terms split evenly over the bag's instances; the ``f``-dependent instance
        terms tempered by :meth:`instance_weights`). Differentiable in ``mean`` and ``var`` with the
        locals held fixed (hyperparameter steps)."""

    @abstractmethod
    def instance_label_posterior(self, mean: Tensor, var: Tensor, bags: Bags, bag_labels: Tensor, locals_: Any) -> Tensor:
        """``q(y_n = 1)`` ``(N,)``: the probability of each training instance's own label given its
        bag's label and ``q(f)`` (0 in a negative bag). The estimators map instance scores to
        its average (:class:`~milgp.prediction.InstanceCalibrator`)."""

    def hyperparameter_terms(self, mean: Tensor, var: Tensor, bags: Bags, bag_labels: Tensor, locals_: Any) -> Tensor:
        """Per-instance objective ``(N,)`` maximised over kernel hyperparameters with q(v) and the
        locals fixed (Algorithm 1, step 8). Defaults to :meth:`elbo_terms`."""
        return self.elbo_terms(mean, var, bags, bag_labels, locals_)

    def check_bag_labels(self, bag_labels: Tensor) -> None:
        """Bag labels ``(B,)`` 0 or 1 (1 = positive; others would enter the updates linearly):
        ``ValueError`` naming the first bad bag."""
        bad = (bag_labels != 0) & (bag_labels != 1)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(f"bag {b} has label {float(bag_labels[b]):g}; the MIL likelihoods take bag labels 0 or 1 "
                             "(1 = positive; map -1/+1 labels first)")

    locals_range: tuple[float, float] = (-math.inf, math.inf)
    """The closed interval the per-instance locals lie in (VGPMIL's ``π``: ``[0, 1]``)."""

    def check_locals(self, locals_: Any, bags: Bags, name: str = "initial_locals") -> None:
        """Locals given to start from: a tensor of locals holds one finite value per instance, in
        :attr:`locals_range` (``ValueError`` naming ``name`` and the first bad instance). Locals of
        another kind (a subclass's own) pass unchecked."""
        if not isinstance(locals_, Tensor):
            return
        if locals_.shape != (bags.num_instances,):
            raise ValueError(f"{name} has shape {tuple(locals_.shape)}; {type(self).__name__} needs one local per instance, ({bags.num_instances},)")
        low, high = self.locals_range
        bad = ~(torch.isfinite(locals_) & (locals_ >= low) & (locals_ <= high))
        if bool(bad.any()):
            n = int(bad.nonzero()[0, 0])
            within = "" if (low, high) == (-math.inf, math.inf) else f" and in [{low:g}, {high:g}]"
            raise ValueError(f"{name}[{n}] is {float(locals_[n])!r}; {type(self).__name__}'s locals must be finite{within}")

    # -- GPyTorch ------------------------------------------------------------------------------
    def optimal_locals(
        self, mean: Tensor, var: Tensor, bags: Bags, bag_labels: Tensor, max_sweeps: int = 200, tol: float = 1e-9
    ) -> Tensor:
        """Locals at their fixed point for a fixed q(f): coordinate-ascent passes from
        :meth:`init_locals` until no local moves by more than ``tol`` (at most ``max_sweeps``). Five
        passes, as before, left VGPMIL's damped largest-other-π rule far from it: the ELBO that
        ``VariationalELBO`` and ``NGD`` saw at the closed-form fit's q(v) was −64.0 against −42.8."""
        locals_ = self.init_locals(bags, bag_labels, mean)
        for _ in range(max_sweeps):
            updated = self.update_locals(mean, var, bags, bag_labels, locals_)
            moved = float((updated - locals_).abs().max()) if updated.numel() else 0.0
            locals_ = updated
            if moved <= tol:
                break
        return locals_

    def expected_log_prob(self, target: Tensor, function_dist: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Augmented expected log-likelihood per instance ``(N,)`` for ``VariationalELBO``.

        Args:
            target: ``(N,)`` the label of each instance's bag (``bag_labels[bag_index]``).
            function_dist: ``q(f)`` over the ``N`` instances (GPyTorch ``MultivariateNormal``).
            bag_index: keyword, ``(N,)`` long.
            bag_labels: keyword, optional ``(B,)`` (default: the largest ``target`` of each bag; when
                given, no device synchronisation is needed to count the bags).
            locals: keyword, optional persistent locals (e.g. VGPMIL's ``π``); when omitted they are
                optimised for the current q(f) (:meth:`optimal_locals`).
            check: keyword, check the bag labels (:meth:`check_bag_labels`; default ``True``).

        The value equals the closed-form ELBO data term at the current locals; its gradient with
        respect to q(f) is that of the augmented (quadratic) bound, so one ``NGD(lr=1)`` step is the
        closed-form natural update.
        """
        mean, var = function_dist.mean, function_dist.variance
        bags, bag_labels = bags_from_keywords(
            self, kwargs, "bag_labels", "mll(output, target, bag_index=bag_index)", target, int(mean.shape[-1])
        )
        if kwargs.get("check", True):
            refuse_empty_bags(bags)
        if bag_labels is None:
            bag_labels = segment_max(target.to(mean.dtype), bags.index, bags.num_bags)
        if kwargs.get("check", True):
            self.check_bag_labels(bag_labels)
        with torch.no_grad():
            m_d, v_d = mean.detach(), var.detach()
            locals_ = kwargs.get("locals")
            if locals_ is None:
                locals_ = self.optimal_locals(m_d, v_d, bags, bag_labels)
            b, lam = self.quadratic_terms(m_d, v_d, bags, bag_labels, locals_)
            value = self.elbo_terms(m_d, v_d, bags, bag_labels, locals_)
            const = value - (b * m_d - 0.5 * lam * (m_d * m_d + v_d))
        return b * mean - 0.5 * lam * (mean * mean + var) + const

    def log_marginal(self, observations: Tensor, function_dist: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Refused with a ``TypeError``: GPyTorch's ``log_marginal`` (``PredictiveLogLikelihood``) sums
        per-instance terms ``log E_q[p(y_n | f_n)]`` and would fit an instance classifier to bag labels."""
        raise TypeError(
            f"{type(self).__name__} scores bags, not instances: PredictiveLogLikelihood would fit an instance "
            "classifier to bag labels. Train with gpytorch.mlls.VariationalELBO (mll(output, target, bag_index=...)) "
            "or milgp.variational.fit_closed_form, and predict bags with a milgp.prediction bag rule"
        )

    def marginal(self, function_dist: Any, *args: Any, **kwargs: Any) -> Bernoulli:
        """Predictive instance label ``Bernoulli(E[p(y=1|f*)])`` from :attr:`instance_link` (logistic:
        Castro-Macías et al. 2024, Eq. 31; probit: ``Φ(μ/sqrt(1 + σ²))``)."""
        return Bernoulli(probs=self.instance_link.moments(function_dist.mean, function_dist.variance)[0])
