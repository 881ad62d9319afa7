"""MIL-GP-Probit likelihood (Wang & Pinar, *The MIL Gaussian process probit model*, AISTATS 2021):
closed-form locals, exact ELBO, natural steps (closed form and plain GPyTorch), orthant bag
predictions."""
import math

import gpytorch
import mpmath as mp
import numpy as np
import pytest
import torch
from scipy import stats

from milgp.data.bags import BagBatch, Bags
from milgp.likelihoods import MILProbitLikelihood
from milgp.likelihoods.mil_probit import bag_log_normaliser, expected_augmentation
from milgp.likelihoods.instance_link import ProbitLink
from milgp.likelihoods.orthant import orthant_probability
from milgp.prediction import BagPosterior, NoisyOrRule, OrthantRule
from milgp.models.sparse_gp import SparseGP
from milgp.variational.fit import closed_form_elbo, fit_closed_form
from milgp.variational.natural_update import RobbinsMonro, natural_statistics

mp.mp.dps = 60


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def make_problem(B=30, n=5, seed=0, d=2):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(B * n, d))
    h = (X[:, 0] + 0.5 * X[:, 1] > 1.0).astype(float)
    bi = np.repeat(np.arange(B), n)
    y = np.zeros(B)
    np.maximum.at(y, bi, h)
    return BagBatch(torch.tensor(X), torch.tensor(bi), torch.tensor(y)), h


def paper_expectations(nu, bi, y):
    """Wang & Pinar (2021), Eqs. 21–24, written literally with scipy (valid for moderate ν)."""
    S = nu - stats.norm.pdf(nu) / stats.norm.cdf(-nu)  # Eq. 22
    P = np.ones(int(bi.max()) + 1)
    np.multiply.at(P, bi, stats.norm.cdf(-nu))  # Π_{i∈b} (1 − Φ(μ_i))
    P = P[bi]
    return np.where(y[bi] == 0, S, (nu - S * P) / (1 - P))  # Eq. 21 / Eq. 24


def test_expectations_match_the_papers_formulas():
    """If this fails, E[m] differs from Wang & Pinar 2021, Eqs. 21–24 (mean of q(f), product over
    the whole bag — no leave-one-out), i.e. the natural step targets the wrong q(u)."""
    rng = np.random.default_rng(1)
    nu = rng.normal(size=40) * 2
    bi = np.repeat(np.arange(8), 5)
    y = np.array([0, 1, 1, 0, 1, 0, 1, 1], dtype=float)
    em = expected_augmentation(torch.tensor(nu), torch.tensor(bi), torch.tensor(y), 8).numpy()
    np.testing.assert_allclose(em, paper_expectations(nu, bi, y), rtol=1e-10, atol=1e-12)


def _mp_positive(nus, i):
    """High-precision E[m_i] and log Z for a positive bag."""
    with mp.workdps(1000):
        return _mp_positive_inner(nus, i)


def _mp_positive_inner(nus, i):
    nus = [mp.mpf(v) for v in nus]
    log_P = mp.fsum([mp.log1p(-mp.ncdf(v)) for v in nus])  # log Φ(−ν) = log1p(−Φ(ν)), no rounding to 1
    P = mp.exp(log_P)
    one_minus = -mp.expm1(log_P)
    s = nus[i] - mp.npdf(nus[i]) / mp.ncdf(-nus[i])
    return float((nus[i] - s * P) / one_minus), float(mp.log(one_minus))


