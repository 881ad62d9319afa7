"""The performance paths of the closed-form fit give the same numbers as the plain ones.

* chunked vs unchunked sufficient statistics and moments;
* the cached projection ``A`` (reused across passes while the hyperparameters are fixed) vs
  recomputing it in every pass, for full-batch and minibatch fits, with and without
  hyperparameter steps;
* minibatch stochastic natural steps (SVI) converge close to the full-batch optimum;
* the contiguous-layout position sweep of ``q(y)`` vs the per-position gather/scatter loop;
* the fused marginal variance, the cached Cholesky factor in the KL, joint bag sampling.

No timing assertions.
"""
import math

import numpy as np
import pytest
import torch

from milgp.data.bags import BagBatch, Bags, bag_index_from_sizes
from milgp.likelihoods.instance_link import LogisticLink
from milgp.likelihoods.mil_bernoulli import MILBernoulliLikelihood
from milgp.prediction import BagPosterior, JointNoisyOrRule
from milgp.likelihoods.noisy_or import positions_in_bag, update_instance_labels
from milgp.models.closed_form_strategy import ClosedFormStrategy, Projection, WhitenedPosterior
from milgp.models.sparse_gp import SparseGP
from milgp.variational import fit as fit_mod
from milgp.variational.projection_cache import ProjectionCache
from milgp.variational.fit import fit_closed_form


def make_problem(num_bags=60, M=12, seed=0, dim=3):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 9, size=num_bags)
    bag_index = bag_index_from_sizes(sizes.tolist())
    labels = torch.tensor((np.arange(num_bags) % 2).astype(np.float64))
    N = len(bag_index)
    x = torch.as_tensor(rng.normal(size=(N, dim)))
    pos_inst = (labels[bag_index] > 0) & (torch.as_tensor(rng.random(N)) < 0.4)
    x[pos_inst] += 2.0
    # shuffle the flat order so bags are not contiguous
    perm = torch.as_tensor(rng.permutation(N))
    batch = BagBatch(x[perm], bag_index[perm], labels)
    Z = x[torch.as_tensor(rng.choice(N, M, replace=False))].clone()
    return batch, Z


def make_model(Z, **kw):
    return SparseGP(Z.clone(), lengthscale=1.5, outputscale=1.3, **kw)


def random_posterior(M, seed=1):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(M, M, generator=g, dtype=torch.float64)
    P = torch.eye(M, dtype=torch.float64) + X @ X.mT / M
    return WhitenedPosterior.from_natural(torch.randn(M, generator=g, dtype=torch.float64), P)


def test_chunked_statistics_and_moments_equal_unchunked():
    batch, Z = make_problem()
    model = make_model(Z)
    q = random_posterior(Z.shape[0])
    N = batch.num_instances
    g = torch.Generator().manual_seed(3)
    b = torch.randn(N, generator=g, dtype=torch.float64)
    lam = torch.rand(N, generator=g, dtype=torch.float64)
    whole = ProjectionCache(model.variational_strategy, batch.x, N, 0)
    full = whole.statistics(b, lam)
    m_full, v_full = whole.moments(q)
    for chunk in (1, 7, 50):
        for budget in (0, 10**9):
            proj = ProjectionCache(model.variational_strategy, batch.x, chunk, budget)
            st = proj.statistics(b, lam)
            m, v = proj.moments(q)
            assert proj.cached == (budget > 0)
            torch.testing.assert_close(st.h, full.h, rtol=0, atol=1e-12)
            torch.testing.assert_close(st.G, full.G, rtol=0, atol=1e-12)
            torch.testing.assert_close(m, m_full, rtol=0, atol=1e-12)
            torch.testing.assert_close(v, v_full, rtol=0, atol=1e-12)


