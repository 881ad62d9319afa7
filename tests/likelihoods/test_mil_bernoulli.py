"""The ψ-VGPMIL bag likelihood: GPyTorch interface, reduction to GP logistic classification,
predictions (Castro-Macías et al., *Hyperbolic secant representation of the logistic function*,
2024, Eqs. 31–36)."""
import math

import gpytorch
import numpy as np
import pytest
import torch

from milgp.data.bags import BagBatch, bag_index_from_sizes
from milgp.likelihoods.mil_bernoulli import MILBernoulliLikelihood
from milgp.likelihoods.quadrature import gauss_hermite_expectation
from milgp.models.sparse_gp import SparseGP
from milgp.variational import fit_closed_form


def small_problem(seed=0, B=10, M=6, sizes=None):
    g = torch.Generator().manual_seed(seed)
    sizes = sizes or torch.randint(1, 5, (B,), generator=g).tolist()
    bag_index = bag_index_from_sizes(sizes)
    N = len(bag_index)
    labels = (torch.arange(len(sizes)) % 2).to(torch.float64)
    x = torch.randn(N, 2, generator=g, dtype=torch.float64) + 1.2 * labels[bag_index].unsqueeze(1)
    Z = x[torch.randperm(N, generator=g)[:M]].clone()
    return Z, BagBatch(x, bag_index, labels)


# -- expected_log_prob and the closed-form ELBO --------------------------------------------------
@pytest.mark.parametrize("psi", ["pg", "gamma"])
def test_expected_log_prob_value_equals_closed_form_elbo_terms(psi):
    """The augmented expected_log_prob must have the value of the closed-form ELBO data terms at
    the same locals, so that VariationalELBO reports the same number as the fast path."""
    Z, batch = small_problem()
    model = SparseGP(Z, lengthscale=1.0, outputscale=1.5)
    lik = MILBernoulliLikelihood(psi)
    res = fit_closed_form(model, lik, batch, max_iter=3, tol=0.0, learn_hyperparameters=False)
    model.train()
    out = model(batch.x)
    target = batch.bag_labels[batch.bag_index]
    elp = lik.expected_log_prob(target, out, bag_index=batch.bag_index, locals=res.locals).sum()
    mean, var = model.variational_strategy.predict_marginals(batch.x)
    closed = lik.elbo_terms(mean, var, batch.bags, batch.bag_labels, res.locals).sum()
    assert elp.item() == pytest.approx(closed.item(), rel=1e-10)
    # and the whole VariationalELBO (× N) equals the fast path's ELBO
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=batch.num_instances)
    value = mll(out, target, bag_index=batch.bag_index, locals=res.locals).item() * batch.num_instances
    assert value == pytest.approx(res.elbo[-1], rel=1e-9)


def test_without_locals_the_elbo_is_read_at_the_locals_fixed_point():
    """Without ``locals=``, VariationalELBO (and NGD) see the locals optimised for the current q(f).
    Five damped passes of the largest-other-π rule from the start stopped far from the fixed point
    that the closed-form fit reaches: at the fit's q(v) the mll read an ELBO below the fit's (by 0.6
    nats here, by 21 on 30 bags at H = 10¹²), and NGD settled at a worse q(v). Iterated to their
    fixed point the two agree."""
    Z, batch = small_problem(seed=3, B=16, sizes=[6, 8, 5, 7] * 4)
    model = SparseGP(Z, lengthscale=1.0, outputscale=1.5)
    lik = MILBernoulliLikelihood(H=100.0, max_rule="max")
    res = fit_closed_form(model, lik, batch, max_iter=400, tol=0.0, learn_hyperparameters=False)
    model.train()
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=batch.num_instances)
    value = mll(model(batch.x), batch.bag_labels[batch.bag_index], bag_index=batch.bag_index).item() * batch.num_instances
    assert value == pytest.approx(res.elbo[-1], abs=1e-6)


def test_expected_log_prob_requires_bag_index():
    """Without bag_index the bag structure is unknown: the error must say how to pass it."""
    Z, batch = small_problem()
    model = SparseGP(Z)
    model.train()
    with pytest.raises(ValueError, match="bag_index"):
        MILBernoulliLikelihood().expected_log_prob(batch.bag_labels[batch.bag_index], model(batch.x))


@pytest.mark.parametrize("likelihood", ["bernoulli", "probit"])
def test_predictive_log_likelihood_is_refused_not_fitted_per_instance(likelihood):
    """GPyTorch's PredictiveLogLikelihood sums per-instance ``log E[p(y_n | f_n)]``; with bag labels
    as the targets that is an instance classifier, not the MIL model. The bag likelihoods must
    refuse it with an error that names VariationalELBO instead of training the wrong model."""
    from milgp.likelihoods.mil_probit import MILProbitLikelihood

    Z, batch = small_problem()
    model = SparseGP(Z)
    model.train()
    lik = MILBernoulliLikelihood() if likelihood == "bernoulli" else MILProbitLikelihood()
    mll = gpytorch.mlls.PredictiveLogLikelihood(lik, model, num_data=batch.num_instances)
    with pytest.raises(TypeError, match="scores bags, not instances.*VariationalELBO"):
        mll(model(batch.x), batch.bag_labels[batch.bag_index], bag_index=batch.bag_index)