@pytest.mark.parametrize(
    "nus",
    [
        [-30.0, -30.0, -31.0],  # Π Φ(−μ) ≈ 1: the limit (one instance forced positive)
        [-38.0, -40.0],  # Φ(μ) underflows 1 − Π in double precision
        [30.0, 25.0, -30.0],  # Π Φ(−μ) ≈ 0: constraint already satisfied
        [-30.0],  # bag of one: N(−30, 1) truncated to (0, ∞)
        [0.3, -1.2, 2.0],
    ],
)
def test_positive_bag_extremes_against_mpmath(nus):
    """If this fails, a positive bag with all-negative probability ≈ 1 or ≈ 0 gives NaN/inf or a
    wrong E[m] / log Z (the catastrophic cancellation of ``1 − Π Φ`` near 1, which must be computed
    in log space)."""
    nu = torch.tensor(nus, dtype=torch.float64)
    bi = torch.zeros(len(nus), dtype=torch.long)
    y = torch.ones(1, dtype=torch.float64)
    em = expected_augmentation(nu, bi, y, 1)
    log_z = bag_log_normaliser(nu, bi, y, 1)
    assert torch.isfinite(em).all() and torch.isfinite(log_z).all()
    for i in range(len(nus)):
        ref_m, ref_z = _mp_positive(nus, i)
        assert abs(float(em[i]) - ref_m) <= 1e-10 * max(1.0, abs(ref_m))
    assert abs(float(log_z[0]) - ref_z) <= 1e-12 * max(1.0, abs(ref_z))


def test_negative_bag_extremes():
    """If this fails, a negative bag at |μ| = 30 (or beyond) gives a non-finite or wrong E[m]/log Z."""
    nu = torch.tensor([30.0, -30.0, 35.0, -60.0], dtype=torch.float64)
    bi = torch.tensor([0, 0, 1, 1])
    y = torch.zeros(2, dtype=torch.float64)
    em = expected_augmentation(nu, bi, y, 2)
    log_z = bag_log_normaliser(nu, bi, y, 2)
    for v, e in zip(nu.tolist(), em.tolist()):
        m = mp.mpf(v)
        assert abs(e - float(m - mp.npdf(m) / mp.ncdf(-m))) <= 1e-12 * max(1, abs(e))
    ref = [float(mp.log(mp.ncdf(-30)) + mp.log1p(-mp.ncdf(-30))), float(mp.log(mp.ncdf(-35)) + mp.log1p(-mp.ncdf(-60)))]
    np.testing.assert_allclose(log_z.numpy(), ref, rtol=1e-13)


def test_float32_bags_are_finite_and_agree_with_float64():
    """If this fails, float32 gives NaN/inf log Z_b or E[m] (e.g. a positive bag with one instance at
    ν ≤ −14: the float32 underflow of Φ(−|ν|) made log Z and every E[m] of the bag NaN) or loses
    more than float32 precision, over ν ∈ [−30, 30], positive and negative bags."""
    g = torch.Generator().manual_seed(0)
    B, n = 400, 6
    nu64 = (torch.rand(B * n, generator=g, dtype=torch.float64) * 60 - 30).float().double()
    nu64[::7] = -30.0 + 0.5 * (torch.arange(len(nu64[::7])) % 33).double()  # the deep-negative band
    nu64[:3] = torch.tensor([-20.0, 1.0, 0.5], dtype=torch.float64)  # the audit's reproducer (bag 0)
    nu64[6:12] = -30.0  # a positive bag with every instance far negative
    bi = torch.arange(B).repeat_interleave(n)
    y64 = (torch.arange(B) % 2 == 0).double()
    y64[1] = 1.0
    nu32, y32 = nu64.float(), y64.float()
    lz32 = bag_log_normaliser(nu32, bi, y32, B)
    em32 = expected_augmentation(nu32, bi, y32, B)
    assert lz32.dtype == em32.dtype == torch.float32
    assert torch.isfinite(lz32).all() and torch.isfinite(em32).all()
    lz64 = bag_log_normaliser(nu64, bi, y64, B)
    em64 = expected_augmentation(nu64, bi, y64, B)
    rel = lambda a, b: float(((a.double() - b).abs() / b.abs().clamp_min(1.0)).max())  # noqa: E731
    assert rel(lz32, lz64) < 2e-6
    assert rel(em32, em64) < 5e-6
    # the all-far-negative positive bag (Π Φ(−ν) rounds to 1): log Z → log(Σ Φ(ν_i)) exactly
    assert float(lz32[1]) == pytest.approx(float(lz64[1]), rel=1e-6)


