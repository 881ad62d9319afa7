"""Poisson aggregate likelihood (Law et al., *Variational learning on aggregate outputs with
Gaussian processes*, NeurIPS 2018, Eqs. 11–14): bounds, Taylor approximation, blocks,
natural-gradient fitting and predictive distributions, checked by Monte Carlo."""
from __future__ import annotations

import math

import gpytorch
import numpy as np
import pytest
import torch
from _aggregate_helpers import dense_posterior, make_batch, random_bags, random_model, random_posterior, steps_of

from milgp.likelihoods import PoissonAggregateLikelihood
from milgp.likelihoods.aggregate import bag_blocks
from milgp.data.bags import Bags
from milgp.variational.aggregate_fit import fit_aggregate, predict_bag_moments

SIZES = [3, 5, 8, 2]


def _setup(mean_level=0.3, seed=0, sizes=SIZES):
    model = random_model(seed=seed)
    model.mean_module.constant.data.fill_(mean_level)
    q = random_posterior(model.variational_strategy.num_inducing, seed=seed + 1)
    model.variational_strategy.set_whitened_posterior(q)
    x, bag_index = random_bags(sizes, seed=seed + 2)
    g = torch.Generator().manual_seed(seed + 3)
    w = 0.5 + torch.rand(len(bag_index), generator=g, dtype=torch.float64)
    y = torch.tensor([4.0, 11.0, 20.0, 0.0][: len(sizes)] + [3.0] * max(0, len(sizes) - 4), dtype=torch.float64)
    return model, q, x, bag_index, y, w


def _terms(model, lik, x, bag_index, y, w, q):
    groups = Bags(bag_index, len(y)).groups()
    out = torch.empty(len(y), dtype=torch.float64)
    with torch.no_grad():
        for g in groups:
            out[g.bags] = steps_of(model, lik, make_batch(x, bag_index, y, w)).group_terms(g, q.m, q.S, model.variational_strategy.inducing_cholesky(), False)
    return out


def _mc_samples(model, x, q, n=100000, seed=0):
    mean, cov = dense_posterior(model, x, q)
    g = torch.Generator().manual_seed(seed)
    return mean + torch.randn(n, len(mean), generator=g, dtype=torch.float64) @ torch.linalg.cholesky(cov).mT


def _mc_poisson(f, psi, bag_index, y, w):
    rate = torch.zeros(f.shape[0], len(y), dtype=torch.float64).index_add_(1, bag_index, psi(f) * w)
    logp = torch.distributions.Poisson(rate).log_prob(y)
    return logp.mean(0), logp.std(0) / math.sqrt(f.shape[0])


def test_exp_link_is_a_lower_bound_of_the_expected_log_likelihood():
    """Lemma 1 / Eq. 14: the exp-link objective must lie below the Monte-Carlo estimate of
    ``E_q[log Poisson(y_a | Σ p_i e^{f_i})]`` for every bag (with the exact rate term it may only
    lose the Jensen gap of the log term); above it would mean a wrong sign or a wrong rate term."""
    model, q, x, bag_index, y, w = _setup()
    lik = PoissonAggregateLikelihood("exp")
    bound = _terms(model, lik, x, bag_index, y, w, q)
    mc, se = _mc_poisson(_mc_samples(model, x, q), torch.exp, bag_index, y, w)
    assert (bound <= mc + 4 * se).all(), (bound, mc)
    # for a zero count only the exact rate term remains: equality
    assert abs(float(bound[3] - mc[3])) < 4 * float(se[3]) + 1e-9


def test_square_link_taylor_approximation_is_close_to_monte_carlo():
    """Eq. 11: ``ζ_a`` approximates ``E log Σ p_i f_i²`` well when ``E‖V‖²`` dominates its spread
    (rates away from zero); the full objective must then be within a small tolerance of the
    Monte-Carlo expected log-likelihood. A wrong within-bag covariance or a missing ``tr(S̃²)``
    term shifts it visibly."""
    model, q, x, bag_index, y, w = _setup(mean_level=2.5)
    lik = PoissonAggregateLikelihood("square")
    approx = _terms(model, lik, x, bag_index, y, w, q)
    f = _mc_samples(model, x, q)
    mc, se = _mc_poisson(f, torch.square, bag_index, y, w)
    assert ((approx - mc).abs() < 0.02 * y.clamp_min(1) + 4 * se).all(), (approx, mc)
    # the approximation of E log‖V‖² itself
    with torch.no_grad():
        proj = model.variational_strategy.projection(x)
        blocks = bag_blocks(model, x, proj, Bags(bag_index, len(y)), q.m, q.S, w)
        zeta = lik.taylor_log_norm(blocks)
    norm = torch.zeros(f.shape[0], len(y), dtype=torch.float64).index_add_(1, bag_index, f * f * w)
    mc_log = torch.log(norm).mean(0)
    err = (zeta - mc_log).abs()
    assert err.max() < 0.02
    # and the second-order term matters: dropping it is measurably worse
    first_order = torch.log(norm.mean(0))
    assert err.max() < (first_order - mc_log).abs().max()
    # the expansion converges as E‖V‖² grows relative to its spread (the truncation error shrinks)
    model.mean_module.constant.data.fill_(6.0)
    with torch.no_grad():
        blocks = bag_blocks(model, x, model.variational_strategy.projection(x), Bags(bag_index, len(y)), q.m, q.S, w)
        zeta_far = lik.taylor_log_norm(blocks)
    f_far = _mc_samples(model, x, q)
    norm_far = torch.zeros(f_far.shape[0], len(y), dtype=torch.float64).index_add_(1, bag_index, f_far * f_far * w)
    assert (zeta_far - torch.log(norm_far).mean(0)).abs().max() < 0.2 * err.max()


