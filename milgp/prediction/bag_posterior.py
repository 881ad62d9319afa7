"""The instance posterior ``q(f*)`` of a set of bags, as the bag rules read it.

Marginal rules (noisy-OR, max, top-k) read the per-instance means and variances; joint rules
(sampling the within-bag ``q(f*_b)``, the probit orthant) read per-bag covariance blocks, built on
demand for groups of whole bags of similar size (:meth:`milgp.data.bags.Bags.groups`), so
memory is bounded by ``block_budget`` entries however the bag sizes are mixed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from gpytorch.models import ApproximateGP
from torch import Tensor

from milgp.data.bags import BagGroup, Bags
from milgp.likelihoods.base import refuse_empty_bags
from milgp.likelihoods.instance_link import InstanceLink

__all__ = ["BLOCK_BUDGET", "BagPosterior", "JointBlocks", "MAX_JOINT_INSTANCES"]

BLOCK_BUDGET = 2**22
"""Default bound on the padded block entries of one group of bags (``B_g · n_max²``; 4.2 M entries,
32 MiB in float64) unless one bag alone is larger."""

MAX_JOINT_INSTANCES = 4096
"""Joint rules factorise a bag's ``n × n`` predictive covariance; larger bags are refused with an
error that names them (4096² float64 entries are 128 MiB)."""


@dataclass
class JointBlocks:
    """Padded joint ``q(f*_b)`` of a group of bags.

    Attributes:
        bags: ``(B_g,)`` the bags' ids in the posterior.
        mean: ``(B_g, n)``; cov: ``(B_g, n, n)`` (padding: identity); mask: ``(B_g, n)``.
    """

    bags: Tensor
    mean: Tensor
    cov: Tensor
    mask: Tensor


@dataclass
class BagPosterior:
    """``q(f*)`` of the instances of a batch of bags.

    Attributes:
        mean, var: ``(N,)`` marginal means and variances.
        bags: the instances' :class:`~milgp.data.bags.Bags` (bag of each instance, number of bags).
        block_source: ``BagGroup → (mean_pad, cov_pad, mask)``, the padded joint blocks of one
            group of bags (:class:`~milgp.data.bags.BagGroup`); ``None`` when only marginals are known.
        block_budget: at most this many padded block entries per group (``None``: :data:`BLOCK_BUDGET`).
        chunk_instances: at most this many instances per group (bounds the ``n_g × M`` projection).
    """

    mean: Tensor
    var: Tensor
    bags: Bags
    block_source: Callable[[BagGroup], tuple[Tensor, Tensor, Tensor]] | None = None
    block_budget: int | None = None
    chunk_instances: int = 32768
    _moments: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        """One-line ``ValueError`` naming a bag without instances: no rule has a value for it (the
        max of nothing is −∞, the noisy-OR of nothing 0)."""
        refuse_empty_bags(self.bags, "a prediction")

    def instance_moments(self, link: InstanceLink) -> tuple[Tensor, Tensor]:
        """``E[p(y=1|f*_n)]`` and its std ``(N,)`` under ``link``, computed once per link (every
        marginal bag rule read on this posterior shares them)."""
        if id(link) not in self._moments:  # the link is kept with its moments, so its id is never reused
            self._moments[id(link)] = (link, link.moments(self.mean, self.var))
        return self._moments[id(link)][1]

    @classmethod
    def from_model(
        cls,
        model: ApproximateGP,
        x: Tensor,
        bags: Bags,
        block_budget: int | None = None,
        marginals: tuple[Tensor, Tensor] | None = None,
    ) -> "BagPosterior":
        """The predictive ``q(f*)`` of ``model`` at inputs ``x`` ``(N, D)`` (no gradients);
        ``marginals``: its mean and variance ``(N,)`` when already computed."""
        q = model.variational_strategy.whitened_posterior()
        mean, var = model.variational_strategy.predict_marginals(x) if marginals is None else marginals

        def blocks(group: BagGroup) -> tuple[Tensor, Tensor, Tensor]:
            return model.variational_strategy.bag_covariances(x[group.inst], group.local_bags, q)

        return cls(mean, var, bags, blocks, block_budget)

    @classmethod
    def from_blocks(cls, mean_pad: Tensor, cov_pad: Tensor, mask: Tensor) -> "BagPosterior":
        """A posterior given as padded joint blocks ``(B, n)``, ``(B, n, n)``, ``(B, n)`` (e.g. from
        :meth:`ClosedFormStrategy.bag_covariances` or a user's own ``q(f*_b)``); every joint rule then sees the
        blocks exactly as given, in one group."""
        B, n = mask.shape
        bag_index = torch.arange(B, device=mask.device).unsqueeze(1).expand(B, n)[mask]
        var = torch.diagonal(cov_pad, dim1=-2, dim2=-1)[mask]

        def blocks(group: BagGroup) -> tuple[Tensor, Tensor, Tensor]:
            bags = torch.zeros(group.num_bags, dtype=torch.long, device=mask.device).scatter_(0, group.local, bag_index[group.inst])
            return mean_pad[bags], cov_pad[bags], mask[bags]

        return cls(mean_pad[mask], var, Bags(bag_index, B), blocks, max(B * n * n, 1), max(B * n, 1))

    def joint_blocks(self, max_instances: int = MAX_JOINT_INSTANCES) -> Iterator[JointBlocks]:
        """The padded joint blocks, group by group (every bag exactly once)."""
        if self.block_source is None:
            raise ValueError("this bag posterior has marginals only; use a marginal bag rule (noisy_or, max, top_k_mean)")
        sizes = self.bags.sizes
        too_big = torch.nonzero(sizes > max_instances).flatten()
        if too_big.numel():
            b = int(too_big[0])
            raise ValueError(
                f"bag {b} has {int(sizes[b])} instances: a joint bag rule factorises its {int(sizes[b])}×{int(sizes[b])} "
                f"predictive covariance (limit {max_instances}); use a marginal rule such as 'max' for bags this long"
            )
        budget = BLOCK_BUDGET if self.block_budget is None else self.block_budget
        for g in self.bags.groups(self.chunk_instances, budget):
            with torch.no_grad():
                mean_pad, cov_pad, mask = self.block_source(g)
            yield JointBlocks(g.bags, mean_pad, cov_pad, mask)
