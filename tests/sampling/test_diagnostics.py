"""Split-R̂ and multi-chain ESS (:mod:`milgp.sampling.diagnostics`) on chains with known answers."""
import math

import pytest
import torch

from milgp.sampling.diagnostics import effective_sample_size, split_rhat


def ar1(C, S, phi, K=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    eps = torch.randn(C, S, K, dtype=torch.float64, generator=g)
    x = torch.empty_like(eps)
    x[:, 0] = eps[:, 0] / math.sqrt(1 - phi * phi)
    for t in range(1, S):
        x[:, t] = phi * x[:, t - 1] + eps[:, t]
    return x


def test_iid_chains_have_rhat_one_and_full_ess():
    """If this fails, R̂ flags well-mixed i.i.d. chains or ESS is far from the number of draws."""
    x = ar1(4, 1000, 0.0, K=20)
    assert (split_rhat(x) < 1.01).all()
    ess = effective_sample_size(x)
    assert ((ess > 3000) & (ess < 5500)).all(), ess


def test_ar1_ess_matches_theory():
    """If this fails, the autocorrelation/Geyer truncation is wrong: for AR(1) with φ = 0.9 the ESS is
    C·S·(1 − φ)/(1 + φ) (within 25%, averaged over 20 replicate quantities)."""
    x = ar1(4, 4000, 0.9, K=20, seed=1)
    expected = 4 * 4000 * 0.1 / 1.9
    ess = effective_sample_size(x)
    assert abs(float(ess.mean()) / expected - 1) < 0.25, (float(ess.mean()), expected)


def test_rhat_detects_chains_stuck_in_different_places_and_trends():
    """If this fails, R̂ cannot tell non-converged chains (different means, or a within-chain
    trend that only the split catches) from converged ones."""
    x = ar1(4, 500, 0.5, seed=2)
    x[0] += 3.0
    assert float(split_rhat(x)) > 1.1
    trend = torch.linspace(0, 5, 500, dtype=torch.float64).expand(4, 500).unsqueeze(-1) + ar1(4, 500, 0.0, seed=3)
    assert float(split_rhat(trend)) > 1.1


def test_constant_and_bad_shapes():
    """If this fails, constant quantities give NaN diagnostics or malformed input is accepted."""
    x = torch.ones(2, 50, 3, dtype=torch.float64)
    assert torch.equal(split_rhat(x), torch.ones(3, dtype=torch.float64))
    assert torch.isfinite(effective_sample_size(x)).all()
    with pytest.raises(ValueError):
        split_rhat(torch.ones(10))