def test_within_bag_covariance_equals_block_of_full_predictive_covariance():
    """The per-bag blocks ``K_bb − A_bᵀA_b + A_bᵀSA_b`` used by the square link must equal the
    corresponding blocks of the full N×N predictive covariance, both by the textbook formula and
    as GPyTorch computes it in eval mode. Padded rows/columns must be the identity."""
    model, q, x, bag_index, y, w = _setup()
    with torch.no_grad():
        blocks = bag_blocks(model, x, model.variational_strategy.projection(x), Bags(bag_index, len(y)), q.m, q.S, w)
        mean, cov = dense_posterior(model, x, q)
        model.eval()
        full = model(x).covariance_matrix
        model.train()
    start = 0
    for b, n in enumerate(SIZES):
        sl = slice(start, start + n)
        torch.testing.assert_close(blocks.cov[b, :n, :n], cov[sl, sl], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(blocks.cov[b, :n, :n], full[sl, sl], rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(blocks.mean[b, :n], mean[sl], rtol=1e-10, atol=1e-12)
        pad = blocks.cov[b, n:, n:]
        torch.testing.assert_close(pad, torch.eye(pad.shape[0], dtype=torch.float64))
        assert float(blocks.weights[b, n:].abs().sum()) == 0.0
        start += n


def test_gpytorch_entry_point_square_link():
    """``expected_log_prob`` summed over instances must equal the per-bag objective whether the
    blocks come from ``model=, x=`` or from ``model(x, diag=False)``; the train-mode diagonal must
    raise (GPyTorch's train-mode output is diagonal: its off-diagonals are not the within-bag
    covariances)."""
    model, q, x, bag_index, y, w = _setup(mean_level=2.0)
    lik = PoissonAggregateLikelihood("square")
    ref = _terms(model, lik, x, bag_index, y, w, q).sum()
    model.train()
    target = y[bag_index]
    with torch.no_grad():
        a = lik.expected_log_prob(target, model(x), bag_index=bag_index, weights=w, model=model, x=x).sum()
        b = lik.expected_log_prob(target, model(x, diag=False), bag_index=bag_index, weights=w).sum()
    torch.testing.assert_close(a, ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(b, ref, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="diag=False"):
        lik.expected_log_prob(target, model(x), bag_index=bag_index, weights=w)
    # the exp link needs only marginals: the train-mode output is fine
    lik_exp = PoissonAggregateLikelihood("exp")
    with torch.no_grad():
        c = lik_exp.expected_log_prob(target, model(x), bag_index=bag_index, weights=w).sum()
    torch.testing.assert_close(c, _terms(model, lik_exp, x, bag_index, y, w, q).sum(), rtol=1e-9, atol=1e-9)
    # and it works with gradients through gpytorch's VariationalELBO (NaturalVariationalDistribution)
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=len(bag_index))
    loss = -mll(model(x), target, bag_index=bag_index, weights=w, model=model, x=x)
    loss.backward()
    assert model.covar_module.raw_outputscale.grad is not None


@pytest.mark.parametrize("link", ["exp", "square"])
def test_natural_gradient_fit_increases_the_objective_to_a_fixed_point(link):
    """Full-batch natural steps with backtracking must never decrease the objective, and at
    convergence the natural-gradient target must equal the current q (zero natural gradient).
    A wrong expectation-parameter gradient (e.g. forgetting ``−2 (∂E/∂S) m``) breaks both."""
    sizes = [4, 6, 3, 5, 7, 2, 6, 5]
    model, _, x, bag_index, _, w = _setup(mean_level=1.0 if link == "square" else 0.0, sizes=sizes)
    model.variational_strategy.set_whitened_posterior(random_posterior(model.variational_strategy.num_inducing, seed=5, scale=0.0))
    y = torch.tensor([5.0, 12.0, 2.0, 9.0, 20.0, 1.0, 8.0, 6.0], dtype=torch.float64)
    lik = PoissonAggregateLikelihood(link)
    batch = make_batch(x, bag_index, y, w)
    res = fit_aggregate(model, lik, batch, max_iter=150, tol=1e-12, learn_hyperparameters=False, rho0=0.5)
    diffs = np.diff(res.elbo)
    assert (diffs >= -1e-8 * np.abs(res.elbo[:-1])).all()
    q = model.variational_strategy.whitened_posterior()
    stats, _ = steps_of(model, lik, batch).natural_statistics(Bags(bag_index, len(sizes)).groups(), q)
    eta1_hat, P_hat = stats.targets()
    torch.testing.assert_close(eta1_hat, q.precision @ q.m, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(P_hat, q.precision, rtol=1e-4, atol=1e-5)


def test_minibatch_natural_steps_approach_the_full_batch_optimum():
    """Stochastic natural steps on minibatches of whole bags (scaled by B/B_mb, Robbins–Monro ρ)
    must end near the full-batch optimum's objective."""
    sizes = [4, 6, 3, 5, 7, 2, 6, 5]
    y = torch.tensor([5.0, 12.0, 2.0, 9.0, 20.0, 1.0, 8.0, 6.0], dtype=torch.float64)
    out = []
    for bpb in (None, 2):
        model, _, x, bag_index, _, w = _setup(sizes=sizes)
        model.variational_strategy.set_whitened_posterior(random_posterior(model.variational_strategy.num_inducing, seed=5, scale=0.0))
        lik = PoissonAggregateLikelihood("exp")
        res = fit_aggregate(model, lik, make_batch(x, bag_index, y, w), max_iter=25 if bpb else 60, tol=0.0,
                            learn_hyperparameters=False, bags_per_batch=bpb, rho_max=0.5)
        out.append(res.elbo[-1])
    assert out[1] > out[0] - 0.05 * abs(out[0])


def test_predictive_distributions_match_monte_carlo():
    """Individual quantiles (log-normal for exp, scaled non-central χ² for square) and bag-level
    moments of ``Σ p_i Ψ(f_i)`` (full within-bag covariance) must match sampling from q(f)."""
    model, q, x, bag_index, y, w = _setup(mean_level=0.8)
    f = _mc_samples(model, x, q, n=200000, seed=3)
    mean, cov = dense_posterior(model, x, q)
    var = torch.diagonal(cov)
    levels = np.array([0.05, 0.5, 0.9])
    for link, psi in (("exp", torch.exp), ("square", torch.square)):
        lik = PoissonAggregateLikelihood(link)
        qs = lik.rate_quantiles(mean, var, levels)
        emp = np.quantile(psi(f).numpy(), levels, axis=0).T
        np.testing.assert_allclose(qs, emp, rtol=0.03, atol=0.01)
        np.testing.assert_allclose(lik.rate_mean(mean, var).numpy(), psi(f).mean(0).numpy(), rtol=0.02)
        agg = torch.zeros(f.shape[0], len(y), dtype=torch.float64).index_add_(1, bag_index, psi(f) * w)
        mom = predict_bag_moments(model, lik, x, Bags(bag_index, len(y)), w)
        np.testing.assert_allclose(mom["rate_mean"].numpy(), agg.mean(0).numpy(), rtol=0.02)
        np.testing.assert_allclose(mom["rate_var"].numpy(), agg.var(0).numpy(), rtol=0.08)
        np.testing.assert_allclose(mom["y_var"].numpy(), (agg.var(0) + agg.mean(0)).numpy(), rtol=0.06)


@pytest.mark.parametrize("link", ["exp", "square"])
def test_minibatch_steps_never_lower_the_objective_estimate(link):
    """With every bag in the one minibatch the minibatch estimate is the full objective, so with
    fixed hyperparameters the stochastic path must be monotone like the full-batch path. Without
    the backtracking check on the estimate, Robbins–Monro steps of the non-conjugate square link
    overshoot on these counts (the objective fell by ~10⁶ in one step)."""
    sizes = [4, 6, 3, 5, 7, 2, 6, 5]
    model, _, x, bag_index, _, w = _setup(mean_level=1.0, seed=0, sizes=sizes)
    model.variational_strategy.set_whitened_posterior(random_posterior(model.variational_strategy.num_inducing, seed=5, scale=0.0))
    y = 50.0 * torch.tensor([5.0, 12.0, 2.0, 9.0, 20.0, 1.0, 8.0, 6.0], dtype=torch.float64)
    res = fit_aggregate(model, PoissonAggregateLikelihood(link), make_batch(x, bag_index, y, w), max_iter=8, tol=0.0,
                        learn_hyperparameters=False, bags_per_batch=len(sizes), rho_max=1.0)
    elbo = np.asarray(res.elbo)
    assert (np.diff(elbo) >= -1e-8 * np.abs(elbo[:-1])).all(), np.diff(elbo).min()
    assert elbo[-1] > elbo[0]


def test_bag_metrics_give_the_poisson_deviance_of_scikit_learn():
    """The Poisson model's own bag metric is the mean Poisson deviance (zero counts included). If
    this fails, the aggregate head logs a ``bag_poisson_deviance`` that is not the deviance."""
    from sklearn.metrics import mean_poisson_deviance

    y = np.array([0.0, 1.0, 4.0, 2.0, 0.0, 7.0])
    mu = np.array([0.3, 1.5, 3.2, 2.0, 1.1, 5.0])
    metrics = PoissonAggregateLikelihood("exp").bag_metrics(y, mu)
    assert set(metrics) == {"poisson_deviance"}
    assert metrics["poisson_deviance"] == pytest.approx(mean_poisson_deviance(y, mu), rel=1e-12)