def test_adam_on_variational_elbo_reaches_closed_form_optimum():
    """Plain GPyTorch (Cholesky q(v), Adam, locals optimised inside expected_log_prob) must climb
    the same objective as CAVI and get within 1% of its optimum; otherwise the likelihood is not
    usable as an ordinary GPyTorch likelihood."""
    torch.manual_seed(0)
    Z, batch = small_problem(seed=1, B=8, M=4)
    lik = MILBernoulliLikelihood("pg")
    ref_model = SparseGP(Z, lengthscale=1.0, outputscale=1.5)
    best = fit_closed_form(ref_model, lik, batch, max_iter=300, tol=1e-12, learn_hyperparameters=False).elbo[-1]
    model = SparseGP(Z, lengthscale=1.0, outputscale=1.5, natural=False)
    model.train()
    N = batch.num_instances
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=N)
    opt = torch.optim.Adam(model.variational_parameters(), lr=0.1)
    target = batch.bag_labels[batch.bag_index]
    values = []
    for _ in range(200):
        opt.zero_grad()
        loss = -mll(model(batch.x), target, bag_index=batch.bag_index)
        loss.backward()
        opt.step()
        values.append(-loss.item() * N)
    assert values[-1] > values[0]
    assert values[-1] <= best + 1e-6 * abs(best)
    assert abs(values[-1] - best) < 0.01 * abs(best)


# -- bags of one: sparse GP logistic classification ---------------------------------------------
def logistic_pg_cavi(A, y, iters=200):
    """Independent PG-augmented sparse GP logistic classification (whitened), numpy."""
    M, N = A.shape
    m, S = np.zeros(M), np.eye(M)
    for _ in range(iters):
        mu = A.T @ m
        var = PRIOR_RESIDUAL + np.einsum("mn,mk,kn->n", A, S, A)
        c = np.sqrt(mu**2 + var)
        th = np.where(c < 1e-8, 0.25, np.tanh(c / 2) / (2 * np.maximum(c, 1e-300)))
        S = np.linalg.inv(np.eye(M) + A @ np.diag(th) @ A.T)
        m = S @ A @ (y - 0.5)
    return m, S


PRIOR_RESIDUAL = None


def test_bags_of_one_reduce_to_sparse_gp_logistic_classification():
    """With bags of one and T = y, π_n = sigmoid(μ_n + log H·(2y_n − 1)) → y_n as H → ∞ (the
    leave-one-out term is 0 for a bag of one), so q(v) must equal the PG sparse GP logistic
    classifier with b = y − ½. With H = 1e12 and |μ| < 10, |π − y| ≤ max(PI_CLAMP=1e-7,
    e^{10}/H) ≈ 1e-7, which moves m by at most ‖S A‖₁·1e-7: we assert 1e-5."""
    global PRIOR_RESIDUAL
    g = torch.Generator().manual_seed(4)
    N, M = 40, 8
    x = torch.randn(N, 2, generator=g, dtype=torch.float64)
    y = (x[:, 0] + 0.5 * torch.randn(N, generator=g, dtype=torch.float64) > 0).to(torch.float64)
    batch = BagBatch(x, torch.arange(N), y)
    Z = x[:M].clone() + 0.01
    model = SparseGP(Z, lengthscale=1.2, outputscale=2.0)
    lik = MILBernoulliLikelihood("pg", H=1e12)
    res = fit_closed_form(model, lik, batch, max_iter=200, tol=1e-13, learn_hyperparameters=False)
    with torch.no_grad():
        proj = model.variational_strategy.projection(x)
    A = proj.A.numpy()
    PRIOR_RESIDUAL = proj.prior_var.numpy() - (A * A).sum(0)
    m_ref, S_ref = logistic_pg_cavi(A, y.numpy())
    q = model.variational_strategy.whitened_posterior()
    assert (res.locals - y).abs().max() < 2e-7
    np.testing.assert_allclose(q.m.numpy(), m_ref, atol=1e-5)
    np.testing.assert_allclose(q.S.numpy(), S_ref, atol=1e-5)

    # the closed-form ELBO is a lower bound of the exact logistic ELBO at the same q (quadrature)
    mean, var = model.variational_strategy.predict_marginals(x)
    sign = 2 * y - 1
    exact = gauss_hermite_expectation(lambda f: torch.nn.functional.logsigmoid(sign.unsqueeze(-1) * f), mean, var, 80)
    c = torch.sqrt(mean**2 + var)
    bound = (y - 0.5) * mean - torch.log(2 * torch.cosh(c / 2))
    assert (bound <= exact + 1e-12).all()
    # tight where var → 0 (PG tangent exact at f² = c²)
    tiny = torch.full_like(var, 1e-10)
    exact0 = gauss_hermite_expectation(lambda f: torch.nn.functional.logsigmoid(sign.unsqueeze(-1) * f), mean, tiny, 80)
    bound0 = (y - 0.5) * mean - torch.log(2 * torch.cosh(torch.sqrt(mean**2 + tiny) / 2))
    torch.testing.assert_close(bound0, exact0, atol=1e-9, rtol=0)
    # and the project's ELBO equals that bound up to the vanishing bag/entropy terms
    elbo_data = lik.elbo_terms(mean, var, batch.bags, batch.bag_labels, res.locals).sum()
    assert elbo_data.item() == pytest.approx(bound.sum().item(), abs=N * 1e-5)


