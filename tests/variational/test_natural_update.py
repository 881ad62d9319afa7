"""The whitened closed-form updates equal the paper's unwhitened equations (Castro-Macías et al.,
*Hyperbolic secant representation of the logistic function*, 2024, Eqs. 25–28).

The reference below is written independently from the paper in plain numpy with explicit
inverses, in u-space: ``S = (K⁻¹ Kzx Θ Kxz K⁻¹ + K⁻¹)⁻¹``, ``m = S K⁻¹ Kzx (π − ½ − Θ·mean)``,
``θ = tanh(c/2)/(2c)``, ``π`` from Eq. 25 with the leave-one-out noisy-OR by brute force.
The project's whitened ``q(v) = N(m_w, S_w)`` maps to u-space by ``m = L m_w``, ``S = L S_w Lᵀ``.
"""
import math

import gpytorch
import numpy as np
import pytest
import torch

from milgp.data.bags import BagBatch, Bags, bag_index_from_sizes
from milgp.likelihoods.mil_bernoulli import MILBernoulliLikelihood
from milgp.likelihoods.noisy_or import MAX_RULE_DAMPING, PI_CLAMP, update_instance_labels
from milgp.models.closed_form_strategy import WhitenedPosterior
from milgp.models.sparse_gp import SparseGP
from milgp.variational import fit_closed_form, natural_statistics
from milgp.variational.natural_update import RobbinsMonro

SIZES = [3, 1, 4, 2, 5, 3, 2, 4]
LABELS = [1, 0, 1, 0, 1, 0, 1, 0]


def make_problem(constant_mean=False, seed=0, M=6, lengthscale=1.3, outputscale=1.7):
    g = torch.Generator().manual_seed(seed)
    bag_index = bag_index_from_sizes(SIZES)
    N = len(bag_index)
    x = torch.randn(N, 2, generator=g, dtype=torch.float64)
    labels = torch.tensor(LABELS, dtype=torch.float64)
    x = x + 0.8 * labels[bag_index].unsqueeze(1)
    Z = torch.randn(M, 2, generator=g, dtype=torch.float64)
    model = SparseGP(Z, constant_mean=constant_mean, lengthscale=lengthscale, outputscale=outputscale)
    if constant_mean:
        model.mean_module.constant.data.fill_(-0.4)
    return model, BagBatch(x, bag_index, labels)


def sigmoid(t):
    return 1.0 / (1.0 + np.exp(-t))


class PaperReference:
    """Algorithm 1 of Castro-Macías et al. (2024) in u-space, numpy float64, explicit inverses."""

    def __init__(self, model, batch, H=100.0, rule="exact"):
        with torch.no_grad():
            Z = model.variational_strategy.inducing_points
            jitter = model.variational_strategy.jitter
            self.Kzz = model.covar_module(Z).to_dense().numpy() + jitter * np.eye(len(Z))
            self.Kzx = model.covar_module(Z, batch.x).to_dense().numpy()
            self.kxx = model.covar_module(batch.x, diag=True).numpy() + jitter
            self.mean0 = model.mean_module(batch.x).numpy()
        self.Kinv = np.linalg.inv(self.Kzz)
        self.bag = batch.bag_index.numpy()
        self.T = batch.bag_labels.numpy()
        self.logH = math.log(H)
        self.rule = rule
        self.members = [np.nonzero(self.bag == b)[0] for b in range(batch.num_bags)]
        M = len(self.Kzz)
        self.m = np.zeros(M)
        self.S = self.Kzz.copy()  # whitened prior N(0, I) is N(0, Kzz) in u-space

    def marginals(self):
        P = self.Kinv @ self.Kzx  # (M, N)
        mu = self.mean0 + P.T @ self.m
        var = self.kxx - np.einsum("mn,mn->n", self.Kzx, P) + np.einsum("mn,mk,kn->n", P, self.S, P)
        return mu, var

    def theta(self):
        mu, var = self.marginals()
        c = np.sqrt(mu**2 + var)
        return np.tanh(c / 2) / (2 * c)

    def update_q(self, pi):
        th = self.theta()
        Ki = self.Kinv
        self.S = np.linalg.inv(Ki @ self.Kzx @ np.diag(th) @ self.Kzx.T @ Ki + Ki)
        self.m = self.S @ Ki @ self.Kzx @ (pi - 0.5 - th * self.mean0)

    def update_pi(self, pi):
        mu, _ = self.marginals()
        pi = pi.copy()
        if self.rule == "exact":  # coordinate ascent by position within bag
            for pos in range(max(len(m) for m in self.members)):
                for b, mem in enumerate(self.members):
                    if pos >= len(mem):
                        continue
                    n = mem[pos]
                    keep = 1.0
                    for i in mem:
                        if i != n:
                            keep *= 1.0 - pi[i]
                    e_max_other = 1.0 - keep
                    val = sigmoid(mu[n] + self.logH * (2 * self.T[b] - 1) * (1 - e_max_other))
                    pi[n] = min(max(val, PI_CLAMP), 1 - PI_CLAMP)
            return pi
        new = np.empty_like(pi)  # "max": parallel update from the previous π
        for b, mem in enumerate(self.members):
            for n in mem:
                others = [pi[i] for i in mem if i != n]
                e_max_other = max(others) if others else 0.0
                val = sigmoid(mu[n] + self.logH * (2 * self.T[b] - 1) * (1 - e_max_other))
                new[n] = min(max(val, PI_CLAMP), 1 - PI_CLAMP)
        return new

    def init_pi(self):
        pi0 = np.clip(0.5 * self.T[self.bag], PI_CLAMP, 1 - PI_CLAMP)
        return self.update_pi(pi0)