def test_cavi_never_decreases_the_exact_elbo():
    """If this fails, the closed-form updates (natural step with b = E[m], λ = 1, then ν ← μ) are not
    coordinate ascent on the ELBO (★) — a wrong E[m], a wrong ELBO, or the wrong λ."""
    batch, _ = make_problem()
    model = SparseGP(batch.x[::3].clone(), lengthscale=1.0, outputscale=2.0)
    res = fit_closed_form(model, MILProbitLikelihood(), batch, max_iter=60, tol=0, learn_hyperparameters=False)
    elbo = np.array(res.elbo)
    assert np.isfinite(elbo).all()
    assert (np.diff(elbo) >= -1e-9 * np.abs(elbo[1:])).all(), np.diff(elbo).min()


def test_locals_are_optimal_and_elbo_equals_collapsed_bound():
    """If this fails, ν = μ is not a stationary point of (★) (the ELBO formula and the E[m]
    update disagree) or (★) at ν = μ differs from the collapsed bound Σ log Z_b − ½Σσ²."""
    batch, _ = make_problem(B=6, n=4, seed=3)
    lik = MILProbitLikelihood()
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(24, dtype=torch.float64, generator=g) * 2
    var = torch.rand(24, dtype=torch.float64, generator=g) + 0.1
    nu = mean.clone().requires_grad_(True)
    val = lik.elbo_terms(mean, var, batch.bags, batch.bag_labels, nu).sum()
    (grad,) = torch.autograd.grad(val, nu)
    assert grad.abs().max() < 1e-10
    collapsed = lik.collapsed_elbo_terms(mean, var, batch.bags, batch.bag_labels).sum()
    assert abs(float(val) - float(collapsed)) < 1e-10
    # without gradients at ν = μ, elbo_terms takes the collapsed form: the same value as (★) in full
    with torch.no_grad():
        at_optimum = lik.elbo_terms(mean, var, batch.bags, batch.bag_labels, mean.clone())
    torch.testing.assert_close(at_optimum.sum(), val.detach(), rtol=1e-12, atol=1e-12)
    # moving ν away can only lower it
    worse = lik.elbo_terms(mean, var, batch.bags, batch.bag_labels, mean + 0.3).sum()
    assert float(worse) < float(val)


def _every_positive_instance_its_own_bag(batch):
    """The same instances with every instance of a positive bag alone in a positive bag."""
    positive = batch.bag_labels.bool()[batch.bag_index]
    keys = torch.where(positive, batch.bag_index.max() + 1 + torch.arange(len(positive)), batch.bag_index)
    _, index = torch.unique(keys, return_inverse=True)
    labels = torch.zeros(int(index.max()) + 1, dtype=torch.float64).index_reduce_(0, index, positive.double(), "amax")
    return BagBatch(batch.x, index, labels)


