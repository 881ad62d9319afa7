"""Bag rules: from the instance posterior of a bag to ``P(bag positive)`` and its standard deviation.

The instance posterior ``q(f*)`` is what a MIL GP learns; how it becomes a bag decision is a
separate, swappable choice. Every rule is called as ``rule(posterior, link, generator)`` with a
:class:`~milgp.prediction.bag_posterior.BagPosterior` and the likelihood's
:class:`~milgp.likelihoods.instance_link.InstanceLink`, and returns ``(p, std)``, each ``(B,)``.
Marginal rules (:class:`NoisyOrRule`, :class:`MaxRule`, :class:`TopKMeanRule`) read each instance
through its marginal ``q(f*_n)``; joint rules (:class:`JointNoisyOrRule`, :class:`JointMaxRule`,
:class:`OrthantRule`) read the within-bag covariance of ``q(f*_b)``, for bags of up to
:data:`~milgp.prediction.bag_posterior.MAX_JOINT_INSTANCES` instances. :func:`make_bag_rule`
builds a rule from its name.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from milgp.data.bags import Bags, identity_padded, segment_max, segment_sum
from milgp.likelihoods.instance_link import InstanceLink, ProbitLink
from milgp.likelihoods.orthant import orthant_probability
from milgp.linalg import robust_cholesky
from milgp.prediction.bag_posterior import MAX_JOINT_INSTANCES, BagPosterior

__all__ = [
    "BAG_RULES",
    "DEFAULT_BAG_RULE",
    "BagRule",
    "JointMaxRule",
    "JointNoisyOrRule",
    "MarginalBagRule",
    "MaxRule",
    "NoisyOrRule",
    "OrthantRule",
    "TopKMeanRule",
    "make_bag_rule",
]


class BagRule(ABC):
    """``(posterior, link, generator) → (p, std)``, each ``(B,)``."""

    name: str

    @abstractmethod
    def __call__(
        self, posterior: BagPosterior, link: InstanceLink, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        """Bag probabilities and their standard deviations, ``(B,)`` each."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class MarginalBagRule(BagRule):
    """A rule that reads each instance through its marginal ``q(f*_n)`` only: it combines the
    instance probabilities ``p_n = E[p(y=1|f*_n)]`` and their stds per bag (:meth:`combine`), so
    it applies as well to instance probabilities from any other source (e.g. Gibbs draws)."""

    uses_log_negative = False
    """Whether :meth:`combine` wants ``log E[p(y=0|f)]`` computed directly (accurate near p = 1)."""

    def __call__(self, posterior, link, generator=None):
        p, std = posterior.instance_moments(link)
        log_negative = link.log_expected_negative(posterior.mean, posterior.var) if self.uses_log_negative else None
        return self.combine(p, std, posterior.bags, log_negative)

    @abstractmethod
    def combine(self, p: Tensor, std: Tensor, bags: Bags, log_negative: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Bag probability and std ``(B,)`` from instance probabilities and stds ``(N,)``."""


class NoisyOrRule(MarginalBagRule):
    """``E[1 − Π_n (1 − p(f*_n))]`` with independent ``q(f*_n)``, and its std (both exact): the
    model's own bag predictive (Castro-Macías et al., *Hyperbolic secant representation of the
    logistic function: application to probabilistic multiple instance learning for CT intracranial
    hemorrhage detection*, Artificial Intelligence 2024, Eqs. 34–36). Every instance is an
    independent chance of a positive, so a bag's probability grows with its length.

    With ``g_n = E[1 − p_n]``: ``E[Π(1−p)] = Π g_n`` and ``Var[Π(1−p)] = Π g_n² · (Π(1 + v_n/g_n²) − 1)``
    with ``v_n = Var[p_n]``, evaluated in log space as ``exp(2Σ log g + log expm1(Σ log1p(v/g²)))`` so
    that long bags keep their precision in float32 as in float64, and a bag with an almost surely
    positive instance (``g_n`` below the dtype's range) gets a std of 0, not ``0 · ∞``.
    """

    name = "noisy_or"
    uses_log_negative = True

    def combine(self, p, std, bags, log_negative=None):
        # p capped at the largest value below 1 of its dtype: log g stays finite
        log_g = torch.log1p(-p.clamp(max=1 - torch.finfo(p.dtype).eps / 2)) if log_negative is None else log_negative
        log_all_neg = segment_sum(log_g, bags.index, bags.num_bags)
        # log1p(v/g²) = log(1 + exp(2(log σ − log g))): no 0·∞ when 1/g² overflows for a sure positive
        ratio = 2 * (torch.log(std) - log_g)
        rel = segment_sum(torch.logaddexp(torch.zeros_like(ratio), ratio), bags.index, bags.num_bags)
        # exp(2L)·expm1(rel) = exp(2L + rel + log(1 − exp(−rel))): no 0·∞ when exp(2L) underflows
        var = torch.exp(2 * log_all_neg + rel + torch.log(-torch.expm1(-rel)))
        return -torch.expm1(log_all_neg), var.sqrt()


class MaxRule(MarginalBagRule):
    """``max_n E[p(f*_n)]``, with the std of that instance's probability (the rule of the VGPMIL
    reference code, Haußmann et al., *Variational Bayesian Multiple Instance Learning with Gaussian
    Processes*, CVPR 2017); with ``reference_length`` ``n₀``, the max at the resolution of bags of
    ``n₀`` instances.

    The max is unchanged by duplicating instances, but not by re-slicing a scan into new, similar
    instances: the largest of more draws is larger, so a negative bag's max grows with its length
    (docs/core.md, cause 5). With ``reference_length = n₀`` a bag of ``n_b > n₀`` instances scores
    the mean of its ``c = n_b / n₀`` most probable instances (the last one with weight ``c − ⌊c⌋``):
    in a scan re-sliced ``r×`` finer the top ``r`` slices stand for the one slice of the coarse
    scan. Bags of at most ``n₀`` instances keep the max.
    """

    name = "max"

    def __init__(self, reference_length: float | None = None):
        if reference_length is not None and not reference_length >= 1:
            raise ValueError(f"MaxRule needs reference_length >= 1 (instances), got {reference_length}")
        self.reference_length = None if reference_length is None else float(reference_length)

    def combine(self, p, std, bags, log_negative=None):
        bag_index, num_bags = bags.index, bags.num_bags
        top = segment_max(p, bag_index, num_bags)
        is_top = p == top[bag_index]
        std_top = std.new_zeros(num_bags).scatter_reduce(0, bag_index[is_top], std[is_top], "amax", include_self=True)
        if self.reference_length is None:
            return top, std_top
        count = (bags.sizes.to(p) / self.reference_length).clamp_min(1.0)
        mean, mean_std = _top_weighted_mean(p, std, bags, count)
        longer = count > 1
        return torch.where(longer, mean, top), torch.where(longer, mean_std, std_top)

    def __repr__(self) -> str:
        return "MaxRule()" if self.reference_length is None else f"MaxRule(reference_length={self.reference_length:g})"


def _top_weighted_mean(p: Tensor, std: Tensor, bags: Bags, count: Tensor) -> tuple[Tensor, Tensor]:
    """Mean of the ``count_b`` (``(B,)``, ≥ 1, not necessarily whole) largest ``p`` ``(N,)`` of
    each bag: the instance of within-bag rank ``r`` (0 = largest) weighs ``clamp(count_b − r, 0,
    1)``. Its std is ``sqrt(Σ w_n² v_n) / count_b``, treating the instances as independent."""
    B, idx = bags.num_bags, bags.index
    # rank within bag by descending probability: sort by (bag, −p)
    order = torch.argsort(p, descending=True, stable=True)
    order = order[torch.argsort(idx[order], stable=True)]
    rank = torch.arange(p.numel(), device=p.device) - bags.padding.starts[idx[order]]
    w = (count[idx[order]] - rank).clamp(0.0, 1.0)
    keep = order[w > 0]
    w = w[w > 0]
    mean = segment_sum(w * p[keep], idx[keep], B) / count
    var = segment_sum((w * std[keep]) ** 2, idx[keep], B) / count**2
    return mean, var.sqrt()


class TopKMeanRule(MarginalBagRule):
    """Mean of the largest instance probabilities of each bag: the top ``k``, or the top fraction
    ``fraction`` of the bag (``c = fraction · n_b`` instances, at least one, the last of them
    weighted ``c − ⌊c⌋``).

    The fraction form is unchanged by duplicating every instance and by re-slicing a scan more
    finely (a lesion covers the same fraction of slices); it runs from the max rule
    (``fraction → 0``) to the mean of the bag (``fraction = 1``). The fractional last instance
    keeps the fraction the same at every length (rounding up to ``⌈fraction · n_b⌉`` would not;
    docs/core.md, cause 5). The std: :func:`_top_weighted_mean`.
    """

    name = "top_k_mean"

    def __init__(self, k: int | None = None, fraction: float | None = None):
        if k is not None and fraction is not None:
            raise ValueError("TopKMeanRule takes exactly one of k (an instance count) or fraction (of the bag)")
        if k is None and fraction is None:
            fraction = 0.25
        if k is not None and k < 1:
            raise ValueError(f"TopKMeanRule needs k >= 1, got {k}")
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise ValueError(f"TopKMeanRule needs fraction in (0, 1], got {fraction}")
        self.k = None if k is None else int(k)
        self.fraction = None if fraction is None else float(fraction)

    def combine(self, p, std, bags, log_negative=None):
        sizes = bags.sizes.to(p)
        count = sizes.clamp(max=self.k) if self.k is not None else (self.fraction * sizes).clamp_min(1.0)
        return _top_weighted_mean(p, std, bags, count)

    def __repr__(self) -> str:
        return f"TopKMeanRule(k={self.k})" if self.k is not None else f"TopKMeanRule(fraction={self.fraction})"


def _draw_seed(seed: int, generator: torch.Generator | None) -> int:
    """``seed``, or a seed drawn from ``generator`` when one is given."""
    return seed if generator is None else int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device))


class _SamplingRule(BagRule):
    """A joint rule estimated by sampling ``f*_b ~ q(f*_b)``: mean and std of a per-sample value
    (the std of the samples themselves, dividing by ``S``, so that it never exceeds
    ``sqrt(p(1 − p))``, the largest std of a quantity in [0, 1] with mean ``p``).

    The ``k``-th instance of every bag gets the same ``num_samples`` standard normal numbers (the
    ``k``-th row of one stream from the seed, drawn instance by instance), so a bag's value depends
    on the bag alone, never on the bags predicted with it or their order (common random numbers:
    the bags' Monte-Carlo errors are correlated, which also steadies their ranking). The seed is
    ``seed``, or drawn from ``generator`` when one is given."""

    def __init__(self, num_samples: int = 512, max_instances: int = MAX_JOINT_INSTANCES, seed: int = 0):
        if num_samples < 2:
            raise ValueError(f"a sampling bag rule needs num_samples >= 2, got {num_samples}")
        self.num_samples = int(num_samples)
        self.max_instances = int(max_instances)
        self.seed = int(seed)

    @abstractmethod
    def per_sample(self, f: Tensor, mask: Tensor, link: InstanceLink) -> Tensor:
        """``(S, B_g)`` bag values from joint samples ``f`` ``(S, B_g, n)`` (padding masked)."""

    def __call__(self, posterior, link, generator=None):
        seed = _draw_seed(self.seed, generator)
        p = posterior.mean.new_zeros(posterior.bags.num_bags)
        std = torch.zeros_like(p)
        for blk in posterior.joint_blocks(self.max_instances):
            L = robust_cholesky(blk.cov, jitter=1e-10, what="the within-bag predictive covariance q(f*_b)")
            # NumPy fills row by row from one stream: the first n rows are the same for any block width
            eps = np.random.default_rng(seed).standard_normal((blk.mean.shape[-1], self.num_samples))
            eps = torch.as_tensor(eps.T, dtype=blk.mean.dtype, device=blk.mean.device)  # (S, n), shared by the bags
            # one batched GEMM over bags (B, S, n) @ (B, n, n): no S copies of every L[b]
            f = blk.mean + (eps @ L.mT).transpose(0, 1)
            values = self.per_sample(f, blk.mask, link)
            p[blk.bags], std[blk.bags] = values.mean(0), values.std(0, correction=0)
        return p, std

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_samples={self.num_samples})"


class JointNoisyOrRule(_SamplingRule):
    """Noisy-OR ``1 − Π_n (1 − p(f*_n))`` averaged over joint samples of ``q(f*_b)``."""

    name = "joint_noisy_or"

    def per_sample(self, f, mask, link):
        return -torch.expm1((link.log_prob_negative(f) * mask).sum(-1))


class JointMaxRule(_SamplingRule):
    """``p(max_n f*_n)`` averaged over joint samples of ``q(f*_b)``: the probability that the bag's
    most positive instance is positive, exactly unchanged by duplicating instances (copies share
    one latent value)."""

    name = "joint_max"

    def per_sample(self, f, mask, link):
        return link.prob(f.masked_fill(~mask, float("-inf")).amax(-1))


class OrthantRule(BagRule):
    """Probit model: ``1 − P(all m*_n < 0)``, ``m*_b ~ N(μ*_b, Σ*_b + I)`` (Wang & Pinar, *The
    Multiple Instance Learning Gaussian Process Probit Model*, AISTATS 2021, §3.4), by Genz's
    separation of variables with randomised quasi-Monte Carlo; the std is the estimator's standard
    error."""

    name = "orthant"

    def __init__(self, num_points: int = 1024, replicates: int = 8, seed: int = 0, max_instances: int = MAX_JOINT_INSTANCES):
        self.num_points = int(num_points)
        self.replicates = int(replicates)
        self.seed = int(seed)
        self.max_instances = int(max_instances)

    def __call__(self, posterior, link, generator=None):
        """The Sobol scrambling seed is ``seed``, or drawn from ``generator`` when one is given."""
        if not isinstance(link, ProbitLink):
            raise ValueError(f"the orthant bag rule is defined for the probit link only, not {link!r}")
        seed = _draw_seed(self.seed, generator)
        p = posterior.mean.new_zeros(posterior.bags.num_bags)
        err = torch.zeros_like(p)
        for blk in posterior.joint_blocks(self.max_instances):
            eye = torch.eye(blk.cov.shape[-1], dtype=blk.cov.dtype, device=blk.cov.device)
            cov_m = identity_padded(blk.cov + eye, blk.mask)
            p_neg, e = orthant_probability(blk.mean, cov_m, blk.mask, num_points=self.num_points, replicates=self.replicates, seed=seed)
            p[blk.bags], err[blk.bags] = (1.0 - p_neg).clamp(0.0, 1.0), e
        return p, err

    def __repr__(self) -> str:
        return f"OrthantRule(num_points={self.num_points}, replicates={self.replicates})"


BAG_RULES: dict[str, Callable[[], BagRule]] = {
    "noisy_or": NoisyOrRule,
    "max": MaxRule,
    "top_k_mean": TopKMeanRule,
    "mean": lambda: TopKMeanRule(fraction=1.0),
    "joint_noisy_or": JointNoisyOrRule,
    "joint_max": JointMaxRule,
    "orthant": OrthantRule,
}
"""Rules by name, with their default settings (``"top_k_mean"``: the top quarter of the bag;
``"mean"``: the whole bag; ``"joint"`` is accepted for ``"joint_noisy_or"``)."""

DEFAULT_BAG_RULE = "max"
"""The rule a Lightning GP head with ``bag_rule="auto"`` predicts with, uncalibrated, until its bag
decision is fitted; the fitted decision, like the estimators' default, picks among
:func:`~milgp.prediction.bag_decision.auto_bag_rules` (the study in docs/core.md, cause 5)."""


def make_bag_rule(rule: str | BagRule) -> BagRule:
    """A :class:`BagRule` from its name (:data:`BAG_RULES`) or as given."""
    if isinstance(rule, BagRule):
        return rule
    name = "joint_noisy_or" if rule == "joint" else rule
    if name not in BAG_RULES:
        raise ValueError(f"unknown bag rule {rule!r}: use one of {sorted(BAG_RULES)} or a BagRule instance")
    return BAG_RULES[name]()