def test_statistics_match_direct_formula():
    batch, Z = make_problem()
    model = make_model(Z)
    N = batch.num_instances
    b = torch.linspace(-0.5, 0.5, N, dtype=torch.float64)
    lam = torch.linspace(0.01, 0.25, N, dtype=torch.float64)
    with torch.no_grad():
        A = model.variational_strategy.projection(batch.x).A
    st = ProjectionCache(model.variational_strategy, batch.x, 13, 10**9).statistics(b, lam)
    torch.testing.assert_close(st.h, A @ b, rtol=0, atol=1e-12)
    torch.testing.assert_close(st.G, A @ torch.diag(lam) @ A.mT, rtol=0, atol=1e-12)


def _run(batch, Z, **kw):
    model = make_model(Z)
    lik = MILBernoulliLikelihood()
    res = fit_closed_form(model, lik, batch, tol=0.0, **kw)
    q = model.variational_strategy.whitened_posterior()
    return res, q, model


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_iter=6, learn_hyperparameters=False),
        dict(max_iter=4, learn_hyperparameters=True, hyper_steps=2, hyper_max_instances=150),
        dict(max_iter=3, learn_hyperparameters=False, bags_per_batch=16),
        dict(max_iter=2, learn_hyperparameters=True, hyper_steps=1, bags_per_batch=16),
    ],
    ids=["full-fixed", "full-learned", "minibatch-fixed", "minibatch-learned"],
)
def test_cached_projection_path_equals_uncached(kw):
    batch, Z = make_problem()
    ref, q_ref, _ = _run(batch, Z, cache_bytes=0, chunk_size=10**9, **kw)
    for chunk, budget in ((10**9, 10**9), (17, 10**9), (17, 0)):
        res, q, _ = _run(batch, Z, cache_bytes=budget, chunk_size=chunk, **kw)
        np.testing.assert_allclose(res.elbo, ref.elbo, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(q.m, q_ref.m, rtol=0, atol=1e-10)
        torch.testing.assert_close(q.S, q_ref.S, rtol=0, atol=1e-10)
        torch.testing.assert_close(res.locals, ref.locals, rtol=0, atol=1e-10)


def test_cache_is_refreshed_after_hyperparameter_steps():
    """With learned hyperparameters the cached A must follow the kernel: the ELBO the fit reports
    equals a fresh evaluation at the final hyperparameters."""
    batch, Z = make_problem()
    model = make_model(Z)
    lik = MILBernoulliLikelihood()
    res = fit_closed_form(model, lik, batch, max_iter=4, tol=0.0, learn_hyperparameters=True, hyper_steps=3, lr=0.05)
    fresh = fit_mod.closed_form_elbo(model, lik, batch, res.locals)
    assert res.elbo[-1] == pytest.approx(fresh, rel=1e-10, abs=1e-10)


def test_minibatch_svi_converges_close_to_full_batch():
    batch, Z = make_problem(num_bags=80)
    full, q_full, _ = _run(batch, Z, max_iter=60, learn_hyperparameters=False)
    model = make_model(Z)
    lik = MILBernoulliLikelihood()
    svi = fit_closed_form(model, lik, batch, max_iter=60, tol=0.0, learn_hyperparameters=False, bags_per_batch=20)
    q = model.variational_strategy.whitened_posterior()
    elbo_svi = fit_mod.closed_form_elbo(model, lik, batch, svi.locals)
    assert elbo_svi == pytest.approx(full.elbo[-1], rel=0.01)
    mu_full = model.variational_strategy.predict_marginals(batch.x)[0]
    model_full = make_model(Z)
    model_full.variational_strategy.set_whitened_posterior(q_full)
    mu_ref = model_full.variational_strategy.predict_marginals(batch.x)[0]
    assert torch.corrcoef(torch.stack([mu_full, mu_ref]))[0, 1] > 0.98


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layout_sweep_equals_position_loop(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 12, size=40).tolist()
    bag_index = bag_index_from_sizes(sizes)
    perm = torch.as_tensor(rng.permutation(len(bag_index)))
    bag_index = bag_index[perm]
    B = len(sizes)
    labels = torch.as_tensor(rng.integers(0, 2, size=B).astype(np.float64))
    mean = torch.as_tensor(rng.normal(0, 3, size=len(bag_index)))
    pi = torch.as_tensor(rng.random(len(bag_index)))
    loop = update_instance_labels(mean, pi, Bags(bag_index, B), labels, math.log(100.0), "exact", positions_in_bag(bag_index, B))
    lay = update_instance_labels(mean, pi, Bags(bag_index, B), labels, math.log(100.0), "exact", Bags(bag_index, B).layout)
    default = update_instance_labels(mean, pi, Bags(bag_index, B), labels, math.log(100.0), "exact")
    torch.testing.assert_close(lay, loop, rtol=0, atol=1e-15)
    torch.testing.assert_close(default, loop, rtol=0, atol=1e-15)


def test_the_layout_belongs_to_its_bags_not_to_the_likelihood():
    """The exact q(y) sweep's layout is computed once per :class:`Bags` and kept on it; a likelihood
    used on two bag structures of the same length (e.g. a freed index tensor whose memory is
    reused) must give each its own sweep, equal to a fresh likelihood's. If this fails, a cached
    layout of other bags is applied (wrong π) or the layout is recomputed every sweep."""
    lik = MILBernoulliLikelihood()
    a = Bags(bag_index_from_sizes([2, 3, 1]), 3)
    b = Bags(bag_index_from_sizes([1, 1, 4]), 3)
    mean = torch.tensor([0.3, -1.0, 2.0, 0.1, -0.5, 1.0], dtype=torch.float64)
    labels = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    pi = torch.full((6,), 0.5, dtype=torch.float64)
    out_a = lik.update_locals(mean, None, a, labels, pi)
    out_b = lik.update_locals(mean, None, b, labels, pi)
    torch.testing.assert_close(out_b, MILBernoulliLikelihood().update_locals(mean, None, b, labels, pi), rtol=0, atol=0)
    torch.testing.assert_close(lik.update_locals(mean, None, a, labels, pi), out_a, rtol=0, atol=0)
    assert not torch.equal(out_a, out_b)
    layout = a.layout
    lik.update_locals(mean, None, a, labels, pi)
    assert a.layout is layout and torch.equal(layout.flat, Bags(a.index, a.num_bags).layout.flat)


def test_fused_marginal_variance_matches_formula_and_grad_path():
    batch, Z = make_problem()
    model = make_model(Z)
    q = random_posterior(Z.shape[0])
    with torch.no_grad():
        proj = model.variational_strategy.projection(batch.x)
        mean, var = ClosedFormStrategy.marginals(proj, q)
    A = proj.A
    ref = proj.prior_var - (A * A).sum(0) + (A * (q.S @ A)).sum(0)
    torch.testing.assert_close(var, ref.clamp_min(1e-10), rtol=0, atol=1e-12)
    torch.testing.assert_close(mean, proj.prior_mean + A.mT @ q.m, rtol=0, atol=1e-12)
    proj_g = model.variational_strategy.projection(batch.x)
    mean_g, var_g = ClosedFormStrategy.marginals(proj_g, q)
    assert var_g.requires_grad
    torch.testing.assert_close(var_g.detach(), var, rtol=0, atol=1e-12)
    var_g.sum().backward()  # differentiable for the hyperparameter steps
    assert model.covar_module.raw_outputscale.grad is not None
    # the cached A is not modified by the in-place variance pass
    A_copy = A.clone()
    ClosedFormStrategy.marginals(Projection(A=A, prior_var=proj.prior_var, prior_mean=proj.prior_mean), q)
    assert torch.equal(A, A_copy)


def test_kl_with_cached_cholesky_equals_refactorised():
    q = random_posterior(9)
    assert q.chol_precision is not None
    plain = WhitenedPosterior(m=q.m, S=q.S, precision=q.precision)
    torch.testing.assert_close(q.kl_divergence(), plain.kl_divergence(), rtol=0, atol=1e-12)


def test_joint_bag_sampling_matches_broadcast_formula():
    """The joint noisy-OR rule samples all bags of a group with one batched GEMM; it must equal the
    plain broadcast formula f = mean + L·eps draw for draw (the same seed drawn from the generator,
    the k-th instance of every bag on the k-th row of its stream), padding masked."""
    g = torch.Generator().manual_seed(0)
    B, n, S = 7, 5, 64
    X = torch.randn(B, n, n, generator=g, dtype=torch.float64)
    cov = X @ X.mT / n + 0.1 * torch.eye(n, dtype=torch.float64)
    mean = torch.randn(B, n, generator=g, dtype=torch.float64)
    mask = torch.rand(B, n, generator=g) < 0.8
    mask[:, 0] = True
    post = BagPosterior.from_blocks(mean, cov, mask)
    order = next(post.joint_blocks()).bags  # the rule's group order (smallest bags first)
    p, s = JointNoisyOrRule(num_samples=S)(post, LogisticLink(), torch.Generator().manual_seed(5))
    L = torch.linalg.cholesky_ex(cov[order] + 1e-10 * torch.eye(n, dtype=torch.float64))[0]
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(5)))
    eps = torch.as_tensor(np.random.default_rng(seed).standard_normal((n, S)).T)  # (S, n)
    f = mean[order] + (L @ eps[:, None, :, None]).squeeze(-1)
    p_bag = -torch.expm1((torch.nn.functional.logsigmoid(-f) * mask[order]).sum(-1))
    torch.testing.assert_close(p[order], p_bag.mean(0), rtol=0, atol=1e-12)
    torch.testing.assert_close(s[order], p_bag.std(0, correction=0), rtol=0, atol=1e-12)


