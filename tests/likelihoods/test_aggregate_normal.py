"""Normal aggregate likelihood (Law et al., *Variational learning on aggregate outputs with Gaussian
processes*, NeurIPS 2018, Eq. 25): exactness against GPyTorch and the optimum."""
from __future__ import annotations

import math

import gpytorch
import pytest
import torch
from _aggregate_helpers import dense_posterior, make_batch, random_bags, random_model, random_posterior, steps_of

from milgp.likelihoods import NormalAggregateLikelihood
from milgp.data.bags import Bags

TAU = 0.37


def _setup(sizes, seed=0, weights=True):
    model = random_model(seed=seed)
    q = random_posterior(model.variational_strategy.num_inducing, seed=seed + 1)
    model.variational_strategy.set_whitened_posterior(q)
    x, bag_index = random_bags(sizes, seed=seed + 2)
    g = torch.Generator().manual_seed(seed + 3)
    y = torch.randn(len(sizes), generator=g, dtype=torch.float64) * 2
    w = 0.5 + torch.rand(len(bag_index), generator=g, dtype=torch.float64) if weights else None
    lik = NormalAggregateLikelihood(noise=TAU).double()
    return model, q, x, bag_index, y, w, lik


def test_elbo_with_singleton_bags_equals_gpytorch_svgp_elbo():
    """Bags of size one with unit weights are ordinary SVGP regression: our closed-form ELBO must
    equal ``VariationalELBO(GaussianLikelihood) × num_data`` for the same q and noise. A mismatch
    means a wrong variance term, a missing jitter, a wrong normaliser or a wrong KL."""
    sizes = [1] * 25
    model, q, x, bag_index, y, _, lik = _setup(sizes, weights=False)
    N = len(sizes)
    gauss = gpytorch.likelihoods.GaussianLikelihood(noise_constraint=gpytorch.constraints.GreaterThan(1e-8)).double()
    gauss.noise = torch.tensor(TAU, dtype=torch.float64)  # a float scalar is rounded to float32 by GPyTorch's setter
    model.train()
    with torch.no_grad():
        reference = float(gpytorch.mlls.VariationalELBO(gauss, model, num_data=N)(model(x), y)) * N
    ours = steps_of(model, lik, make_batch(x, bag_index, y)).aggregate_elbo(Bags(bag_index, N).groups(), q)
    assert abs(ours - reference) < 1e-8 * max(1.0, abs(reference))
    # the same through our likelihood plugged into GPyTorch's VariationalELBO
    with torch.no_grad():
        plugged = float(gpytorch.mlls.VariationalELBO(lik, model, num_data=N)(model(x), y, bag_index=bag_index)) * N
    assert abs(plugged - reference) < 1e-8 * max(1.0, abs(reference))


def test_gpytorch_path_with_real_bags_matches_closed_form_and_needs_covariance():
    """Through ``VariationalELBO`` with bags of several instances the value must equal the
    closed-form ELBO whether the blocks come from ``model=, x=`` or from ``model(x, diag=False)``;
    the train-mode diagonal output (diagonal: its off-diagonals are not the within-bag covariances)
    must be refused, not silently used — otherwise the within-bag covariance ``wᵀS^a w`` would be
    wrong."""
    sizes = [3, 1, 4, 2, 5]
    model, q, x, bag_index, y, w, lik = _setup(sizes)
    N = len(bag_index)
    ref = steps_of(model, lik, make_batch(x, bag_index, y, w)).aggregate_elbo(Bags(bag_index, len(sizes)).groups(), q)
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=N)
    model.train()
    target = y[bag_index]
    with torch.no_grad():
        a = float(mll(model(x), target, bag_index=bag_index, weights=w, model=model, x=x)) * N
        b = float(mll(model(x, diag=False), target, bag_index=bag_index, weights=w)) * N
    assert abs(a - ref) < 1e-8 * abs(ref)
    assert abs(b - ref) < 1e-8 * abs(ref)
    with pytest.raises(ValueError, match="diag"):
        mll(model(x), target, bag_index=bag_index, weights=w)


