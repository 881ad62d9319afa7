"""Stable truncated-normal moments, log-normaliser pieces and exact samplers
(:mod:`milgp.likelihoods.truncated_normal`), against mpmath (50 digits) and scipy."""
import math

import mpmath as mp
import numpy as np
import pytest
import torch
from scipy import stats

from milgp.likelihoods.truncated_normal import (
    log_expm1_ratio,
    log_hazard,
    log_neg_log_ndtr,
    mean_above_zero,
    mean_below_zero,
    sample_above,
    sample_truncated,
    var_above_zero,
    var_below_zero,
)

mp.mp.dps = 60


pytestmark = pytest.mark.usefixtures("single_torch_thread")
GRID = np.concatenate([np.linspace(-30, 30, 241), [-35.0, 35.0, 2.999, 3.0, 3.001, 1e-8, -1e-8]])


def _ref_moments(mu: float) -> tuple[float, float]:
    m = mp.mpf(mu)
    h = mp.npdf(m) / mp.ncdf(-m)
    return float(m - h), float(1 - h * (h - m))


def test_moments_match_mpmath_over_the_whole_range():
    """If this fails, E[m] or Var[m] of N(μ,1) truncated to (−∞,0) loses precision somewhere in
    μ ∈ [−35, 35] (cancellation in μ − φ/Φ or 1 − h(h − μ)), which would bias the natural step."""
    mu = torch.tensor(GRID, dtype=torch.float64)
    mean, var = mean_below_zero(mu), var_below_zero(mu)
    ref = np.array([_ref_moments(float(x)) for x in GRID])
    np.testing.assert_allclose(mean.numpy(), ref[:, 0], rtol=1e-12, atol=0)
    np.testing.assert_allclose(var.numpy(), ref[:, 1], rtol=1e-11, atol=0)
    # the mirrored (0, ∞) versions
    np.testing.assert_allclose(mean_above_zero(-mu).numpy(), -ref[:, 0], rtol=1e-12)
    np.testing.assert_allclose(var_above_zero(-mu).numpy(), ref[:, 1], rtol=1e-11)


