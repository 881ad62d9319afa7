"""MIL-GP-Probit bag likelihood (Wang & Pinar, *The Multiple Instance Learning Gaussian Process Probit Model*, AISTATS 2021) for GPyTorch and the
closed-form fast path.

Model (Wang & Pinar 2021, Eqs. 5–12): ``h_n ~ Bern(Φ(f_n))``, bag label ``Y_b = max_{n∈b} h_n``. Augmented with
``m_n ~ N(f_n, 1)``, ``h_n = 1[m_n > 0]`` and ``h`` summed out: ``p(Y_b = 0 | M_b) = Π_n 1[m_n < 0]``,
``p(Y_b = 1 | M_b) = 1 − Π_n 1[m_n < 0]`` (Eqs. 11–12).

Variational family (Eqs. 13–16): ``q(u) p(f | u) Π_b q(M_b)`` with the optimal
``q(M_b) ∝ p(Y_b | M_b) Π_{n∈b} N(m_n; ν_n, 1)``. The persistent locals are ``ν`` ``(N,)`` (the
paper's ``μ^M``); its update (Eq. 19) sets ``ν_n = μ_n``, the mean of ``q(f_n)`` — *all* instances of
the bag, no leave-one-out. With ``P_b = Π_{i∈b} Φ(−ν_i)`` the normaliser and the means are

* negative bag: ``Z_b = P_b``, ``E[m_n] = ν_n − φ(ν_n)/Φ(−ν_n)`` (Eqs. 20–22);
* positive bag: ``Z_b = 1 − P_b``, ``E[m_n] = (ν_n − E₋(ν_n) P_b)/(1 − P_b)`` (Eq. 24), evaluated
  in the identical, cancellation-free form ``E[m_n] = ν_n + h(ν_n) · P_b/(1 − P_b)``,
  ``h(x) = φ(x)/Φ(−x)`` (:mod:`milgp.likelihoods.truncated_normal`: the stable ``log(1 − P_b)``).

The augmented expected log-likelihood is quadratic in ``f``: ``b_n = E[m_n]``, ``λ_n = 1``, so the
natural step is ``η̂₁ = s·A E[m]``, ``η̂₂ = −½(I + s·AAᵀ)`` (Wang & Pinar 2021, Eqs. 17–18 whitened).

**Exact ELBO** (the paper gives the updates, not the bound; derivation: docs/probit.md,
"Equations used"). With ``μ_n, σ²_n`` the marginals of ``q(f_n)``, the data part of the ELBO is

    Σ_n [ (μ_n − ν_n) E_ν[m_n] + ½ (ν_n² − μ_n²) − ½ σ²_n ] + Σ_b log Z_b(ν)           (★)

and the ELBO is (★) − KL(q(v) ‖ N(0, I)). (★) is concave-quadratic in ``q(f)`` for fixed ``ν``
(coefficients ``b = E[m]``, ``λ = 1``) and is maximised over ``ν`` at ``ν = μ``, so the two
coordinate steps (natural step with ρ = 1, then ``ν ← μ``) can never decrease it (tested). At
``ν = μ`` it collapses to the bound of the marginal model

    Σ_b log Z_b(μ) − ½ Σ_n σ²_n − KL,   log Z_b = Σ_{n∈b} log Φ(−μ_n)  or  log(1 − Π_{n∈b} Φ(−μ_n)),

which is what :meth:`MILProbitLikelihood.hyperparameter_terms` returns (a lower bound on
``log p(Y)`` for every kernel; the gradient of (★) at ``ν = μ`` is the same by the envelope
theorem). Every term is closed form; no quadrature.

**Single-instance learning** (``single_instance=True``): every instance of a positive bag is a
positive instance, ``p(Y_b = 1 | M_b) = Π_n 1[m_n > 0]`` — the probit model on instances labelled
with their bag's label, i.e. the model above with every instance of a positive bag its own bag.
Then ``Z_b = Π_n Φ(ν_n)`` and ``E[m_n] = ν_n + φ(ν_n)/Φ(ν_n)`` on positive bags; negative bags and
everything else are unchanged. It is a candidate of :class:`milgp.estimators.ProbitMILClassifier`'s
search beside the MIL model, as single-instance learning is of VGPMIL's.

Predictions (Wang & Pinar 2021, §3.4): instance ``Φ(μ*/sqrt(1 + σ*²))``; bag ``1 − P(all m* < 0)``,
an orthant probability (:mod:`milgp.likelihoods.orthant`).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.distributions import Bernoulli

from milgp.data.bags import Bags, segment_logsumexp, segment_sum
from milgp.likelihoods.base import AugmentedBagLikelihood, bag_share, check_bag_size_cap
from milgp.likelihoods.instance_link import ProbitLink
from milgp.likelihoods.noisy_or import log_prob_bag_all_negative
from milgp.likelihoods.truncated_normal import (
    hazard_excess,
    log_expm1_ratio,
    log_hazard,
    log_neg_log_ndtr,
    mean_below_zero,
)

__all__ = [
    "MILProbitLikelihood",
    "bag_log_normaliser",
    "expected_augmentation",
    "instance_log_cdf",
]


def instance_log_cdf(nu: Tensor, bag_index: Tensor, bag_labels: Tensor, single_instance: bool = False) -> Tensor:
    """``log Φ(−ν_n)`` ``(N,)``: the log-probability that ``m_n ~ N(ν_n, 1)`` is negative; with
    ``single_instance``, ``log Φ(ν_n)`` (that it is positive) on the instances of positive bags.
    :func:`bag_log_normaliser` and :func:`expected_augmentation` are both built from it."""
    if single_instance:
        return torch.special.log_ndtr(torch.where(bag_labels.to(torch.bool)[bag_index], nu, -nu))
    return torch.special.log_ndtr(-nu)


def bag_log_normaliser(
    nu: Tensor, bag_index: Tensor, bag_labels: Tensor, num_bags: int, single_instance: bool = False,
    log_cdf: Tensor | None = None,
) -> Tensor:
    """``log Z_b`` ``(B,)``: ``Z_b = P_b = Π_{i∈b} Φ(−ν_i)`` for negative and ``1 − P_b`` for positive
    bags (``single_instance``: ``Π_{i∈b} Φ(ν_i)``). ``log_cdf``: :func:`instance_log_cdf` of the same
    arguments, when already computed.

    ``log(1 − P_b)`` is ``L_b + log(expm1(S_b)/S_b)`` with ``S_b = log P_b = −exp(L_b)`` and
    ``L_b = logsumexp_{i∈b} log(−log Φ(−ν_i))``: exact when ``P_b → 1`` (every ``ν_i ≪ 0``; then
    ``log Z_b → logsumexp_i log Φ(ν_i)``) as well as when ``P_b → 0``.
    """
    log_cdf = instance_log_cdf(nu, bag_index, bag_labels, single_instance) if log_cdf is None else log_cdf
    log_p = segment_sum(log_cdf, bag_index, num_bags)  # single-instance: log Z_b itself
    if single_instance:
        return log_p
    L = segment_logsumexp(log_neg_log_ndtr(-nu, log_cdf), bag_index, num_bags)
    log_positive = L + log_expm1_ratio(-torch.exp(L))  # log(1 − P_b), S_b = −exp(L_b)
    return torch.where(bag_labels.to(torch.bool), log_positive, log_p)


def expected_augmentation(
    nu: Tensor, bag_index: Tensor, bag_labels: Tensor, num_bags: int, single_instance: bool = False,
    log_z: Tensor | None = None, log_cdf: Tensor | None = None,
) -> Tensor:
    """``E_q[m_n]`` ``(N,)`` under the optimal ``q(M_b)`` with locals ``ν`` (Wang & Pinar 2021, Eqs. 21–24).

    Negative bags: ``ν − h(ν)`` (continued fraction for large ``ν``); positive bags:
    ``ν_n + exp(log h(ν_n) + log P_b − log Z_b)`` (``single_instance``: ``ν_n + h(−ν_n)``, each
    instance truncated to ``m_n > 0``). ``log_z``, ``log_cdf``: :func:`bag_log_normaliser` and
    :func:`instance_log_cdf` of the same arguments, when already computed.
    """
    positive = bag_labels.to(torch.bool)[bag_index]
    log_cdf = instance_log_cdf(nu, bag_index, bag_labels, single_instance) if log_cdf is None else log_cdf
    if single_instance:  # m_n ~ N(ν_n, 1) truncated to the side of its bag's label: s·(h(x) − x), x = −s·ν
        sign = torch.where(positive, torch.ones_like(nu), -torch.ones_like(nu))
        x = -sign * nu
        return sign * hazard_excess(x, log_hazard(x, log_cdf))
    if log_z is None:
        log_z = bag_log_normaliser(nu, bag_index, bag_labels, num_bags, log_cdf=log_cdf)
    odds = segment_sum(log_cdf, bag_index, num_bags) - log_z  # log(P_b / (1 − P_b)) on positive bags
    log_h = log_hazard(nu, log_cdf)
    pos_mean = nu + torch.exp(torch.where(positive, log_h + odds[bag_index], torch.full_like(nu, -math.inf)))
    return torch.where(positive, pos_mean, mean_below_zero(nu, log_h))


class MILProbitLikelihood(AugmentedBagLikelihood):
    """MIL-GP-Probit bag likelihood (Wang & Pinar 2021), see the module docstring for the equations.

    Persistent locals: ``ν`` ``(N,)``, the means of the Gaussian factors of ``q(M_b)``.

    Args:
        bag_size_cap: temper the instances of bags longer than this (``None``: every instance counts).
        single_instance: every instance of a positive bag is a positive instance (module docstring).

    Example (plain GPyTorch)::

        lik = MILProbitLikelihood()
        mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=N)
        loss = -mll(model(x), bag_labels[bag_index], bag_index=bag_index)

    Bag predictions: :mod:`milgp.prediction.bag_rules` with :attr:`instance_link` (``Φ``), e.g. the
    orthant rule ``1 − P(all m* < 0)``.
    """

    instance_link = ProbitLink()
    """``p(y = 1 | f) = Φ(f)`` and its moments under ``q(f)``."""

    def __init__(self, bag_size_cap: float | None = None, single_instance: bool = False):
        super().__init__()
        self.bag_size_cap = check_bag_size_cap(bag_size_cap)
        self.single_instance = bool(single_instance)

    # -- augmented-likelihood interface --------------------------------------------------------
    def init_locals(self, bags: Bags, bag_labels: Tensor, mean: Tensor) -> Tensor:
        """``ν = μ`` (the optimum for the current q(f))."""
        return mean.detach().clone()

    def update_locals(self, mean: Tensor, var: Tensor | None, bags: Bags, bag_labels: Tensor, locals_: Tensor) -> Tensor:
        """Wang & Pinar (2021), Eq. 19: ``ν ← μ`` (exact coordinate ascent; one step is the optimum)."""
        return mean.detach().clone()

    def _quadratic_terms(self, mean: Tensor, var: Tensor, bags: Bags, bag_labels: Tensor, locals_: Tensor) -> tuple[Tensor, Tensor]:
        """``b = E_q[m]``, ``λ = 1``."""
        em = expected_augmentation(locals_, bags.index, bag_labels, bags.num_bags, self.single_instance)
        return em, torch.ones_like(em)

    def instance_label_posterior(self, mean: Tensor, var: Tensor, bags: Bags, bag_labels: Tensor, locals_: Tensor) -> Tensor:
        """With the labels independent, each positive with ``p_n = E_q[Φ(f_n)] = Φ(μ_n / √(1 + σ_n²))``
        under ``q(f)``'s marginals, in a positive bag ``q(y_n = 1 | T_b = 1) = p_n / (1 − Π_{j∈b}
        (1 − p_j))``; 0 in a negative bag. Single-instance learning: the bag's label."""
        t = bag_labels.to(mean.dtype)[bags.index]
        if self.single_instance:
            return t
        p = torch.special.ndtr(mean / torch.sqrt(1.0 + var))
        p_any = -torch.expm1(log_prob_bag_all_negative(p, bags.index, bags.num_bags))
        return (t * p / p_any.clamp_min(torch.finfo(p.dtype).tiny)[bags.index]).clamp(0.0, 1.0)

    def elbo_terms(self, mean: Tensor, var: Tensor, bags: Bags, bag_labels: Tensor, locals_: Tensor) -> Tensor:
        """Per-instance terms of (★): exact ELBO data part at locals ``ν``; differentiable in
        ``mean``, ``var``. At the optimal locals ``ν = μ`` (a fit's state after every update) and
        without gradients, (★) is the collapsed bound, which needs no truncated moments."""
        nu = locals_
        differentiable = torch.is_grad_enabled() and (mean.requires_grad or var.requires_grad or nu.requires_grad)
        if not differentiable and torch.equal(nu, mean):
            return self.collapsed_elbo_terms(mean, var, bags, bag_labels)
        log_cdf = instance_log_cdf(nu, bags.index, bag_labels, self.single_instance)
        log_z = bag_log_normaliser(nu, bags.index, bag_labels, bags.num_bags, self.single_instance, log_cdf)
        em = expected_augmentation(nu, bags.index, bag_labels, bags.num_bags, self.single_instance, log_z, log_cdf)
        inst = self._tempered((mean - nu) * em + 0.5 * (nu * nu - mean * mean) - 0.5 * var, bags)
        return inst + bag_share(log_z, bags)

    def hyperparameter_terms(self, mean: Tensor, var: Tensor, bags: Bags, bag_labels: Tensor, locals_: Any) -> Tensor:
        """The collapsed bound ``Σ_b log Z_b(μ) − ½ Σ σ²`` (ELBO maximised over q(m)), per instance."""
        return self.collapsed_elbo_terms(mean, var, bags, bag_labels)

    def collapsed_elbo_terms(self, mean: Tensor, var: Tensor, bags: Bags, bag_labels: Tensor) -> Tensor:
        """``(★)`` at ``ν = μ``: ``log Z_b(μ)`` shared over the bag minus ``½σ²_n``, ``(N,)``."""
        log_z = bag_log_normaliser(mean, bags.index, bag_labels, bags.num_bags, self.single_instance)
        return bag_share(log_z, bags) - self._tempered(0.5 * var, bags)

    # -- GPyTorch Likelihood API ----------------------------------------------------------------
    def forward(self, function_samples: Tensor, *args: Any, **kwargs: Any) -> Bernoulli:
        """Instance label given ``f``: ``Bernoulli(Φ(f))``."""
        return Bernoulli(probs=torch.special.ndtr(function_samples))
