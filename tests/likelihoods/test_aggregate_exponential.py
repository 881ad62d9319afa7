"""Exponential aggregate likelihood (Law et al., *Variational learning on aggregate outputs with
Gaussian processes*, NeurIPS 2018, Appendix A.4): the concave-link bound."""
from __future__ import annotations

import math

import pytest
import torch
from _aggregate_helpers import dense_posterior, make_batch, random_bags, random_model, random_posterior, steps_of

from milgp.likelihoods import ExponentialAggregateLikelihood
from milgp.data.bags import Bags
from milgp.variational.aggregate_fit import fit_aggregate


def test_bound_is_below_monte_carlo_expected_log_likelihood():
    """Both parts of the A.4 objective are lower bounds (concave ``F = −1/η`` with optimal α, and
    Jensen on ``−log η``), so the per-bag value must lie below the Monte-Carlo estimate of
    ``E_q[−y/η_a − log η_a]``; it must also not be vacuous (within a few nats here)."""
    sizes = [3, 5, 1, 6]
    model = random_model(seed=3)
    q = random_posterior(model.variational_strategy.num_inducing, seed=4)
    x, bag_index = random_bags(sizes, seed=5)
    w = 0.5 + torch.rand(len(bag_index), generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    y = torch.tensor([2.0, 7.0, 0.5, 4.0], dtype=torch.float64)
    lik = ExponentialAggregateLikelihood("exp")
    g = Bags(bag_index, len(sizes)).groups()[0]
    with torch.no_grad():
        bound = steps_of(model, lik, make_batch(x, bag_index, y, w)).group_terms(g, q.m, q.S, model.variational_strategy.inducing_cholesky(), False)
        bound = bound[torch.argsort(g.bags)]
        mean, cov = dense_posterior(model, x, q)
        f = mean + torch.randn(200000, len(mean), generator=torch.Generator().manual_seed(0), dtype=torch.float64) @ torch.linalg.cholesky(cov).mT
        eta = torch.zeros(f.shape[0], len(sizes), dtype=torch.float64).index_add_(1, bag_index, torch.exp(f) * w)
        logp = -y / eta - torch.log(eta)
        mc, se = logp.mean(0), logp.std(0) / math.sqrt(f.shape[0])
    assert (bound <= mc + 4 * se).all(), (bound, mc)
    assert (mc - bound).max() < 5.0
    # a single-instance bag with zero variance would be exact; with variance the gap is the
    # Jensen gaps only (checked loosely above)


def test_fit_increases_objective():
    """Natural-gradient fitting of the Exponential model must increase its bound monotonically."""
    sizes = [3, 5, 4, 6, 2]
    model = random_model(seed=7)
    x, bag_index = random_bags(sizes, seed=8)
    y = torch.tensor([3.0, 9.0, 4.0, 10.0, 1.5], dtype=torch.float64)
    res = fit_aggregate(model, ExponentialAggregateLikelihood(), make_batch(x, bag_index, y), max_iter=40, tol=0.0, learn_hyperparameters=False)
    assert all(b >= a - 1e-8 * abs(a) for a, b in zip(res.elbo, res.elbo[1:]))
    assert res.elbo[-1] > res.elbo[0]


def test_square_link_is_refused_with_a_reason():
    """``E[1/f²] = ∞`` under a Gaussian, so the A.4 bound would be vacuous: refuse it clearly."""
    with pytest.raises(ValueError, match="infinite"):
        ExponentialAggregateLikelihood("square")