def test_single_instance_learning_is_the_probit_model_with_every_positive_instance_its_own_bag():
    """Single-instance learning (``single_instance=True``) must be the MIL probit model on bags in
    which every instance of a positive bag stands alone: the same E[m] (a normal truncated to
    m > 0: scipy's truncnorm on positive bags), ELBO, collapsed bound and fit, with ν = μ still
    the optimal locals. If this fails, the single-instance candidates of ProbitMILClassifier fit
    some other model."""
    batch, _ = make_problem(B=12, n=4, seed=5)
    alone = _every_positive_instance_its_own_bag(batch)
    assert alone.num_bags > batch.num_bags and int(batch.bag_labels.sum()) > 0
    sil, mil = MILProbitLikelihood(single_instance=True), MILProbitLikelihood()
    g = torch.Generator().manual_seed(1)
    mean = torch.randn(batch.num_instances, dtype=torch.float64, generator=g) * 2
    var = torch.rand(batch.num_instances, dtype=torch.float64, generator=g) + 0.1
    nu = mean + 0.2 * torch.randn(batch.num_instances, dtype=torch.float64, generator=g)
    em = expected_augmentation(nu, batch.bag_index, batch.bag_labels, batch.num_bags, single_instance=True)
    positive = batch.bag_labels.bool()[batch.bag_index].numpy()
    x = nu.numpy()
    truncated = stats.truncnorm.mean(-x, np.inf, loc=x, scale=1.0)
    np.testing.assert_allclose(em.numpy()[positive], truncated[positive], rtol=1e-10)
    np.testing.assert_allclose(em.numpy(), expected_augmentation(nu, alone.bag_index, alone.bag_labels, alone.num_bags).numpy(), rtol=1e-12)
    for method, args in (("elbo_terms", (nu,)), ("collapsed_elbo_terms", ())):
        ours = getattr(sil, method)(mean, var, batch.bags, batch.bag_labels, *args).sum()
        ref = getattr(mil, method)(mean, var, alone.bags, alone.bag_labels, *args).sum()
        assert float(ours) == pytest.approx(float(ref), rel=1e-12)
    at = mean.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(sil.elbo_terms(mean, var, batch.bags, batch.bag_labels, at).sum(), at)
    assert grad.abs().max() < 1e-10
    fits = []
    for lik, b in ((sil, batch), (mil, alone)):
        model = SparseGP(batch.x[::3].clone(), lengthscale=1.0, outputscale=2.0)
        fits.append(fit_closed_form(model, lik, b, max_iter=15, tol=0, learn_hyperparameters=False).elbo)
    np.testing.assert_allclose(fits[0], fits[1], rtol=1e-10)
    assert (np.diff(fits[0]) >= -1e-9 * np.abs(np.array(fits[0][1:]))).all()


def test_elbo_is_a_lower_bound_on_the_exact_log_marginal():
    """If this fails, the 'exact ELBO' is not a bound on log p(Y): for 2 bags of 2 with Z = X the
    evidence is a Gaussian orthant probability computed independently with scipy."""
    X = torch.tensor([[0.0, 0.0], [0.4, 0.1], [1.5, 1.0], [2.0, 1.2]], dtype=torch.float64)
    bi = torch.tensor([0, 0, 1, 1])
    y = torch.tensor([0.0, 1.0], dtype=torch.float64)
    batch = BagBatch(X, bi, y)
    model = SparseGP(X.clone(), lengthscale=1.0, outputscale=0.5)
    res = fit_closed_form(model, MILProbitLikelihood(), batch, max_iter=300, tol=1e-12, learn_hyperparameters=False)
    with torch.no_grad():
        K = model.covar_module(X).to_dense().numpy() + model.variational_strategy.jitter * np.eye(4)
    C = K + np.eye(4)
    mvn = lambda idx: stats.multivariate_normal(np.zeros(len(idx)), C[np.ix_(idx, idx)], abseps=1e-10, releps=1e-10).cdf(np.zeros(len(idx)))  # noqa: E731
    log_evidence = math.log(mvn([0, 1]) - mvn([0, 1, 2, 3]))
    assert res.elbo[-1] <= log_evidence + 1e-6
    assert res.elbo[-1] >= log_evidence - 0.5  # and not a vacuous one (the mean-field gap is ≈ 0.38 here)


def reference_cavi(X, bi, y, Z, outputscale, lengthscale, jitter, iters=2000):
    """Plain numpy, *unwhitened* CAVI from Wang & Pinar 2021, Eqs. 17–24 (independent of milgp)."""
    def k(a, b):
        d2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
        return outputscale * np.exp(-0.5 * d2 / lengthscale**2)

    Kzz = k(Z, Z) + jitter * np.eye(len(Z))
    Kzx = k(Z, X)
    Kzz_inv = np.linalg.inv(Kzz)
    Sigma_u = np.linalg.inv(Kzz_inv + Kzz_inv @ Kzx @ Kzx.T @ Kzz_inv)  # Eq. 17
    mu_M = np.zeros(len(X))
    for _ in range(iters):
        Em = paper_expectations(mu_M, bi, y)  # Eqs. 21–24
        mu_u = Sigma_u @ Kzz_inv @ Kzx @ Em  # Eq. 18
        new = Kzx.T @ Kzz_inv @ mu_u  # Eq. 19
        if np.abs(new - mu_M).max() < 1e-12:
            mu_M = new
            break
        mu_M = new
    B = Kzz_inv @ Kzx
    var = outputscale + jitter - (Kzx * B).sum(0) + (B * (Sigma_u @ B)).sum(0)
    return mu_M, var


