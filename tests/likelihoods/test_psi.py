"""GSM densities ψ: θ(c) = −ψ'(c)/(cψ(c)) and normalisation (Castro-Macías et al., *Hyperbolic
secant representation of the logistic function*, 2024, Eqs. 14, 28, 37)."""
import math

import numpy as np
import pytest
import torch
from scipy import integrate

from milgp.likelihoods.psi import GammaPsi, HyperbolicSecantPsi

PSIS = [HyperbolicSecantPsi(), GammaPsi(1.0, 4.0), GammaPsi(0.75, 2.5), GammaPsi(0.5001 + 0.5, 1.0)]


@pytest.mark.parametrize("psi", PSIS, ids=repr)
def test_theta_matches_autograd_of_log_psi(psi):
    """θ must equal −(d/dc log ψ)(c)/c; otherwise the Θ matrix of Eq. 28 (and every S update)
    uses the wrong curvature for this ψ."""
    c = torch.tensor(np.logspace(-6, math.log10(50), 400), dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(psi.log_psi(c).sum(), c)
    expected = -grad / c
    torch.testing.assert_close(psi.theta(c.detach()), expected.detach(), rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("psi", PSIS, ids=repr)
def test_theta_matches_central_differences(psi):
    """Independent of autograd: central differences of log ψ; a mismatch means θ and log ψ
    describe different densities."""
    c = np.linspace(0.05, 50, 200)
    h = 1e-5
    f = lambda x: psi.log_psi(torch.tensor(x, dtype=torch.float64)).numpy()  # noqa: E731
    deriv = (f(c + h) - f(c - h)) / (2 * h)
    np.testing.assert_allclose(psi.theta(torch.tensor(c)).numpy(), -deriv / c, rtol=1e-6, atol=1e-10)


def test_theta_pg_limit_and_series_continuity():
    """θ_PG(0) must be 1/4 (the PG(1,0) mean) and the small-c series must join the closed form
    without a jump at the switch point; a gap would make S jump as c crosses 1e-3."""
    psi = HyperbolicSecantPsi()
    zero = torch.zeros(1, dtype=torch.float64)
    assert psi.theta(zero).item() == 0.25
    assert psi.theta(-zero).item() == 0.25
    for switch in (1e-3,):
        below = torch.tensor([switch * (1 - 1e-9)], dtype=torch.float64)
        above = torch.tensor([switch * (1 + 1e-9)], dtype=torch.float64)
        assert abs(psi.theta(below).item() - psi.theta(above).item()) < 1e-14
    c = torch.tensor(np.logspace(-8, -3.0001, 50), dtype=torch.float64)
    exact = torch.tanh(c / 2) / (2 * c)
    torch.testing.assert_close(psi.theta(c), exact, rtol=1e-12, atol=0)
    # symmetric in c
    torch.testing.assert_close(psi.theta(-c), psi.theta(c))


def test_theta_gamma_closed_form_and_not_clipped():
    """G-VGPMIL: θ = α/(β + c²/2) exactly for all c (c is never clipped: θ is finite at c = 0)."""
    psi = GammaPsi(1.0, 4.0)
    c = torch.tensor([0.0, 1e-8, 1.0, 10.0, 1e4], dtype=torch.float64)
    torch.testing.assert_close(psi.theta(c), 1.0 / (4.0 + c * c / 2), rtol=1e-15, atol=0)
    assert psi.theta(torch.zeros(1, dtype=torch.float64)).item() == 0.25


@pytest.mark.parametrize(
    "psi", [HyperbolicSecantPsi(), GammaPsi(1.0, 4.0), GammaPsi(0.75, 2.5), GammaPsi(1.0, 1.0)], ids=repr
)
def test_log_psi_is_a_normalised_density(psi):
    """exp(log ψ) must integrate to 1 over ℝ; otherwise log Z(α, β) (Eq. 37) or the −log 2π
    of the hyperbolic secant is wrong and ELBO values are shifted."""
    f = lambda x: math.exp(psi.log_psi(torch.tensor(x, dtype=torch.float64)).item())  # noqa: E731
    total = 0.0
    for a, b in [(-np.inf, -100), (-100, 0), (0, 100), (100, np.inf)]:
        val, _ = integrate.quad(f, a, b, limit=500, epsabs=1e-12, epsrel=1e-10)
        total += val
    assert total == pytest.approx(1.0, abs=1e-7)


def test_log_psi_stable_for_large_arguments():
    """log φ(x) must stay finite and ≈ −|x|/2 − log π for large |x| (no cosh overflow)."""
    psi = HyperbolicSecantPsi()
    x = torch.tensor([-1e4, 1e4, 800.0], dtype=torch.float64)
    out = psi.log_psi(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, -x.abs() / 2 - math.log(math.pi), rtol=1e-12, atol=1e-9)


def test_gamma_psi_rejects_bad_parameters():
    """α ≤ ½ has no normaliser; β ≤ 0 is not a density: both must raise, naming the parameter."""
    with pytest.raises(ValueError, match="alpha"):
        GammaPsi(0.5, 1.0)
    with pytest.raises(ValueError, match="beta"):
        GammaPsi(1.0, 0.0)
