"""Collapsed Gibbs sampler for MIL-GP-Probit (:mod:`milgp.sampling.probit_gibbs`), checked against
closed-form VI, against the paper's own (unwhitened numpy) CAVI and against known truncated-normal
answers."""
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from milgp.data.bags import BagBatch, Bags, segment_max
from milgp.likelihoods import MILProbitLikelihood
from milgp.models.sparse_gp import SparseGP
from milgp.sampling import sample_probit_posterior
from milgp.sampling.probit_gibbs import ProbitGibbsResult
from milgp.variational.fit import fit_closed_form

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "likelihoods"))
from test_mil_probit import make_problem, reference_cavi  # noqa: E402


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def fitted():
    batch, _ = make_problem(B=30, n=5, seed=0)
    model = SparseGP(batch.x.clone(), lengthscale=1.0, outputscale=0.5)  # Z = X: K̃ ≈ 0, FITC = full GP
    lik = MILProbitLikelihood()
    fit_closed_form(model, lik, batch, max_iter=1000, tol=0, learn_hyperparameters=False)
    gibbs = sample_probit_posterior(
        model, batch, num_samples=1500, burn_in=300, num_chains=4, init=model.variational_strategy.whitened_posterior(), seed=0
    )
    return batch, model, lik, gibbs


def test_gibbs_agrees_with_vi_and_with_the_reference(fitted):
    """If this fails, the sampler (Eqs. 26–28) and the VI (Eqs. 17–24) disagree about the
    posterior: instance predictions by more than 0.05 (max) / 0.015 (mean) or latent means by more
    than 0.2. Why these tolerances: with Z = X (K̃ ≈ 0) both target the same model; the remaining
    differences are the Monte-Carlo error of the Gibbs means (ESS ≳ 300, posterior sd of f ≲ 0.7
    ⇒ ≲ 0.04 per mean) plus the mean-field bias of VI (q(u)q(m) ignores the u–m coupling, measured
    ≈ 0.09 max on f / 0.023 max on probabilities for this problem). A sign or variance error in
    either path moves the means by O(1)."""
    batch, model, lik, gibbs = fitted
    summary = gibbs.summary()
    assert summary["max_rhat"] < 1.1 and summary["min_ess"] > 100, summary
    mean_vi, var_vi = model.variational_strategy.predict_marginals(batch.x)
    p_vi = lik.instance_link.moments(mean_vi, var_vi)[0]
    mean_g = gibbs.latent_mean(model, batch.x)
    p_g = gibbs.instance_probability(model, batch.x)[0]
    assert float((mean_vi - mean_g).abs().max()) < 0.2
    assert float((p_vi - p_g).abs().max()) < 0.05
    assert float((p_vi - p_g).abs().mean()) < 0.015
    ref_mean, ref_var = reference_cavi(
        batch.x.numpy(), batch.bag_index.numpy(), batch.bag_labels.numpy(), batch.x.numpy(), 0.5, 1.0, model.variational_strategy.jitter
    )
    assert float(np.abs(mean_g.numpy() - ref_mean).max()) < 0.2
    np.testing.assert_allclose(mean_vi.numpy(), ref_mean, atol=1e-5)


def test_state_respects_the_bag_constraints_and_predictions_are_sane(fitted):
    """If this fails, the sampler leaves the support (a negative bag with some m > 0, a positive bag
    with all m < 0) or its bag/instance predictions are not probabilities."""
    batch, model, lik, gibbs = fitted
    m = gibbs.m_last
    for c in range(m.shape[0]):
        top = segment_max(m[c], batch.bag_index, batch.num_bags)
        assert ((top > 0) == batch.bag_labels.bool()).all()
    p_bag, se = gibbs.bag_probability(model, batch.x, batch.bags)
    assert ((p_bag >= 0) & (p_bag <= 1)).all() and torch.isfinite(se).all()
    # training bags: the posterior ranks them well (a weak prior, outputscale 0.5, keeps p moderate)
    from sklearn.metrics import roc_auc_score

    assert roc_auc_score(batch.bag_labels.numpy(), p_bag.numpy()) > 0.85
    p, s = gibbs.instance_probability(model, batch.x)
    assert ((p >= 0) & (p <= 1) & (s >= 0)).all()