def test_vi_matches_independent_unwhitened_reference():
    """If this fails, the whitened closed-form VI (fit_closed_form + MILProbitLikelihood) does not
    reach the fixed point of the paper's own unwhitened updates (Eqs. 17–19) — a bug in the
    whitening, the natural step or the locals. Tolerance 1e-6: both iterate until the iterates stop
    changing in double precision; the remaining ~1e-7 difference is the conditioning of the explicit
    K_zz⁻¹ in the unwhitened reference."""
    batch, _ = make_problem(B=20, n=5, seed=2)
    Z = batch.x[::4].clone()
    model = SparseGP(Z, lengthscale=1.2, outputscale=1.5)
    fit_closed_form(model, MILProbitLikelihood(), batch, max_iter=1000, tol=0, min_iter=50, learn_hyperparameters=False)
    mean, var = model.variational_strategy.predict_marginals(batch.x)
    ref_mean, ref_var = reference_cavi(
        batch.x.numpy(), batch.bag_index.numpy(), batch.bag_labels.numpy(), Z.numpy(), 1.5, 1.2, model.variational_strategy.jitter
    )
    np.testing.assert_allclose(mean.numpy(), ref_mean, atol=1e-6)
    np.testing.assert_allclose(var.numpy(), ref_var, atol=1e-6)
    p = MILProbitLikelihood.instance_link.moments(mean, var)[0].numpy()
    np.testing.assert_allclose(p, stats.norm.cdf(ref_mean / np.sqrt(1 + ref_var)), atol=1e-6)


def test_minibatch_natural_steps_approach_the_full_batch_optimum():
    """If this fails, the stochastic natural steps (minibatches of whole bags, s = B/B_batch,
    Robbins–Monro ρ_t, locals ν subset/written back) do not converge to the CAVI solution."""
    batch, _ = make_problem(B=40, n=5, seed=4)
    Z = batch.x[::5].clone()
    full = SparseGP(Z.clone(), lengthscale=1.0, outputscale=1.0)
    lik = MILProbitLikelihood()
    r_full = fit_closed_form(full, lik, batch, max_iter=300, tol=1e-12, learn_hyperparameters=False)
    mini = SparseGP(Z.clone(), lengthscale=1.0, outputscale=1.0)
    r_mini = fit_closed_form(
        mini, lik, batch, max_iter=40, tol=0, bags_per_batch=10, learn_hyperparameters=False, schedule=RobbinsMonro(1.0, 0.51)
    )
    assert math.isfinite(r_mini.elbo[-1])
    # Robbins–Monro steps (κ = 0.51) after 160 noisy steps: within 5% of the optimum's ELBO
    assert r_mini.elbo[-1] > r_full.elbo[-1] - 0.05 * abs(r_full.elbo[-1])
    m_full, _ = full.variational_strategy.predict_marginals(batch.x)
    m_mini, _ = mini.variational_strategy.predict_marginals(batch.x)
    # SVI with decaying steps is still creeping towards the optimum (means somewhat shrunk) but the
    # latent function has the optimum's shape
    assert float(torch.corrcoef(torch.stack([m_full, m_mini]))[0, 1]) > 0.97