def test_chunks_of_given_sizes_equal_one_chunk():
    """Chunks of uneven sizes (the aggregate fit's groups of whole bags) give the statistics and
    moments of one chunk; sizes that do not add up to the inputs are refused. If this fails, a
    chunk boundary loses or repeats instances."""
    batch, Z = make_problem()
    model = make_model(Z)
    q = random_posterior(Z.shape[0])
    N = batch.num_instances
    g = torch.Generator().manual_seed(5)
    b, lam = torch.randn(N, generator=g, dtype=torch.float64), torch.rand(N, generator=g, dtype=torch.float64)
    whole = ProjectionCache(model.variational_strategy, batch.x, N, 0)
    sizes = [1, 40, N - 41 - 17, 17]
    for budget in (0, 10**9):
        parts = ProjectionCache(model.variational_strategy, batch.x, sizes, budget)
        assert [int(p.A.shape[1]) for _, p in parts.chunks()] == sizes
        torch.testing.assert_close(parts.statistics(b, lam).G, whole.statistics(b, lam).G, rtol=1e-12, atol=1e-12)
        for a, c in zip(parts.moments(q), whole.moments(q)):
            torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=f"add up to {N - 1}, not to the {N} inputs"):
        ProjectionCache(model.variational_strategy, batch.x, [N - 1], 0)