def test_fitc_variance_is_one_plus_residual():
    """If this fails, m_n | u uses variance 1 instead of 1 + K̃_nn (with f integrated out under the
    FITC approximation the conditional variance is 1 + K̃_nn; Wang & Pinar 2021): an instance far
    from the only inducing point in a negative bag must have E[m] = −sqrt(1 + k)·φ(0)/Φ(0)."""
    x = torch.zeros(1, 1, dtype=torch.float64)
    model = SparseGP(torch.tensor([[20.0]], dtype=torch.float64), lengthscale=1.0, outputscale=4.0)
    batch = BagBatch(x, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.float64))
    g = sample_probit_posterior(model, batch, num_samples=4, burn_in=20, num_chains=3000, seed=1)
    expected = -math.sqrt(5.0) * math.sqrt(2 / math.pi)
    se = math.sqrt(5.0 * (1 - 2 / math.pi) / 3000)
    assert abs(float(g.m_last.mean()) - expected) < 5 * se
    # a positive bag of one: truncated to (0, ∞)
    batch = BagBatch(x, torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.float64))
    g = sample_probit_posterior(model, batch, num_samples=4, burn_in=20, num_chains=3000, seed=2)
    assert (g.m_last > 0).all() and abs(float(g.m_last.mean()) + expected) < 5 * se


def test_bad_arguments():
    """If this fails, nonsensical sampler settings are silently accepted."""
    batch, _ = make_problem(B=4, n=2)
    model = SparseGP(batch.x[:3].clone())
    with pytest.raises(ValueError):
        sample_probit_posterior(model, batch, num_samples=2)
    with pytest.raises(ValueError):
        sample_probit_posterior(model, batch, thin=0)