def test_plain_gpytorch_value_and_one_ngd_step_equal_the_closed_form():
    """If this fails, MILProbitLikelihood does not work from plain GPyTorch: VariationalELBO's value
    differs from the closed-form ELBO, or one NGD(lr=1) step differs from the closed-form natural
    step."""
    batch, _ = make_problem(B=12, n=4, seed=5)
    N = batch.num_instances
    model = SparseGP(batch.x[::3].clone(), lengthscale=1.0, outputscale=1.0, natural=True)
    lik = MILProbitLikelihood()
    fit_closed_form(model, lik, batch, max_iter=2, tol=0, min_iter=1, learn_hyperparameters=False)
    # move q(v) away from a fixed point so the step is not trivial
    q0 = model.variational_strategy.whitened_posterior()
    q0 = type(q0).from_natural(q0.precision @ (q0.m + 0.3), q0.precision * 1.5)
    model.variational_strategy.set_whitened_posterior(q0)
    mean, var = model.variational_strategy.predict_marginals(batch.x)
    nu = lik.optimal_locals(mean, var, batch.bags, batch.bag_labels)
    b, lam = lik.quadratic_terms(mean, var, batch.bags, batch.bag_labels, nu)
    proj = model.variational_strategy.projection(batch.x)
    with torch.no_grad():
        expected = q0.natural_step(natural_statistics(proj.A, b, lam, proj.prior_mean), rho=1.0)
    closed_elbo = closed_form_elbo(model, lik, batch, nu)

    model.train()
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=N)
    opt = gpytorch.optim.NGD(model.variational_parameters(), num_data=N, lr=1.0)
    opt.zero_grad()
    target = batch.bag_labels[batch.bag_index]
    value = mll(model(batch.x), target, bag_index=batch.bag_index)
    assert abs(float(value) * N - closed_elbo) < 1e-8 * max(1.0, abs(closed_elbo))
    (-value).backward()
    opt.step()
    got = model.variational_strategy.whitened_posterior()
    np.testing.assert_allclose(got.m.numpy(), expected.m.numpy(), atol=1e-8)
    np.testing.assert_allclose(got.S.numpy(), expected.S.numpy(), atol=1e-8)


# -- predictions -------------------------------------------------------------------------------------


def _random_bags(sizes, seed):
    rng = np.random.default_rng(seed)
    n = max(sizes)
    B = len(sizes)
    mean = np.zeros((B, n))
    cov = np.tile(np.eye(n), (B, 1, 1))
    mask = np.zeros((B, n), dtype=bool)
    for b, k in enumerate(sizes):
        W = rng.normal(size=(k, k))
        cov[b, :k, :k] = W @ W.T / k * 1.5 + 0.05 * np.eye(k)
        mean[b, :k] = rng.normal(size=k) - 1.0
        mask[b, :k] = True
    return torch.tensor(mean), torch.tensor(cov), torch.tensor(mask)


def test_orthant_bag_probability_matches_brute_force_monte_carlo():
    """If this fails, the Genz/QMC orthant bag probability 1 − P(all m* < 0), m* ~ N(μ, Σ + I), is
    biased or its standard error is understated (compared with 4·10⁵ brute-force draws)."""
    sizes = [1, 2, 3, 5, 7]
    mean, cov, mask = _random_bags(sizes, 0)
    p, se = OrthantRule(num_points=1024, replicates=8)(BagPosterior.from_blocks(mean, cov, mask), ProbitLink())
    g = torch.Generator().manual_seed(1)
    S = 400000
    for b, k in enumerate(sizes):
        C = cov[b, :k, :k] + torch.eye(k, dtype=torch.float64)
        m = mean[b, :k] + torch.randn(S, k, dtype=torch.float64, generator=g) @ torch.linalg.cholesky(C).mT
        p_mc = 1 - float((m < 0).all(1).double().mean())
        se_mc = math.sqrt(p_mc * (1 - p_mc) / S)
        assert abs(float(p[b]) - p_mc) <= 4 * math.sqrt(float(se[b]) ** 2 + se_mc**2) + 1e-12, (k, float(p[b]), p_mc)
        assert float(se[b]) < 1e-3
    assert float(se[0]) == 0.0  # a bag of one is exact: Φ(μ/sqrt(1+σ²))


def test_orthant_agrees_with_scipy_genz():
    """If this fails, the orthant probability disagrees with scipy's (Genz) multivariate normal CDF."""
    mean, cov, mask = _random_bags([4, 6], 3)
    p_neg, se = orthant_probability(mean, cov, mask, num_points=2048, replicates=8)
    for b, k in enumerate([4, 6]):
        ref = stats.multivariate_normal(mean[b, :k].numpy(), cov[b, :k, :k].numpy(), abseps=1e-7, releps=1e-7).cdf(np.zeros(k))
        assert abs(float(p_neg[b]) - ref) <= 5 * float(se[b]) + 2e-6