def _collapsed_bound(model, x, bag_index, y, w, tau):
    """Titsias' collapsed bound for the linear-Gaussian aggregate model (dense, tiny N):
    ``log N(y | Wμ0, W Q Wᵀ + Σ_y) − ½ tr(Σ_y⁻¹ W (K − Q) Wᵀ)``, ``Q = AᵀA``, ``W`` the B×N
    weighted aggregation matrix — the maximum of the ELBO over Gaussian q(u)."""
    B = int(bag_index.max()) + 1
    W = torch.zeros(B, len(bag_index), dtype=torch.float64)
    W[bag_index, torch.arange(len(bag_index))] = w
    with torch.no_grad():
        L = model.variational_strategy.inducing_cholesky()
        A = torch.linalg.solve_triangular(L, model.covar_module(model.variational_strategy.inducing_points, x).to_dense(), upper=False)
        K = model.covar_module(x).to_dense() + model.variational_strategy.jitter * torch.eye(len(x), dtype=torch.float64)
        Q = A.mT @ A
        mu0 = model.mean_module(x)
        Sy = torch.diag(tau * (W * W).sum(1))
        C = W @ Q @ W.mT + Sy
        r = y - W @ mu0
        Lc = torch.linalg.cholesky(C)
        alpha = torch.cholesky_solve(r.unsqueeze(-1), Lc).squeeze(-1)
        logdet = 2 * torch.log(torch.diagonal(Lc)).sum()
        log_n = -0.5 * (B * math.log(2 * math.pi) + logdet + r @ alpha)
        trace = torch.trace(torch.linalg.solve(Sy, W @ (K - Q) @ W.mT))
    return float(log_n - 0.5 * trace)


def test_one_natural_step_is_the_exact_optimum():
    """With ρ = 1 the rank-one-per-bag statistics must land on the exact optimum of q(u): the ELBO
    there equals the collapsed (Titsias) bound of the aggregated model, and the autograd natural
    gradient at that point vanishes (a second step is a no-op). If the statistics were the
    diagonal ``natural_statistics`` or mis-weighted, the ELBO would fall short of the bound."""
    sizes = [3, 1, 4, 2, 5, 6]
    model, _, x, bag_index, y, w, lik = _setup(sizes, seed=4)
    batch = make_batch(x, bag_index, y, w)
    groups = Bags(bag_index, len(sizes)).groups()
    q0 = random_posterior(model.variational_strategy.num_inducing, seed=9)
    stats, _ = steps_of(model, lik, batch).natural_statistics(groups, q0)
    q1 = q0.try_natural_step(stats, 1.0, 1.0)
    elbo = steps_of(model, lik, batch).aggregate_elbo(groups, q1)
    bound = _collapsed_bound(model, x, bag_index, y, w, TAU)
    assert abs(elbo - bound) < 1e-8 * abs(bound)
    # the generic (autograd) natural gradient reproduces the closed-form statistics ...
    auto, _ = steps_of(model, lik, batch).natural_statistics(groups, q0, closed_form=False)
    torch.testing.assert_close(auto.h, stats.h, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(auto.G, stats.G, rtol=1e-9, atol=1e-10)
    # ... and is a fixed point at the optimum
    q2 = q1.try_natural_step(steps_of(model, lik, batch).natural_statistics(groups, q1, closed_form=False)[0], 1.0, 1.0)
    torch.testing.assert_close(q2.m, q1.m, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(q2.S, q1.S, rtol=1e-8, atol=1e-10)


def test_expected_log_likelihood_matches_monte_carlo():
    """Eq. 25 is exact: the per-bag term must match a Monte-Carlo average of
    ``log N(y_a | Σ w_i f_i, τ Σ w_i²)`` under the joint q(f_b) (a wrong ``wᵀS^a w`` shows here)."""
    sizes = [4, 2, 6]
    model, q, x, bag_index, y, w, lik = _setup(sizes, seed=11)
    batch = make_batch(x, bag_index, y, w)
    groups = Bags(bag_index, len(sizes)).groups()
    with torch.no_grad():
        terms = steps_of(model, lik, batch).group_terms(groups[0], q.m, q.S, model.variational_strategy.inducing_cholesky(), False)
        terms = terms[torch.argsort(groups[0].bags)]
        mean, cov = dense_posterior(model, x, q)
        g = torch.Generator().manual_seed(0)
        f = mean + torch.randn(200000, len(mean), generator=g, dtype=torch.float64) @ torch.linalg.cholesky(cov).mT
        agg = torch.zeros(f.shape[0], len(sizes), dtype=torch.float64).index_add_(1, bag_index, f * w)
        w2 = torch.zeros(len(sizes), dtype=torch.float64).index_add_(0, bag_index, w * w)
        logp = torch.distributions.Normal(agg, (TAU * w2).sqrt()).log_prob(y)
        mc, se = logp.mean(0), logp.std(0) / math.sqrt(f.shape[0])
    assert (terms - mc).abs().max() < 5 * se.max() + 1e-6