def test_chunked_predictions_equal_unchunked_and_respect_the_memory_bound(fitted, monkeypatch):
    """If this fails, the memory-bounded Gibbs predictions (chunks over instances and draws) differ
    from the one-shot computation beyond rounding, or a block exceeds ``max_elements`` entries —
    i.e. predicting 2,000 instances with 4,000 draws would again build (C·S, N, 32) tensors (≈ 7 GB)."""
    import milgp.sampling.probit_gibbs as pg
    from milgp.likelihoods.instance_link import ProbitLink

    batch, model, _, gibbs = fitted
    x, bi, B = batch.x, batch.bag_index, batch.num_bags
    big = 10**12  # one block: the unchunked computation
    ref_mean = gibbs.latent_mean(model, x, max_elements=big)
    ref_p, ref_s = gibbs.instance_probability(model, x, max_elements=big)
    ref_bag, ref_se = gibbs.bag_probability(model, x, Bags(bi, B), max_elements=big)
    S = gibbs.draws.shape[0]

    seen = []
    orig_ipp, orig_seg = ProbitLink.moments, pg.segment_sum

    def ipp(self, mean, var, num_points=32):
        seen.append(mean.numel() * num_points)
        return orig_ipp(self, mean, var, num_points)

    def seg(values, index, num_bags):
        seen.append(values.numel())
        return orig_seg(values, index, num_bags)

    monkeypatch.setattr(ProbitLink, "moments", ipp)
    monkeypatch.setattr(pg, "segment_sum", seg)
    # instance chunks only (7 instances of S·32 nodes), then instance and draw chunks
    for budget, xs in ((S * 32 * 7, x), (4096, x[:40])):
        seen.clear()
        n = xs.shape[0]
        torch.testing.assert_close(gibbs.latent_mean(model, xs, max_elements=budget), ref_mean[:n], rtol=1e-12, atol=1e-13)
        p, s = gibbs.instance_probability(model, xs, max_elements=budget)
        torch.testing.assert_close(p, ref_p[:n], rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(s, ref_s[:n], rtol=1e-10, atol=1e-12)
        assert max(seen) <= budget, (max(seen), budget)
    for budget in (S * 12, 1000):  # groups of ~2 bags; one bag per group with draw chunks
        seen.clear()
        p_bag, se = gibbs.bag_probability(model, x, Bags(bi, B), max_elements=budget)
        torch.testing.assert_close(p_bag, ref_bag, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(se, ref_se, rtol=1e-10, atol=1e-13)
        assert max(seen) <= budget, (max(seen), budget)


def test_bag_standard_error_accounts_for_autocorrelation():
    """If this fails, the Gibbs bag-probability standard error treats correlated draws as independent
    (sd/sqrt(C·S) instead of sd/sqrt(ESS)). Synthetic AR(1) draws (ρ = 0.9, so ESS ≈ C·S/19):
    across 150 independent replicate runs the spread of the estimate must match the mean reported
    SE (ratio in [0.75, 1.33]); the i.i.d. formula would be ≈ 0.23 of it."""
    from milgp.sampling.diagnostics import effective_sample_size
    from milgp.sampling.probit_gibbs import ProbitGibbsResult

    torch.manual_seed(0)
    model = SparseGP(torch.tensor([[-1.0], [0.0], [1.0]], dtype=torch.float64), lengthscale=1.0, outputscale=1.0)
    x = torch.tensor([[-0.8], [0.1], [0.5], [0.9]], dtype=torch.float64)
    bi = torch.tensor([0, 0, 1, 1])
    g = torch.Generator().manual_seed(3)
    R, C, S, M, rho = 150, 2, 400, 3, 0.9
    v = torch.empty(R, C, S, M, dtype=torch.float64)
    v[:, :, 0] = torch.randn(R, C, M, dtype=torch.float64, generator=g)
    for t in range(1, S):
        v[:, :, t] = rho * v[:, :, t - 1] + math.sqrt(1 - rho**2) * torch.randn(R, C, M, dtype=torch.float64, generator=g)
    ps, ses = [], []
    for r in range(R):
        res = ProbitGibbsResult(v=v[r], m_last=torch.zeros(C, 4), rhat=torch.ones(1), ess=torch.ones(1), monitored=torch.zeros(1))
        p, se = res.bag_probability(model, x, Bags(bi, 2))
        ps.append(p)
        ses.append(se)
        if r == 0:  # the formula itself
            per = res.bag_probability_draws(model, x, Bags(bi, 2))
            expected = per.reshape(-1, 2).std(0) / effective_sample_size(per).sqrt()
            torch.testing.assert_close(se, expected)
            assert (se > 3 * per.reshape(-1, 2).std(0) / math.sqrt(C * S)).all()
    ratio = torch.stack(ps).std(0) / torch.stack(ses).mean(0)
    assert ((ratio > 0.75) & (ratio < 1.33)).all(), ratio


def test_chains_start_over_dispersed_and_reproducibly(fitted):
    """If this fails, the chains start inside VI's q(v) (so split-R̂ cannot expose non-convergence),
    the inflation factor is not the documented covariance multiplier, or a seed does not reproduce
    a run."""
    batch, model, _, _ = fitted
    q = model.variational_strategy.whitened_posterior()
    C = 3000
    res = sample_probit_posterior(model, batch, num_samples=4, burn_in=0, num_chains=C, init=q, seed=5)
    assert res.settings["init_dispersion"] == 4.0
    d = res.v_start - q.m
    cov = d.mT @ d / C
    # per-direction variance along q's eigenvectors: 4 × q's (sampling error ≈ sqrt(2/C) ≈ 2.6 %)
    evals, evecs = torch.linalg.eigh(q.S)
    ratio = torch.diagonal(evecs.mT @ cov @ evecs) / evals
    assert float((ratio - 4.0).abs().max()) < 0.5, ratio
    again = sample_probit_posterior(model, batch, num_samples=4, burn_in=0, num_chains=C, init=q, seed=5)
    assert torch.equal(res.v, again.v) and torch.equal(res.v_start, again.v_start)
    one = sample_probit_posterior(model, batch, num_samples=4, burn_in=0, num_chains=C, init=q, seed=5, init_dispersion=1.0)
    torch.testing.assert_close(one.v_start - q.m, (res.v_start - q.m) / 2.0)
    with pytest.raises(ValueError, match="init_dispersion"):
        sample_probit_posterior(model, batch, num_samples=4, init=q, init_dispersion=0.5)


def test_convergence_problem_names_what_is_short_and_nothing_when_all_is_well():
    """If this failed, chains that have plainly not mixed (split-R̂ 1.2, a latent mean with 20
    effective draws) would pass as a reference, or well-mixed ones would be flagged."""
    def result(rhat, ess):
        return ProbitGibbsResult(v=torch.zeros(4, 250, 3), m_last=torch.zeros(4, 5), rhat=torch.tensor(rhat), ess=torch.tensor(ess), monitored=torch.arange(3))
    assert result([1.001, 1.02, 1.049], [900.0, 400.0, 101.0]).convergence_problem() is None
    assert result([1.0, 1.2, 1.0], [900.0, 400.0, 300.0]).convergence_problem() == "max split-R̂ 1.200 > 1.05 over 3 monitored latent means (4 chains × 250 draws)"
    assert result([1.0, 1.0, 1.0], [20.0, 400.0, 300.0]).convergence_problem() == "min ESS 20 < 100 over 3 monitored latent means (4 chains × 250 draws)"
    both = result([1.3, 1.0, 1.0], [20.0, 400.0, 300.0]).convergence_problem()
    assert both.startswith("max split-R̂ 1.300 > 1.05 and min ESS 20 < 100")
    assert result([1.3, 1.0, 1.0], [20.0, 400.0, 300.0]).convergence_problem(rhat_limit=2.0, ess_limit=10.0) is None