def test_bag_prediction_accounts_for_within_bag_correlation():
    """If this fails, the bag prediction ignores within-bag correlation: a bag of two identical
    instances must be *more* likely negative than a bag of two independent ones (Wang & Pinar 2021,
    §3.4)."""
    mean = torch.tensor([[-0.5, -0.5]], dtype=torch.float64)
    sig2 = 2.0
    same = torch.full((1, 2, 2), sig2, dtype=torch.float64)
    indep = torch.diag_embed(torch.full((1, 2), sig2, dtype=torch.float64))
    mask = torch.ones(1, 2, dtype=torch.bool)
    p_same, _ = OrthantRule()(BagPosterior.from_blocks(mean, same, mask), ProbitLink())
    p_ind, _ = OrthantRule()(BagPosterior.from_blocks(mean, indep, mask), ProbitLink())
    p_ind2, _ = NoisyOrRule()(BagPosterior(mean[0], torch.full((2,), sig2, dtype=torch.float64), Bags(torch.zeros(2, dtype=torch.long), 1)), ProbitLink())
    assert float(p_same) < float(p_ind) - 0.05  # 1 − P(neg): higher P(neg) ⇔ lower P(pos)
    assert abs(float(p_ind) - float(p_ind2)) < 1e-3
    # through the model: a bag [x, x] has the full correlation from bag_covariances
    model = SparseGP(torch.tensor([[0.0], [3.0]], dtype=torch.float64), lengthscale=1.0, outputscale=2.0)
    x = torch.tensor([[1.0], [1.0]], dtype=torch.float64)
    mp_, cp, mk = model.variational_strategy.bag_covariances(x, Bags(torch.zeros(2, dtype=torch.long), 1))
    p_joint, _ = OrthantRule()(BagPosterior.from_blocks(mp_, cp, mk), ProbitLink())
    m, v = model.variational_strategy.predict_marginals(x)
    p_indep, _ = NoisyOrRule()(BagPosterior(m, v, Bags(torch.zeros(2, dtype=torch.long), 1)), ProbitLink())
    assert float(p_joint) < float(p_indep) - 0.05


def test_orthant_large_bags_and_extremes_are_finite():
    """If this fails, bags of 100+ instances or with |μ| = 30 give NaN/inf, probabilities outside
    [0, 1], or an unusable standard error."""
    rng = np.random.default_rng(0)
    n = 120
    W = rng.normal(size=(n, 4))
    cov = torch.tensor(W @ W.T * 0.2 + 0.1 * np.eye(n))[None].repeat(3, 1, 1)
    mean = torch.stack([torch.full((n,), -30.0), torch.full((n,), 30.0), torch.tensor(rng.normal(size=n) - 3.0)]).double()
    mask = torch.ones(3, n, dtype=torch.bool)
    p, se = OrthantRule(num_points=256, replicates=4)(BagPosterior.from_blocks(mean, cov, mask), ProbitLink())
    assert torch.isfinite(p).all() and torch.isfinite(se).all()
    assert ((p >= 0) & (p <= 1)).all()
    assert float(p[0]) < 1e-100 + 1e-12 and float(p[1]) == pytest.approx(1.0, abs=1e-12)
    assert float(se[2]) < 0.01 and 0 < float(p[2]) < 1