@pytest.mark.parametrize("link", ["exp", "square"])
def test_aggregate_fit_with_its_projections_kept_equals_recomputing_them(link):
    """The aggregate fit keeps every group's projection and block base between passes while the
    hyperparameters are fixed (``cache_entries`` large) or recomputes them in every pass (0): the
    same fit, with hyperparameter steps in between. If this fails, the cache serves projections
    of stale hyperparameters or of the wrong group."""
    from milgp.likelihoods import PoissonAggregateLikelihood
    from milgp.variational.aggregate_fit import fit_aggregate

    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 12, size=30).tolist()
    bag_index = bag_index_from_sizes(sizes)
    x = torch.as_tensor(rng.normal(size=(len(bag_index), 2)))
    y = torch.as_tensor(rng.poisson(2.0, size=len(sizes)).astype(np.float64))
    Z = x[:8].clone()
    runs = []
    for entries in (0, 10**9):
        model = SparseGP(Z.clone(), lengthscale=1.2, outputscale=0.5, constant_mean=True)
        res = fit_aggregate(model, PoissonAggregateLikelihood(link), BagBatch(x, bag_index, y), max_iter=6,
                            chunk_instances=40, block_budget=2_000, cache_entries=entries, lr=0.05)
        runs.append((res.elbo, model.variational_strategy.whitened_posterior().m))
    assert len(runs[0][0]) == 6
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-10)
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=1e-9, atol=1e-10)