def test_constructor_validation():
    """H ≤ 1 makes wrong bag labels as likely as right ones; an unknown rule or ψ must raise."""
    with pytest.raises(ValueError, match="H"):
        MILBernoulliLikelihood(H=1.0)
    with pytest.raises(ValueError, match="max_rule"):
        MILBernoulliLikelihood(max_rule="mean")
    with pytest.raises(ValueError, match="psi"):
        MILBernoulliLikelihood(psi="student")


@pytest.mark.parametrize("psi", ["pg", "gamma"])
def test_instance_label_posterior_is_q_y_and_knows_the_bag_labels(psi):
    """At a fit, the instance-label posterior must be the fit's ``q(y)`` (``π``): 0 in every negative
    bag whatever ``q(f)`` says there, and under the largest-other-π rule a witness (``π > ½``) in
    every positive bag. The estimators calibrate instance probabilities to it, so a posterior that
    ignored the bag labels (e.g. ``E_q[σ(f)]``) would fail here."""
    Z, batch = small_problem(seed=1, B=12)
    lik = MILBernoulliLikelihood(psi, H=1e12, max_rule="max")
    res = fit_closed_form(SparseGP(Z, lengthscale=1.0, outputscale=3.0), lik, batch, max_iter=30, learn_hyperparameters=False)
    post = lik.instance_label_posterior(*res.moments, batch.bags, batch.bag_labels, res.locals)
    assert torch.equal(post, res.locals.clamp(0, 1))
    negative = batch.bag_labels[batch.bag_index] == 0
    assert post[negative].max() < 1e-6
    top = torch.zeros(batch.num_bags, dtype=post.dtype).scatter_reduce(0, batch.bag_index, post, "amax")
    assert (top[batch.bag_labels == 1] > 0.5).all()


def test_a_minibatch_that_kept_global_bag_ids_is_named_as_such():
    """Bags 2.. alone under their global ids: the empty bags 0 and 1 were reported as "bag 0 has
    label -inf" (the largest label of no instance)."""
    Z, batch = small_problem()
    model = SparseGP(Z, lengthscale=1.0, outputscale=1.5)
    keep = batch.bag_index >= 2
    mll = gpytorch.mlls.VariationalELBO(MILBernoulliLikelihood(), model, num_data=int(keep.sum()))
    with pytest.raises(ValueError, match=r"bag 0 has no instances \(2 such bag\(s\)\): number the bags of a minibatch"):
        mll(model(batch.x[keep]), batch.bag_labels[batch.bag_index][keep], bag_index=batch.bag_index[keep])


@pytest.mark.parametrize("case", ["bag target", "short index", "negative id", "short labels"])
def test_a_call_that_does_not_fit_bag_index_is_one_line(case):
    """The README's ``mll(model(x), target, bag_index=...)`` with the bag labels (B,) as the target
    (an easy slip), a bag_index shorter than x, a negative id, or bag_labels= for fewer bags than
    bag_index names: each was a torch RuntimeError or IndexError from deep in a scatter."""
    Z, batch = small_problem()
    model = SparseGP(Z, lengthscale=1.0, outputscale=1.5)
    mll = gpytorch.mlls.VariationalELBO(MILBernoulliLikelihood(), model, num_data=batch.num_instances)
    target, index, kw = batch.bag_labels[batch.bag_index], batch.bag_index, {}
    if case == "bag target":
        target, message = batch.bag_labels, r"^target has shape \(10,\); it must be \(\d+,\), each bag's value on its instances"
    elif case == "short index":
        index, message = index[:-3], r"^bag_index has shape \(\d+,\); it must be \(\d+,\), the bag of each instance$"
    elif case == "negative id":
        index, message = index.clone(), r"^bag_index holds bag -1; bag ids start at 0$"
        index[0] = -1
    else:
        kw, message = {"bag_labels": batch.bag_labels[:4]}, r"^bag_index holds bag 9, but the 4 bags of bag_labels are 0\.\.3$"
    with pytest.raises(ValueError, match=message):
        mll(model(batch.x), target, bag_index=index, **kw)
