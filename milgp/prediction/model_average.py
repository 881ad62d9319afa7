"""Averaging candidate fits: pseudo-BMA+ weights from held-out bag likelihoods, and the mixture.

A kernel (or π rule) chosen by its out-of-bag likelihood on a few dozen bags is a noisy choice;
averaging the candidates hedges between near-ties (docs/core.md, cause 9).

The weights are the pseudo-BMA+ weights of Yao, Vehtari, Simpson & Gelman, *Using stacking to
average Bayesian predictive distributions*, Bayesian Analysis 2018: with ``ℓ_ik`` the held-out log
predictive density of bag ``i`` under candidate ``k`` and ``B`` bags,

    w_k = E_α[ exp(B Σ_i α_i ℓ_ik) / Σ_j exp(B Σ_i α_i ℓ_ij) ],   α ~ Dirichlet(1, …, 1),

i.e. pseudo-BMA weights ``∝ exp(Σ_i ℓ_ik)`` averaged over Bayesian-bootstrap resamples of the
bags, which spreads the weight over candidates whose held-out scores differ by less than their
sampling noise. The mixture's bag probability is ``Σ_k w_k p_k`` and its variance
``Σ_k w_k (σ_k² + p_k²) − p²`` (the law of total variance).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from gpytorch.models import ApproximateGP
from torch import Tensor

from milgp.data.bags import Bags
from milgp.likelihoods.base import AugmentedBagLikelihood
from milgp.models.shared_gram import predict_marginals
from milgp.prediction.bag_decision import BagDecision
from milgp.prediction.bag_posterior import BagPosterior

__all__ = ["AveragedFit", "ModelAverage", "pseudo_bma_plus_weights"]

MIN_WEIGHT = 1e-3
"""Candidates below this weight are dropped from the mixture (and the rest renormalised)."""


@lru_cache(maxsize=2)
def _bayesian_bootstrap(num_bootstrap: int, num_bags: int, seed: int) -> Tensor:
    """``(num_bootstrap, num_bags)`` weights ``α ~ Dirichlet(1, …, 1)`` (normalised exponentials,
    float64, drawn on the CPU from ``seed``). Cached: an estimator averages the same training bags
    twice (its bag decision and, for the instance probabilities, its MIL fits)."""
    gamma = torch.empty(num_bootstrap, num_bags, dtype=torch.float64).exponential_(generator=torch.Generator().manual_seed(seed))
    return gamma / gamma.sum(1, keepdim=True)


def pseudo_bma_plus_weights(heldout_loglik: Tensor, num_bootstrap: int = 1000, seed: int = 0) -> Tensor:
    """Pseudo-BMA+ weights ``(K,)`` from held-out log predictive densities ``(B, K)`` (bags ×
    candidates); see the module docstring. ``seed``: the Bayesian bootstrap's draws.
    Raises ``ValueError`` on a non-finite density."""
    ll = torch.as_tensor(heldout_loglik, dtype=torch.float64).cpu()
    if ll.ndim != 2 or ll.shape[0] == 0 or ll.shape[1] == 0:
        raise ValueError(f"held-out log densities must be (bags, candidates), got shape {tuple(ll.shape)}")
    if not torch.isfinite(ll).all():
        k = int(torch.nonzero(~torch.isfinite(ll))[0, 1])
        raise ValueError(f"candidate {k} has a non-finite held-out log density")
    B = ll.shape[0]
    return torch.softmax(B * _bayesian_bootstrap(num_bootstrap, B, seed) @ ll, dim=1).mean(0)


@dataclass
class AveragedFit:
    """One candidate of the mixture: a fitted model, its likelihood, its calibrated bag decision
    and its weight."""

    model: ApproximateGP
    likelihood: AugmentedBagLikelihood
    decision: BagDecision
    weight: float


@dataclass
class ModelAverage:
    """The weighted mixture of candidate fits (weights sum to 1, heaviest first)."""

    members: list[AveragedFit]

    @classmethod
    def from_candidates(
        cls,
        candidates: list[tuple[ApproximateGP, AugmentedBagLikelihood, BagDecision]],
        labels: Tensor,
        seed: int = 0,
    ) -> "ModelAverage":
        """Weigh candidates by pseudo-BMA+ on their decisions' held-out probabilities of the
        training bags ``labels`` ``(B,)`` (Bayesian bootstrap drawn on the CPU from ``seed``) and
        keep those above :data:`MIN_WEIGHT`."""
        y = torch.as_tensor(labels, dtype=torch.float64).reshape(-1).cpu()
        p = torch.stack([d.heldout_proba.to(torch.float64).cpu() for _, _, d in candidates], 1).clamp(1e-7, 1 - 1e-7)
        loglik = torch.where(y.unsqueeze(1) > 0.5, p.log(), torch.log1p(-p))
        weights = pseudo_bma_plus_weights(loglik, seed=seed)
        keep = [k for k in torch.argsort(weights, descending=True).tolist() if weights[k] >= MIN_WEIGHT]
        total = float(weights[keep].sum())
        return cls([AveragedFit(*candidates[k], float(weights[k]) / total) for k in keep])

    @property
    def top(self) -> AveragedFit:
        """The heaviest candidate."""
        return self.members[0]

    def bag_probability(self, x: Tensor, bags: Bags, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Calibrated positive-bag probability and its std ``(B,)`` of the mixture at inputs ``x``
        ``(N, D)`` of the bags ``bags``."""
        marginals = self._marginals(x)
        posteriors: dict[int, BagPosterior] = {}  # one per fit: its bag rules share its instance moments
        parts = []
        for m in self.members:
            if id(m.model) not in posteriors:
                posteriors[id(m.model)] = BagPosterior.from_model(m.model, x, bags, marginals=marginals[id(m.model)])
            parts.append(m.decision(posteriors[id(m.model)], m.likelihood.instance_link, generator))
        return self._mix(parts)

    def instance_moments(self, x: Tensor, marginals: dict[int, tuple[Tensor, Tensor]] | None = None) -> tuple[Tensor, Tensor]:
        """Instance probability ``E[p(y=1|f*)]`` and its std ``(N,)`` of the mixture at ``x``
        ``(N, D)``; ``marginals``: each member model's ``q(f)`` mean and variance at ``x`` by
        ``id``, where already computed (e.g. a fit's own at its training inputs). Members that are
        bag rules of one fit share its instance moments, computed once."""
        marginals = self._marginals(x) if marginals is None else marginals
        moments: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        for m in self.members:
            key = (id(m.model), id(m.likelihood))
            if key not in moments:
                moments[key] = m.likelihood.instance_link.moments(*marginals[id(m.model)])
        return self._mix([moments[(id(m.model), id(m.likelihood))] for m in self.members])

    def _marginals(self, x: Tensor) -> dict[int, tuple[Tensor, Tensor]]:
        """``q(f*)`` marginals at ``x`` of each distinct model, by ``id``: the members that are bag
        rules of one fit share its model, and the fits of one kernel search share ``Z xᵀ``
        (:func:`~milgp.models.shared_gram.predict_marginals`)."""
        models = list({id(m.model): m.model for m in self.members}.values())
        return {id(model): moments for model, moments in zip(models, predict_marginals(models, x))}

    def _mix(self, parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        w = [m.weight for m in self.members]
        # the weights sum to 1 up to rounding: a probability of 1 could come out as 1 + 2e-16
        p = sum(wk * pk for wk, (pk, _) in zip(w, parts)).clamp(0.0, 1.0)
        # the law of total variance, centred: no cancellation, 0 where every candidate is certain
        var = sum(wk * (sk.square() + (pk - p).square()) for wk, (pk, sk) in zip(w, parts))
        return p, var.sqrt()