def test_orthant_large_correlated_bag_matches_brute_force_monte_carlo():
    """If this fails, the QMC orthant probability of a large (150-instance) correlated bag is biased
    — not merely non-finite: it must agree with 2·10⁵ seeded brute-force draws within 4 combined
    standard errors, and differ clearly from the independent-instance product (the within-bag
    correlation matters: P(all < 0) ≈ 0.58 here against ≈ 0.37 for independent instances). The
    same bag padded next to a small bag must give the same estimate as alone."""
    rng = np.random.default_rng(11)
    n = 150
    W = rng.normal(size=(n, 3))
    C = W @ W.T * 0.4 + 0.6 * np.eye(n)
    sd = np.sqrt(np.diag(C))
    mean = -(2.6 + 0.3 * rng.normal(size=n)) * sd
    mean_t, cov_t = torch.tensor(mean)[None], torch.tensor(C)[None]
    p, se = orthant_probability(mean_t, cov_t, num_points=4096, replicates=8, seed=3)
    p, se = float(p), float(se)
    g = torch.Generator().manual_seed(123)
    L = torch.linalg.cholesky(cov_t[0])
    S, hits = 200_000, 0
    for _ in range(8):
        z = torch.randn(S // 8, n, dtype=torch.float64, generator=g) @ L.mT + mean_t
        hits += int((z < 0).all(1).sum())
    p_mc = hits / S
    se_mc = math.sqrt(p_mc * (1 - p_mc) / S)
    assert 0 < se < 1e-3
    assert abs(p - p_mc) <= 4 * math.sqrt(se**2 + se_mc**2), (p, p_mc, se, se_mc)
    p_indep = float(torch.special.log_ndtr(torch.tensor(-mean / sd)).sum().exp())
    assert abs(p_indep - p_mc) > 20 * se_mc and abs(p - p_indep) > 0.1
    # padded into a batch with a bag of 4 (padding to 160): the bag's estimate does not change
    mean_pad = torch.zeros(2, 160, dtype=torch.float64)
    cov_pad = torch.eye(160, dtype=torch.float64).repeat(2, 1, 1)
    mask = torch.zeros(2, 160, dtype=torch.bool)
    mean_pad[1, :n], cov_pad[1, :n, :n], mask[1, :n] = mean_t[0], cov_t[0], True
    mean_pad[0, :4], mask[0, :4] = -1.0, True
    p2, se2 = orthant_probability(mean_pad, cov_pad, mask, num_points=4096, replicates=8, seed=3)
    assert float(p2[1]) == pytest.approx(p, rel=1e-12) and float(se2[1]) == pytest.approx(se, rel=1e-9)
    assert float(p2[0]) == pytest.approx(float(stats.norm.cdf(1.0)) ** 4, abs=1e-4)


def test_instance_label_posterior_matches_enumeration_of_the_labels():
    """``q(y_n = 1 | T_b)`` must be the probability of the instance's label given its bag's label
    when the labels are independent with ``P(y_n = 1) = Φ(μ_n / √(1 + σ_n²))``: checked against
    enumerating all ``2^n`` labellings of each bag (float64). A wrong normaliser (the bag's
    probability of holding a positive) or a nonzero value in a negative bag would fail it; with
    single-instance learning every instance carries its bag's label."""
    rng = np.random.default_rng(3)
    sizes, labels = [1, 3, 4, 2], [1, 1, 0, 1]
    bag_index = torch.as_tensor(np.repeat(np.arange(len(sizes)), sizes))
    mean = torch.as_tensor(rng.normal(-0.5, 1.5, sum(sizes)))
    var = torch.as_tensor(rng.uniform(0.1, 2.0, sum(sizes)))
    bags, t = Bags(bag_index, len(sizes)), torch.tensor(labels, dtype=torch.float64)
    got = MILProbitLikelihood().instance_label_posterior(mean, var, bags, t, mean).numpy()
    p = stats.norm.cdf(mean.numpy() / np.sqrt(1 + var.numpy()))
    start = 0
    for n, label in zip(sizes, labels):
        pb, want = p[start : start + n], np.zeros(n)
        if label:
            configs = np.array(np.meshgrid(*[[0, 1]] * n, indexing="ij")).reshape(n, -1).T
            weight = np.prod(np.where(configs == 1, pb, 1 - pb), axis=1) * (configs.sum(1) > 0)
            want = (weight[:, None] * configs).sum(0) / weight.sum()
        np.testing.assert_allclose(got[start : start + n], want, rtol=1e-10, atol=1e-12)
        start += n
    single = MILProbitLikelihood(single_instance=True).instance_label_posterior(mean, var, bags, t, mean)
    assert torch.equal(single, t[bag_index])
