"""bag_log_predictive: the predictive log-likelihood of observed bag aggregates, against an
independent Monte-Carlo reference on GPyTorch's own joint predictive and torch.distributions."""
from __future__ import annotations

import math

import pytest
import torch

from milgp.data.bags import BagBatch, Bags, bag_index_from_sizes
from milgp.likelihoods import ExponentialAggregateLikelihood, NormalAggregateLikelihood, PoissonAggregateLikelihood
from milgp.models import SparseGP, WhitenedPosterior
from milgp.variational import aggregate_fit
from milgp.variational.aggregate_fit import bag_log_predictive, fit_aggregate, predict_bag_moments


def _model_and_bags() -> tuple[SparseGP, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    model = SparseGP(torch.randn(6, 2, generator=g, dtype=torch.float64), constant_mean=True, lengthscale=1.3, outputscale=0.5)
    model.mean_module.constant.data.fill_(0.2)
    R = torch.randn(6, 6, generator=g, dtype=torch.float64) / 6**0.5
    S = 0.2 * R @ R.mT + 0.1 * torch.eye(6, dtype=torch.float64)
    model.variational_strategy.set_whitened_posterior(
        WhitenedPosterior(m=0.4 * torch.randn(6, generator=g, dtype=torch.float64), S=S, precision=torch.linalg.inv(S))
    )
    bag_index = bag_index_from_sizes([3, 1, 4, 2])
    x = torch.randn(len(bag_index), 2, generator=g, dtype=torch.float64)
    weights = 0.5 + torch.rand(len(bag_index), generator=g, dtype=torch.float64)
    return model, x, bag_index, weights


def _reference(model, likelihood, x, bag_index, weights, y, draws: int = 200_000) -> torch.Tensor:
    """``log E_{q(f)} p(y_a | f)`` with ``f`` drawn from GPyTorch's eval-mode joint predictive and
    the densities of torch.distributions (none of milgp's block or density code)."""
    model.eval()
    with torch.no_grad():
        out = model(x)
        mvn = torch.distributions.MultivariateNormal(out.mean, out.covariance_matrix + 1e-12 * torch.eye(len(x), dtype=x.dtype))
        f = mvn.sample(torch.Size([draws]))
    B = int(bag_index.max()) + 1
    rate = torch.zeros(draws, B, dtype=x.dtype).index_add_(1, bag_index, weights * likelihood.link(f))
    if isinstance(likelihood, PoissonAggregateLikelihood):
        logp = torch.distributions.Poisson(rate).log_prob(y)
    elif isinstance(likelihood, ExponentialAggregateLikelihood):
        logp = torch.distributions.Exponential(1.0 / rate).log_prob(y)
    else:
        w_sq = torch.zeros(B, dtype=x.dtype).index_add_(0, bag_index, weights**2)
        logp = torch.distributions.Normal(rate, (likelihood.noise.detach() * w_sq).sqrt()).log_prob(y)
    return torch.logsumexp(logp, 0) - math.log(draws)


@pytest.mark.parametrize(
    "likelihood,y,tol",
    [  # tol: several Monte-Carlo standard errors of the reference (its peaked Normal density is the noisiest)
        (PoissonAggregateLikelihood(), torch.tensor([3.0, 0.0, 7.0, 2.0]), 0.01),
        (ExponentialAggregateLikelihood(), torch.tensor([2.5, 0.4, 6.0, 1.0]), 0.01),
        (NormalAggregateLikelihood(noise=0.3), torch.tensor([3.0, -0.5, 4.0, 1.5]), 0.02),
    ],
    ids=["poisson", "exponential", "normal-exact"],
)
def test_bag_log_predictive_equals_a_monte_carlo_reference(likelihood, y, tol) -> None:
    """Each bag's ``log p(y_a | data)`` must match an independent Monte-Carlo estimate on GPyTorch's
    joint predictive (Normal: the exact Gaussian predictive; Poisson, Exponential: milgp's own
    Monte Carlo over the per-bag blocks). A wrong density, a missed within-bag covariance, a
    weight applied twice or a log-mean-exp taken as a mean-log would each move it by far more
    than the tolerance (ignoring the covariance moves them by 0.03–0.06 here)."""
    model, x, bag_index, weights = _model_and_bags()
    likelihood = likelihood.to(torch.float64)
    y = y.to(torch.float64)
    ours = bag_log_predictive(
        model, likelihood, x, Bags(bag_index, 4), y, weights, samples=100_000, generator=torch.Generator().manual_seed(1)
    )
    torch.manual_seed(2)
    ref = _reference(model, likelihood, x, bag_index, weights, y)
    torch.testing.assert_close(ours, ref, rtol=0, atol=tol)


def test_normal_log_prob_given_rate_averaged_over_draws_equals_the_exact_predictive() -> None:
    """The Normal model's conditional ``log p(y_a | η_a)``, averaged over draws of ``η_a`` in log space,
    must reproduce its closed-form predictive (Gaussian in the observation moments): the two routes
    of ``bag_log_predictive`` agree for the conjugate model."""
    model, x, bag_index, weights = _model_and_bags()
    likelihood = NormalAggregateLikelihood(noise=0.3).to(torch.float64)
    y = torch.tensor([3.0, -0.5, 4.0, 1.5], dtype=torch.float64)
    exact = bag_log_predictive(model, likelihood, x, Bags(bag_index, 4), y, weights)
    model.eval()
    with torch.no_grad():
        out = model(x)
        f = torch.distributions.MultivariateNormal(out.mean, out.covariance_matrix).sample(torch.Size([200_000]))
    rate = torch.zeros(len(f), 4, dtype=torch.float64).index_add_(1, bag_index, weights * f)
    w_sq = torch.zeros(4, dtype=torch.float64).index_add_(0, bag_index, weights**2)
    lp = likelihood.log_prob_given_rate(y, rate, w_sq)
    torch.testing.assert_close(exact, torch.logsumexp(lp, 0) - math.log(len(f)), rtol=0, atol=0.01)


@pytest.mark.parametrize(
    "likelihood",
    [PoissonAggregateLikelihood(), PoissonAggregateLikelihood("square"), NormalAggregateLikelihood(noise=0.3)],
    ids=["exp", "square", "identity"],
)
def test_a_bag_too_long_for_one_block_is_summed_in_tiles(likelihood, monkeypatch) -> None:
    """A bag whose n² exceeds ``block_budget`` must give the same predictive moments of
    ``η = Σ w_i Ψ(f_i)`` as the dense block — and as the closed forms on GPyTorch's own joint
    predictive covariance — without ever forming its n × n block. If the tiles missed the
    off-diagonal pairs, counted them once, put anything but the marginal variances on the
    diagonal, dropped the partial last tile, or the long bag still went through the dense path,
    this fails."""
    model, _, _, _ = _model_and_bags()
    g = torch.Generator().manual_seed(3)
    sizes = [3, 1, 45, 2]
    bag_index = bag_index_from_sizes(sizes)
    x = torch.randn(len(bag_index), 2, generator=g, dtype=torch.float64)
    weights = 0.5 + torch.rand(len(bag_index), generator=g, dtype=torch.float64)
    bags, likelihood = Bags(bag_index, 4), likelihood.to(torch.float64)
    dense = predict_bag_moments(model, likelihood, x, bags, weights, block_budget=10_000)
    widths = []
    real_bag_blocks = aggregate_fit.bag_blocks
    monkeypatch.setattr(aggregate_fit, "bag_blocks", lambda m, xg, *a, **k: widths.append(len(xg)) or real_bag_blocks(m, xg, *a, **k))
    tiled = predict_bag_moments(model, likelihood, x, bags, weights, block_budget=144)  # tiles of 12: 12, 12, 12, 9
    assert widths and max(widths) < 45
    for key in ("rate_mean", "rate_var", "y_mean", "y_var"):
        torch.testing.assert_close(tiled[key], dense[key], rtol=1e-11, atol=0)
    model.eval()
    with torch.no_grad():
        out = model(x)
    for b in range(4):
        sel = bag_index == b
        mu, cov, w = out.mean[sel], out.covariance_matrix[sel][:, sel], weights[sel]
        var = cov.diagonal()
        if likelihood.link.name == "exp":
            e = torch.exp(mu + 0.5 * var)
            ref_mean, ref_cov = (w * e).sum(), e[:, None] * e[None, :] * torch.expm1(cov)
        elif likelihood.link.name == "square":
            ref_mean, ref_cov = (w * (mu**2 + var)).sum(), 2 * cov**2 + 4 * mu[:, None] * mu[None, :] * cov
        else:
            ref_mean, ref_cov = (w * mu).sum(), cov
        torch.testing.assert_close(tiled["rate_mean"][b], ref_mean, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(tiled["rate_var"][b], w @ ref_cov @ w, rtol=1e-8, atol=1e-10)


def test_the_elbo_trace_is_the_elbo_of_each_accepted_state() -> None:
    """Each entry of a non-conjugate fit's ELBO trace (reused from the step's own ascent check, not
    recomputed) must be exactly the ELBO of the q(v) the step left — with and without hyperparameter
    steps between. A value kept from a rejected trial step, or kept after the hyperparameters moved,
    fails here."""
    for learn in (False, True):
        model, x, bag_index, weights = _model_and_bags()
        likelihood = PoissonAggregateLikelihood().to(torch.float64)
        batch = BagBatch(x, bag_index, torch.tensor([3.0, 0.0, 7.0, 2.0], dtype=torch.float64), instance_weights=weights)
        trace = []

        def record(it: int, elbo: float) -> None:
            steps = aggregate_fit.AggregateSteps(model.variational_strategy, likelihood, batch)
            trace.append((elbo, steps.aggregate_elbo(batch.bags.groups(), steps.q)))

        # ρ up to 4: some trial steps overshoot and are halved (3 of 6 here)
        fit_aggregate(model, likelihood, batch, max_iter=6, tol=0.0, learn_hyperparameters=learn, rho0=1.0, rho_max=4.0, callback=record)
        assert len(trace) == 6
        for reported, recomputed in trace:
            assert reported == pytest.approx(recomputed, rel=1e-12, abs=1e-12)


def test_a_bag_target_without_instances_is_refused_before_fitting():
    """If this failed, a target of a bag that has no instances (bag_index never names it) would be
    fitted as a bag of zero population."""
    x = torch.randn(6, 2, dtype=torch.float64)
    batch = BagBatch(x, torch.tensor([0, 0, 0, 2, 2, 2]), torch.tensor([3.0, 1.0, 2.0], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^bag 1 has a label but no instances"):
        fit_aggregate(SparseGP(x[:3].clone()), PoissonAggregateLikelihood("exp"), batch, max_iter=2, learn_hyperparameters=False)


@pytest.mark.parametrize("options", [dict(schedule=lambda t: 0.0), dict(schedule=lambda t: -1.0), dict(schedule=lambda t: math.nan),
                                     dict(schedule=lambda t: 1.5), dict(rho0=0.0), dict(rho_max=-1.0)])
def test_a_step_size_that_could_never_step_is_refused(options) -> None:
    """A schedule value outside (0, 1] (as fit_closed_form refuses it) and ρ₀ or ρ_max ≤ 0 raise a
    one-line ValueError. If this fails, the fit takes no step at all and reports convergence at the
    initial ELBO."""
    model, x, bag_index, weights = _model_and_bags()
    batch = BagBatch(x, bag_index, torch.tensor([3.0, 0.0, 7.0, 2.0], dtype=torch.float64), instance_weights=weights)
    with pytest.raises(ValueError, match=r"(schedule\(0\) returned|rho0 must|rho_max must)"):
        fit_aggregate(model, PoissonAggregateLikelihood(), batch, max_iter=3, bags_per_batch=2, learn_hyperparameters=False, **options)


def test_a_tiny_scheduled_step_is_taken_and_max_iter_0_returns_an_empty_fit() -> None:
    """A schedule of 1e-7 (below the backtracking floor 1e-6) still moves q(v) by that step, and
    max_iter = 0 returns a FitResult of 0 iterations (as fit_closed_form does). If this fails, a
    small step size silently freezes the fit, or max_iter = 0 raises an IndexError."""
    model, x, bag_index, weights = _model_and_bags()
    batch = BagBatch(x, bag_index, torch.tensor([3.0, 0.0, 7.0, 2.0], dtype=torch.float64), instance_weights=weights)
    m0 = model.variational_strategy.whitened_posterior().m.clone()
    result = fit_aggregate(model, PoissonAggregateLikelihood(), batch, max_iter=1, bags_per_batch=4, schedule=lambda t: 1e-7,
                           learn_hyperparameters=False)
    assert result.rho == 1e-7
    assert not torch.equal(model.variational_strategy.whitened_posterior().m, m0)
    empty = fit_aggregate(model, PoissonAggregateLikelihood(), batch, max_iter=0, learn_hyperparameters=False)
    assert empty.iterations == 0 and empty.elbo == [] and empty.objective == []