def to_u_space(model):
    q = model.variational_strategy.whitened_posterior()
    with torch.no_grad():
        L = model.variational_strategy.inducing_cholesky()
    return (L @ q.m).numpy(), (L @ q.S @ L.mT).numpy()


@pytest.mark.parametrize("constant_mean", [False, True], ids=["zero_mean", "constant_mean"])
@pytest.mark.parametrize("rule", ["exact", "max"])
@pytest.mark.parametrize("iters", [1, 6])
def test_whitened_cavi_equals_unwhitened_paper_updates(constant_mean, rule, iters):
    """m, S (mapped to u-space) and π after ``iters`` CAVI iterations must equal the paper's
    unwhitened Eqs. 25–28 to 1e-8. A failure means the whitening, the mean-function correction
    (−Θ·mean inside the bracket), the jitter, θ, or the π update order/rule is wrong."""
    model, batch = make_problem(constant_mean)
    lik = MILBernoulliLikelihood("pg", H=100.0, max_rule=rule, damping=1.0)  # the paper's undamped rule
    ref = PaperReference(model, batch, H=100.0, rule=rule)
    pi = ref.init_pi()
    for _ in range(iters):
        ref.update_q(pi)
        pi = ref.update_pi(pi)
    res = fit_closed_form(model, lik, batch, max_iter=iters, tol=0.0, min_iter=iters, learn_hyperparameters=False)
    assert res.iterations == iters
    m_u, S_u = to_u_space(model)
    np.testing.assert_allclose(m_u, ref.m, rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(S_u, ref.S, rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(res.locals.numpy(), pi, rtol=1e-8, atol=1e-10)
    # and the predictive marginals agree with Eq. 30
    mu_ref, var_ref = ref.marginals()
    mu, var = model.variational_strategy.predict_marginals(batch.x)
    np.testing.assert_allclose(mu.numpy(), mu_ref, rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(var.numpy(), var_ref, rtol=1e-8, atol=1e-8)


def test_max_rule_is_parallel_update_against_brute_force():
    """``rule='max'`` must compute π_n from max_{i≠n} π_i of the *previous* π for every n at once
    (ties, bags of one → 0); a wrong second-largest or an in-place update fails here."""
    g = torch.Generator().manual_seed(3)
    sizes = [1, 2, 3, 5, 4, 1, 6]
    bag_index = bag_index_from_sizes(sizes)
    N, B = len(bag_index), len(sizes)
    labels = torch.tensor([1, 0, 1, 1, 0, 0, 1], dtype=torch.float64)
    mean = torch.randn(N, generator=g, dtype=torch.float64)
    pi = torch.rand(N, generator=g, dtype=torch.float64)
    pi[3:6] = 0.7  # a three-way tie for the maximum in bag 2
    pi[6] = 0.9  # bag 3: a tie of two at the top
    pi[7] = 0.9
    new = update_instance_labels(mean, pi, Bags(bag_index, B), labels, math.log(100.0), rule="max", damping=1.0)
    damped = update_instance_labels(mean, pi, Bags(bag_index, B), labels, math.log(100.0), rule="max")
    torch.testing.assert_close(damped, (1 - MAX_RULE_DAMPING) * pi + MAX_RULE_DAMPING * new, rtol=0, atol=1e-15)
    bi = bag_index.numpy()
    for n in range(N):
        others = [pi[i].item() for i in range(N) if bi[i] == bi[n] and i != n]
        e_max = max(others) if others else 0.0
        expected = sigmoid(mean[n].item() + math.log(100.0) * (2 * labels[bi[n]].item() - 1) * (1 - e_max))
        assert new[n].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_damped_max_rule_converges_where_the_undamped_one_cycles():
    """A positive bag of two instances that the GP calls negative (μ = −1), H = 10¹²: the reference
    code's undamped parallel update alternates between (1, 1) and (0.27, 0.27) forever; the damped
    default must converge to a fixed point of the same update."""
    mean = torch.tensor([-1.0, -1.0], dtype=torch.float64)
    bag_index = torch.zeros(2, dtype=torch.long)
    labels = torch.ones(1, dtype=torch.float64)
    log_h = math.log(1e12)
    pi = torch.full((2,), 0.5, dtype=torch.float64)
    undamped = [pi]
    for _ in range(40):
        undamped.append(update_instance_labels(mean, undamped[-1], Bags(bag_index, 1), labels, log_h, rule="max", damping=1.0))
    assert abs(undamped[-1][0] - undamped[-2][0]) > 0.5  # still jumping
    damped = pi
    for _ in range(200):
        damped = update_instance_labels(mean, damped, Bags(bag_index, 1), labels, log_h, rule="max")
    target = update_instance_labels(mean, damped, Bags(bag_index, 1), labels, log_h, rule="max", damping=1.0)
    torch.testing.assert_close(target, damped, rtol=0, atol=1e-9)


def test_exact_rule_single_pass_against_brute_force_random_pi():
    """One exact-rule pass from arbitrary π equals the brute-force sequential update; a wrong
    leave-one-out product (e.g. not refreshed after an earlier position) fails here."""
    g = torch.Generator().manual_seed(5)
    sizes = [1, 2, 3, 5, 4, 1, 6]
    bag_index = bag_index_from_sizes(sizes)
    N, B = len(bag_index), len(sizes)
    labels = torch.tensor([1, 0, 1, 1, 0, 0, 1], dtype=torch.float64)
    mean = 2 * torch.randn(N, generator=g, dtype=torch.float64)
    pi = torch.rand(N, generator=g, dtype=torch.float64)
    new = update_instance_labels(mean, pi, Bags(bag_index, B), labels, math.log(37.0), rule="exact").numpy()
    pi_ref = pi.numpy().copy()
    bi = bag_index.numpy()
    for b in range(B):
        members = np.nonzero(bi == b)[0]
        for n in members:  # within a bag, by position; bags are independent
            keep = np.prod([1 - pi_ref[i] for i in members if i != n])
            pi_ref[n] = sigmoid(mean[n].item() + math.log(37.0) * (2 * labels[b].item() - 1) * keep)
    np.testing.assert_allclose(new, pi_ref, rtol=1e-12, atol=1e-14)


def test_unknown_rule_raises():
    """A typo in the rule name must not silently pick a rule."""
    bag_index = bag_index_from_sizes([2])
    with pytest.raises(ValueError, match="rule"):
        update_instance_labels(torch.zeros(2), torch.full((2,), 0.5), Bags(bag_index, 1), torch.ones(1), 1.0, rule="mean")


def _ngd_setup(constant_mean):
    model, batch = make_problem(constant_mean, seed=1)
    lik = MILBernoulliLikelihood("pg", H=100.0)
    res = fit_closed_form(model, lik, batch, max_iter=2, tol=0.0, learn_hyperparameters=False)
    # move q away from the CAVI optimum so that a step has something to do
    q = model.variational_strategy.whitened_posterior()
    g = torch.Generator().manual_seed(2)
    M = q.m.shape[0]
    R = torch.randn(M, M, generator=g, dtype=torch.float64) * 0.2
    model.variational_strategy.set_whitened_posterior(WhitenedPosterior.from_natural(q.natural[0] + 0.3, q.precision + R @ R.mT))
    return model, batch, lik, res.locals


@pytest.mark.parametrize("constant_mean", [False, True], ids=["zero_mean", "constant_mean"])
@pytest.mark.parametrize("rho", [1.0, 0.3])
def test_gpytorch_ngd_step_equals_closed_form_natural_step(constant_mean, rho):
    """One ``gpytorch.optim.NGD(lr=ρ)`` step on ``VariationalELBO`` with the augmented likelihood
    must equal :meth:`WhitenedPosterior.natural_step` with the same π and θ (a natural-gradient step of size ρ is the
    closed-form step of size ρ). A failure means the augmented expected_log_prob has the wrong
    gradient (b, λ, the mean correction), GPyTorch builds q(f) differently (jitter, diag mode), or
    the natural parameterisation differs."""
    model, batch, lik, pi = _ngd_setup(constant_mean)
    N = batch.num_instances
    q0 = model.variational_strategy.whitened_posterior()
    # closed form: θ from the same q, same π
    with torch.no_grad():
        proj = model.variational_strategy.projection(batch.x)
        mean, var = model.variational_strategy.marginals(proj, q0)
        b, lam = lik.quadratic_terms(mean, var, batch.bags, batch.bag_labels, pi)
        expected = q0.natural_step(natural_statistics(proj.A, b, lam, proj.prior_mean), rho=rho)
    # GPyTorch
    model.train()
    lik.train()
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=N)
    opt = gpytorch.optim.NGD(model.variational_parameters(), num_data=N, lr=rho)
    opt.zero_grad()
    target = batch.bag_labels[batch.bag_index]
    loss = -mll(model(batch.x), target, bag_index=batch.bag_index, locals=pi)
    loss.backward()
    opt.step()
    got = model.variational_strategy.whitened_posterior()
    torch.testing.assert_close(got.m, expected.m, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(got.S, expected.S, rtol=1e-8, atol=1e-8)


def test_natural_step_rho_interpolates_natural_parameters():
    """ρ < 1 must be the convex combination in natural parameters (not in (m, S)); ρ outside
    (0, 1] must raise."""
    model, batch, lik, pi = _ngd_setup(False)
    q0 = model.variational_strategy.whitened_posterior()
    with torch.no_grad():
        proj = model.variational_strategy.projection(batch.x)
        mean, var = model.variational_strategy.marginals(proj, q0)
        b, lam = lik.quadratic_terms(mean, var, batch.bags, batch.bag_labels, pi)
        stats = natural_statistics(proj.A, b, lam)
    full = q0.natural_step(stats, rho=1.0)
    half = q0.natural_step(stats, rho=0.4)
    torch.testing.assert_close(half.precision, 0.6 * q0.precision + 0.4 * full.precision)
    torch.testing.assert_close(half.precision @ half.m, 0.6 * q0.precision @ q0.m + 0.4 * full.precision @ full.m)
    with pytest.raises(ValueError, match="rho"):
        q0.natural_step(stats, rho=0.0)
    with pytest.raises(ValueError, match="rho"):
        q0.natural_step(stats, rho=1.5)


def test_statistics_are_additive_over_chunks():
    """h and G are sums over instances, so statistics of two chunks must add up to those of
    the whole batch (needed for chunking and DDP all-reduce)."""
    g = torch.Generator().manual_seed(0)
    A = torch.randn(5, 12, generator=g, dtype=torch.float64)
    b = torch.randn(12, generator=g, dtype=torch.float64)
    lam = torch.rand(12, generator=g, dtype=torch.float64)
    mu0 = torch.randn(12, generator=g, dtype=torch.float64)
    whole = natural_statistics(A, b, lam, mu0)
    parts = natural_statistics(A[:, :7], b[:7], lam[:7], mu0[:7]) + natural_statistics(A[:, 7:], b[7:], lam[7:], mu0[7:])
    torch.testing.assert_close(whole.h, parts.h)
    torch.testing.assert_close(whole.G, parts.G)
    torch.testing.assert_close(whole.h, A @ (b - lam * mu0))


@pytest.mark.parametrize("blocked", [False, True])
def test_weighted_gram_cpu_paths_equal_the_matrix_product(blocked, monkeypatch):
    """``A diag(w)² Aᵀ`` on the CPU — one ``syrk`` on the scaled matrix, or (float64, large
    matrices; forced here) a ``syrk`` accumulated over blocks of instances, a partial last block
    included — must equal the plain product in both memory layouts of ``A`` and be exactly
    symmetric; the gradient path must agree too."""
    from milgp.variational import natural_update
    from milgp.variational.natural_update import _GRAM_BLOCK, weighted_gram

    if blocked:
        monkeypatch.setattr(natural_update, "_GRAM_BLOCKED_BYTES", 0)
    g = torch.Generator().manual_seed(0)
    M = 9
    for N in (37, 2 * _GRAM_BLOCK + 37):
        AT = torch.randn(N, M, generator=g, dtype=torch.float64)
        w = torch.rand(N, generator=g, dtype=torch.float64)
        expected = (AT * w.unsqueeze(1) ** 2).mT @ AT
        for dtype, tol in ((torch.float64, 1e-11), (torch.float32, 1e-3)):
            for A in (AT.to(dtype).mT, AT.to(dtype).mT.contiguous()):
                G = weighted_gram(A, w.to(dtype))
                assert G.dtype == dtype and torch.equal(G, G.mT)
                torch.testing.assert_close(G.double(), expected, rtol=tol, atol=tol)
        A_grad = AT.mT.clone().requires_grad_(True)
        torch.testing.assert_close(weighted_gram(A_grad, w).detach(), expected, rtol=1e-11, atol=1e-11)


def test_robbins_monro_schedule():
    """ρ_t = (t+τ)^−κ, first step 1 with τ=1, and κ outside (0.5, 1] rejected."""
    rm = RobbinsMonro(tau=1.0, kappa=0.6)
    assert rm(0) == 1.0
    assert rm(9) == pytest.approx(10 ** -0.6)
    with pytest.raises(ValueError, match="kappa"):
        RobbinsMonro(kappa=0.5)
    with pytest.raises(ValueError, match="tau > 0"):
        RobbinsMonro(tau=0.0)  # (0 + 0)**-kappa would divide by zero at the first step
    with pytest.raises(ValueError, match="tau"):
        RobbinsMonro(tau=-1)


def test_single_instance_rule_against_brute_force():
    """``rule="single"``: every instance answers for its bag's label on its own,
    ``π_n ← (1 − δ)π_n + δ σ(μ_n + log H (2T_b − 1))``, whatever its bag-mates' π."""
    g = torch.Generator().manual_seed(4)
    bag_index = bag_index_from_sizes([3, 1, 4])
    labels = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    mean = torch.randn(8, generator=g, dtype=torch.float64)
    pi = torch.rand(8, generator=g, dtype=torch.float64)
    log_h = math.log(50.0)
    new = update_instance_labels(mean, pi, Bags(bag_index, 3), labels, log_h, rule="single", damping=0.3)
    sign = 2 * labels[bag_index] - 1
    expected = 0.7 * pi + 0.3 * torch.sigmoid(mean + log_h * sign)
    torch.testing.assert_close(new, expected, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="'single'"):
        update_instance_labels(mean, pi, Bags(bag_index, 3), labels, log_h, rule="witness")
