"""Adaptive over-relaxed closed-form steps: the step itself, the ω schedule, and the fit with it."""
import numpy as np
import pytest
import torch

from milgp.data.bags import BagBatch
from milgp.data.synthetic_mil import synthetic_mil
from milgp.likelihoods.mil_bernoulli import MILBernoulliLikelihood
from milgp.models.closed_form_strategy import WhitenedPosterior
from milgp.models.sparse_gp import SparseGP
from milgp.variational import closed_form_elbo, fit_closed_form
from milgp.variational.natural_update import NaturalStatistics
from milgp.variational.overrelaxation import GROWTH, AdaptiveOverrelaxation


def _posterior(m, P):
    P = torch.as_tensor(P, dtype=torch.float64)
    return WhitenedPosterior(m=torch.as_tensor(m, dtype=torch.float64), S=torch.linalg.inv(P), precision=P)


def _statistics_of(target):
    """Natural statistics whose optimum (scale 1) is ``target``: ``h = η̂``, ``G = P̂ − I``."""
    return NaturalStatistics(h=target.precision @ target.m, G=target.precision - torch.eye(len(target.m), dtype=torch.float64))


def test_overrelaxed_step_extrapolates_the_natural_parameters():
    """``ρ = 2.5`` in :meth:`WhitenedPosterior.try_natural_step` must give the natural parameters ``η + 2.5(η̂ − η)``,
    ``P + 2.5(P̂ − P)`` computed here by hand (and ``ρ = 1`` the optimum itself); a different
    result means the step extrapolates the mean or the covariance instead of the natural
    parameters. The step also keeps the Cholesky factor of its precision (the moments and the KL
    reuse it): a factor of another matrix would give wrong variances and KL."""
    q = _posterior([0.3, -1.0], [[2.0, 0.3], [0.3, 1.5]])
    target = _posterior([0.8, -0.2], [[2.6, 0.5], [0.5, 2.0]])
    stats = _statistics_of(target)
    at_one = q.try_natural_step(stats, 1.0, 1.0)
    torch.testing.assert_close(at_one.m, target.m, rtol=1e-12, atol=1e-12)
    out = q.try_natural_step(stats, 2.5, 1.0)
    P = q.precision + 2.5 * (target.precision - q.precision)
    eta = q.precision @ q.m + 2.5 * (target.precision @ target.m - q.precision @ q.m)
    torch.testing.assert_close(out.precision, P, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(out.m, torch.linalg.solve(P, eta), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.S, torch.linalg.inv(P), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.chol_precision @ out.chol_precision.mT, P, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.kl_divergence(), 0.5 * (torch.trace(out.S) + out.m @ out.m - 2 + torch.logdet(P)))


def test_overrelaxed_step_refuses_an_indefinite_precision():
    """Going far past a target of lower precision makes ``P + ω(P̂ − P)`` indefinite
    (``3I + 2(I − 3I) = −I``): the step must say so (``None``) rather than factorise it."""
    q = _posterior([0.0, 0.0], 3 * np.eye(2))
    stats = _statistics_of(_posterior([0.1, 0.1], np.eye(2)))
    assert q.try_natural_step(stats, 2.0, 1.0) is None
    assert q.try_natural_step(stats, 1.4, 1.0) is not None  # 3 + 1.4·(1 − 3) = 0.2 > 0


def test_omega_grows_to_its_cap_and_resets_after_a_rejection():
    """ω must grow by GROWTH per kept step up to the cap and return to 1 after a rejected step;
    a cap below 1 is refused."""
    relax = AdaptiveOverrelaxation(2.0)
    assert relax.omega == 1.0
    relax.accept()
    assert relax.omega == pytest.approx(GROWTH)
    for _ in range(20):
        relax.accept()
    assert relax.omega == 2.0
    relax.reject()
    assert relax.omega == 1.0
    with pytest.raises(ValueError, match="over-relaxation cap"):
        AdaptiveOverrelaxation(0.5)


@pytest.fixture(scope="module")
def synthetic():
    """3,000 instances of the synthetic MIL set (Gaussian clusters, a fifth of each positive bag
    from the positive cluster: the shape on which CAVI is slow, since which instance is the
    witness couples q(y) and q(v)), z-scored; 30 inducing points among the instances."""
    x, bag_index, labels, _ = synthetic_mil(3000, seed=0)
    x = torch.as_tensor((x - x.mean(0)) / x.std(0))
    Z = x[torch.as_tensor(np.random.default_rng(0).choice(len(x), 30, replace=False))].clone()
    return BagBatch(x, torch.as_tensor(bag_index), torch.as_tensor(labels)), Z


def model_from(Z):
    return SparseGP(Z.clone(), lengthscale=float(np.sqrt(10)), outputscale=1.0)


def test_overrelaxed_fit_reaches_the_cavi_fixed_point_in_fewer_sweeps_and_never_lowers_the_elbo(synthetic):
    """With the exact noisy-OR rule (a coordinate ascent) the over-relaxed fit must reach plain
    CAVI's optimum (same ELBO to 1e-7, same q(v) and π to 1e-3) in fewer than half the sweeps, its
    ELBO must never decrease, and the safeguard must have been needed (some steps rejected) —
    otherwise the extrapolation either changes the fixed point, is not faster, or is kept when it
    lowers the ELBO."""
    batch, Z = synthetic
    runs = {}
    for cap in (1.0, 10.0):
        model = model_from(Z)
        lik = MILBernoulliLikelihood(max_rule="exact")
        res = fit_closed_form(model, lik, batch, max_iter=1000, tol=1e-11, learn_hyperparameters=False, max_overrelaxation=cap)
        assert res.converged
        runs[cap] = (model, lik, res)
    (plain_model, _, plain), (fast_model, fast_lik, fast) = runs[1.0], runs[10.0]
    assert plain.rejected_steps == 0 and fast.rejected_steps > 0
    assert fast.iterations < 0.5 * plain.iterations, (fast.iterations, plain.iterations)
    assert fast.elbo[-1] == pytest.approx(plain.elbo[-1], rel=1e-7)
    elbo = np.asarray(fast.elbo)
    assert (np.diff(elbo) >= -1e-9 * np.abs(elbo[1:])).all(), np.diff(elbo).min()
    torch.testing.assert_close(fast_model.variational_strategy.whitened_posterior().m, plain_model.variational_strategy.whitened_posterior().m, rtol=0, atol=1e-3)
    torch.testing.assert_close(fast.locals, plain.locals, rtol=0, atol=1e-3)
    # the reported ELBO is that of the final state, whichever step produced it
    assert closed_form_elbo(fast_model, fast_lik, batch, fast.locals) == pytest.approx(fast.elbo[-1], rel=1e-10)


@pytest.mark.parametrize("kwargs", [dict(bags_per_batch=8), dict(learn_hyperparameters=True)])
def test_overrelaxation_is_refused_where_its_safeguard_does_not_hold(synthetic, kwargs):
    """Minibatch steps and hyperparameter steps change the objective between sweeps, so the
    ELBO comparison of the safeguard would mean nothing: the fit must refuse, naming the option."""
    batch, Z = synthetic
    kwargs = {"learn_hyperparameters": False, **kwargs}
    with pytest.raises(ValueError, match="max_overrelaxation"):
        fit_closed_form(model_from(Z), MILBernoulliLikelihood(), batch, max_iter=2, max_overrelaxation=5.0, **kwargs)