def test_moments_match_scipy_truncnorm():
    """If this fails, the moments disagree with scipy's truncnorm where scipy is reliable (|μ| ≤ 8)."""
    mu = np.linspace(-8, 8, 81)
    m_ref, v_ref = stats.truncnorm.stats(-np.inf, -mu, loc=mu, scale=1.0, moments="mv")
    t = torch.tensor(mu, dtype=torch.float64)
    np.testing.assert_allclose(mean_below_zero(t).numpy(), m_ref, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(var_below_zero(t).numpy(), v_ref, rtol=1e-8, atol=1e-12)


def test_log_hazard_and_log_neg_log_ndtr_match_mpmath():
    """If this fails, log φ/Φ or log(−log Φ) (the pieces of the positive-bag normaliser) overflow,
    underflow or cancel for some |x| ≤ 40."""
    xs = np.linspace(-40, 40, 321)
    t = torch.tensor(xs, dtype=torch.float64)
    lh, lnl = log_hazard(t).numpy(), log_neg_log_ndtr(t).numpy()
    for x, a, b in zip(xs, lh, lnl):
        xm = mp.mpf(x)
        ra = mp.log(mp.npdf(xm) / mp.ncdf(-xm))
        rb = mp.log(-mp.log1p(-mp.ncdf(-xm))) if x > 0 else mp.log(-mp.log(mp.ncdf(xm)))
        assert math.isfinite(a) and math.isfinite(b)
        assert abs(a - float(ra)) <= 1e-13 * max(1.0, abs(float(ra)))
        assert abs(b - float(rb)) <= 1e-13 * max(1.0, abs(float(rb)))


def test_log_pieces_reuse_a_given_log_cdf_exactly_and_keep_gradients_finite():
    """If this fails, ``log_hazard(x, log Φ(−x))`` or ``log_neg_log_ndtr(x, log Φ(x))`` (the forms the
    probit normaliser and E[m] share one ``log_ndtr`` through) read the given values where the
    other branch applies, so they differ from the functions computing it themselves, or the unused
    branch (``log Φ(x) = 0`` far right) leaks a NaN gradient."""
    for dtype in (torch.float64, torch.float32):
        x = torch.tensor(np.concatenate([GRID, [-300.0, 300.0]]), dtype=dtype, requires_grad=True)
        assert torch.equal(log_hazard(x, torch.special.log_ndtr(-x)), log_hazard(x))
        given = log_neg_log_ndtr(x, torch.special.log_ndtr(x))
        assert torch.equal(given, log_neg_log_ndtr(x))
        (grad,) = torch.autograd.grad(given.sum() + log_hazard(x, torch.special.log_ndtr(-x)).sum(), x)
        assert torch.isfinite(grad).all()


def test_float32_is_finite_and_agrees_with_float64():
    """If this fails, a float32 model (``dtype="float32"``) gets NaN/inf or loses more than float32
    precision in the truncated-normal pieces for some μ ∈ [−30, 30]. In particular
    log(−log Φ(x)) used ``exp(log q).clamp_min(1e-300)``, which underflows to 0 in float32 for
    x ≳ 14 and made ``−log1p(−q)/q`` = 0/0 (NaN for every positive bag with an instance ν ≤ −14).
    The reference is float64 at the *same* (float32-rounded) inputs, so only the arithmetic differs.
    """
    mu32 = torch.cat([torch.linspace(-30, 30, 2401), torch.tensor([-40.0, 14.0, 20.0, 30.0, 40.0, 2.0, 3.0])])
    mu64 = mu32.double()
    cases = [
        (mean_below_zero, 4e-6),
        (mean_above_zero, 4e-6),
        (var_below_zero, 3e-5),  # 1 − h(h − μ) loses a few bits just below the continued-fraction switch
        (var_above_zero, 3e-5),
        (log_hazard, 2e-6),
        (log_neg_log_ndtr, 2e-6),
    ]
    for fn, tol in cases:
        got = fn(mu32)
        assert got.dtype == torch.float32
        assert torch.isfinite(got).all(), (fn.__name__, mu32[~torch.isfinite(got)])
        ref = fn(mu64)
        err = (got.double() - ref).abs() / ref.abs().clamp_min(1.0 if fn in (log_hazard, log_neg_log_ndtr) else 0.0)
        assert float(err.max()) <= tol, (fn.__name__, float(err.max()), float(mu64[err.argmax()]))
    # the variances stay strictly inside (0, 1]
    v = var_below_zero(mu32)
    assert ((v > 0) & (v <= 1)).all()
    # the audit's reproducer: q = Φ(−x) underflows float32 for x ≳ 14; the answer is then log q
    x = torch.tensor([20.0, 30.0, 40.0])
    np.testing.assert_allclose(
        log_neg_log_ndtr(x).double().numpy(), torch.special.log_ndtr(-x.double()).numpy(), rtol=1e-6
    )


def test_expm1_ratio():
    """If this fails, log(expm1(s)/s) is inaccurate near 0 or far from it, i.e. the positive-bag
    normaliser is wrong when Π Φ(−μ) ≈ 1 or ≈ 0."""
    ss = torch.tensor([-1e-12, -1e-6, -9.9e-6, -1.1e-5, -0.3, -5.0, -700.0], dtype=torch.float64)
    ref = [float(mp.log(mp.expm1(mp.mpf(float(s))) / mp.mpf(float(s)))) for s in ss]
    np.testing.assert_allclose(log_expm1_ratio(ss).numpy(), ref, rtol=1e-13, atol=1e-18)


@pytest.mark.parametrize("a", [-30.0, -2.0, 0.0, 1.5, 5.0, 7.9, 8.5, 30.0])
def test_sampler_matches_truncnorm(a):
    """If this fails, the truncated-normal sampler used by the Gibbs sampler is not exact (KS test
    against scipy's truncnorm CDF, p > 1e-4) or escapes its support / returns inf in the tail."""
    gen = torch.Generator().manual_seed(int(abs(a) * 10) + 1)
    z = sample_above(torch.full((20000,), a, dtype=torch.float64), generator=gen).numpy()
    assert np.isfinite(z).all() and (z >= a).all()
    p = stats.kstest(z, stats.truncnorm(a, np.inf).cdf).pvalue
    assert p > 1e-4, p


def test_sampler_far_tail_and_two_sided_wrapper():
    """If this fails, far-tail draws (a = 1e3) are not finite or not ≈ a + 1/a, or
    sample_truncated puts draws on the wrong side of 0 / with the wrong mean for std ≠ 1."""
    gen = torch.Generator().manual_seed(0)
    z = sample_above(torch.full((5000,), 1e3, dtype=torch.float64), generator=gen)
    assert torch.isfinite(z).all() and (z >= 1e3).all()
    assert abs(float(z.mean()) - (1e3 + 1e-3)) < 1e-4
    mean = torch.tensor([3.0, -3.0, 40.0, -40.0], dtype=torch.float64).repeat(20000)
    lower = torch.tensor([True, False, False, True]).repeat(20000)
    std = torch.full_like(mean, 2.0)
    m = sample_truncated(mean, std, lower, generator=gen).reshape(20000, 4)
    assert (m[:, 0] > 0).all() and (m[:, 1] < 0).all() and (m[:, 2] < 0).all() and (m[:, 3] > 0).all()
    # E[m | m > 0] for N(3, 4): 3 + 2·h(−1.5)
    ref = 3 + 2 * float(mean_above_zero(torch.tensor(1.5, dtype=torch.float64)) - 1.5)
    assert abs(float(m[:, 0].mean()) - ref) < 5 * 2 / math.sqrt(20000)
    # far side: N(40, 4) truncated below 0 -> about −2·(1/20)
    assert abs(float(m[:, 2].mean()) - 2 * float(mean_below_zero(torch.tensor(20.0, dtype=torch.float64)))) < 5e-3


def test_some_positive_draws_are_the_exact_conditional():
    """The joint draw of a positive bag's latents in the probit Gibbs sampler: independent normals
    conditioned on at least one positive per segment. Against the closed forms
    ``P(m_i > 0 | A) = Φ(z_i)/Z`` and ``E[m_i | A] = (μ_i − E[m_i 1{m_i<0}] Π_{j≠i} Φ(−z_j))/Z``,
    ``Z = 1 − Π_j Φ(−z_j)``, on segments of 3, 1 and 5 entries (200,000 draws; MC error ≲ 0.003 on
    the probabilities, ≲ 0.01 on the means). A wrong first-positive weight or a swapped truncation
    moves them by more than 0.05."""
    norm = stats.norm

    from milgp.likelihoods.truncated_normal import sample_some_positive

    mu = torch.tensor([-1.0, -0.5, -2.0, 0.3, -3.0, -1.0, 0.0, -0.2, -1.5], dtype=torch.float64)
    sd = torch.tensor([1.0, 2.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.5, 0.7], dtype=torch.float64)
    segment = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2, 2])
    m = sample_some_positive(mu.expand(200_000, -1), sd, segment, 3, generator=torch.Generator().manual_seed(0)).numpy()
    for b in range(3):
        idx = np.flatnonzero(segment.numpy() == b)
        assert (m[:, idx] > 0).any(1).all()
        mi, si = mu[idx].numpy(), sd[idx].numpy()
        below = norm.cdf(-mi / si)
        Z = 1 - np.prod(below)
        np.testing.assert_allclose((m[:, idx] > 0).mean(0), norm.cdf(mi / si) / Z, atol=0.004)
        part = mi * below - si * norm.pdf(mi / si)  # E[m_i 1{m_i < 0}]
        exact = [(mi[i] - part[i] * np.prod(np.delete(below, i))) / Z for i in range(len(idx))]
        np.testing.assert_allclose(m[:, idx].mean(0), exact, atol=0.015)
