"""Instance links: p(y=1|f) moments under q(f) against Monte Carlo and exact values."""
import math

import pytest
import torch

from milgp.likelihoods.instance_link import LogisticLink, ProbitLink

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MEAN = torch.tensor([-3.0, -0.5, 0.0, 1.0, 4.0], dtype=torch.float64)
VAR = torch.tensor([0.01, 1.0, 4.0, 9.0, 0.5], dtype=torch.float64)


@pytest.mark.parametrize("link", [LogisticLink(), ProbitLink()], ids=["logistic", "probit"])
def test_moments_match_monte_carlo(link):
    """E[p(f)] and std[p(f)] (quadrature / Sheppard's formula) must agree with 1e6 Monte-Carlo draws
    within 5 standard errors; a wrong Gauss–Hermite node scaling or a wrong bivariate-normal
    integral fails here."""
    g = torch.Generator().manual_seed(0)
    p, s = link.moments(MEAN, VAR)
    f = MEAN + VAR.sqrt() * torch.randn(1_000_000, 5, generator=g, dtype=torch.float64)
    pf = link.prob(f)
    mc_p, mc_s = pf.mean(0), pf.std(0)
    assert ((p - mc_p).abs() <= 5 * mc_s / 1000.0 + 1e-12).all()
    se_s = ((pf - mc_p) ** 2).std(0) / (2 * mc_s * 1000.0)
    assert ((s - mc_s).abs() <= 5 * se_s + 1e-12).all()


def test_probit_mean_is_exact():
    """E[Φ(f)] = Φ(μ/sqrt(1+σ²)) exactly (Wang & Pinar 2021, §3.4)."""
    p, _ = ProbitLink().moments(MEAN, VAR)
    torch.testing.assert_close(p, torch.special.ndtr(MEAN / torch.sqrt(1 + VAR)), rtol=0, atol=1e-15)


@pytest.mark.parametrize("link", [LogisticLink(), ProbitLink()], ids=["logistic", "probit"])
def test_log_expected_negative_keeps_digits_for_confident_positives(link):
    """log E[p(y=0|f)] for an almost surely positive instance (μ = 30) must be finite and close to
    log p(y=0|μ); computing it as log(1 − E[p(y=1|f)]) would give −inf."""
    mean = torch.tensor([30.0, -30.0, 0.0], dtype=torch.float64)
    var = torch.tensor([1e-6, 1e-6, 1e-6], dtype=torch.float64)
    out = link.log_expected_negative(mean, var)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, link.log_prob_negative(mean), rtol=1e-4, atol=1e-6)
    assert out[1].item() == pytest.approx(0.0, abs=1e-12)
    assert out[2].item() == pytest.approx(math.log(0.5), abs=1e-5)


def test_logistic_probabilities_stay_in_zero_one_for_confident_instances():
    """|mean| up to 200: E[σ(f)] in [0, 1] and log E[σ(−f)] <= 0. If this fails, the Gauss–Hermite
    weights (which sum to 1 only up to rounding) gave E[σ(f)] = 1 + 2e-16 for a sure positive, or
    E[σ(−f)] > 1 for a sure negative, and the bag rules passed on a probability above 1 (or a
    noisy-OR below 0) that the metrics then refused."""
    mean = torch.tensor([-200.0, -100.0, -40.0, 40.0, 100.0, 200.0], dtype=torch.float64).repeat(3)
    var = torch.tensor([0.0, 1.0, 10.0], dtype=torch.float64).repeat_interleave(6)
    p, s = LogisticLink().moments(mean, var)
    assert ((p >= 0) & (p <= 1)).all()
    assert (s >= 0).all() and (s <= 1e-12).all()
    assert (LogisticLink().log_expected_negative(mean, var) <= 0).all()
