"""InstanceCalibrator: the isotonic map from an averaged instance score to the MIL fits' probability."""
import numpy as np
import pytest
import torch

from milgp.prediction import InstanceCalibrator


def pool_adjacent_violators(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Independent float64 reference: the non-decreasing least-squares fit of ``y`` on ``x``
    (ties in ``x`` pooled first), at the sorted unique ``x``."""
    xs, inverse = np.unique(x, return_inverse=True)
    sums, counts = np.bincount(inverse, y), np.bincount(inverse).astype(float)
    blocks = []  # [sum, count, number of unique x]
    for s, c in zip(sums, counts):
        blocks.append([s, c, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s2, c2, k2 = blocks.pop()
            blocks[-1] = [blocks[-1][0] + s2, blocks[-1][1] + c2, blocks[-1][2] + k2]
    return np.concatenate([np.full(k, s / c) for s, c, k in blocks])


def test_map_is_the_isotonic_least_squares_fit():
    """At the training scores the map must equal the pool-adjacent-violators fit (a wrong fit would
    not be E[target | score]) and be non-decreasing everywhere, constant beyond the scores' range."""
    rng = np.random.default_rng(0)
    s = rng.random(400).round(2)  # ties included
    t = np.clip(s**2 + rng.normal(0, 0.15, 400), 0, 1)
    cal = InstanceCalibrator().fit(torch.tensor(s), torch.tensor(t))
    xs = np.unique(s)
    np.testing.assert_allclose(cal.transform(torch.tensor(xs)).numpy(), pool_adjacent_violators(s, t), atol=1e-12)
    grid = torch.linspace(-0.5, 1.5, 2001, dtype=torch.float64)
    out = cal.transform(grid)
    assert (out.diff() >= -1e-15).all()
    assert out[0] == cal.transform(torch.tensor([xs[0]], dtype=torch.float64))[0]
    assert out[-1] == cal.transform(torch.tensor([xs[-1]], dtype=torch.float64))[0]


def test_increasing_target_is_a_fixed_point_and_std_passes_through_the_identity():
    """A target that is already an increasing function of the score must be reproduced exactly;
    with target = score the map is the identity, so a std inside [0, 1] must come back unchanged
    (the std is carried as (p̃(s+σ) − p̃(s−σ))/2)."""
    s = torch.linspace(0.0, 1.0, 101, dtype=torch.float64)
    cal = InstanceCalibrator().fit(s, s.sqrt())
    torch.testing.assert_close(cal.transform(s), s.sqrt(), rtol=0, atol=1e-12)
    ident = InstanceCalibrator().fit(s, s)
    p, sd = torch.tensor([0.3, 0.5, 0.8], dtype=torch.float64), torch.tensor([0.1, 0.2, 0.05], dtype=torch.float64)
    p2, sd2 = ident(p, sd)
    torch.testing.assert_close(p2, p, rtol=0, atol=1e-12)
    torch.testing.assert_close(sd2, sd, rtol=0, atol=1e-12)


def test_float32_scores_with_knots_that_coincide_after_rounding():
    """Knots 1e-9 apart in float64 are one value in float32: the map must still return finite,
    non-decreasing probabilities for float32 scores (a 0/0 there gave NaN)."""
    s = torch.tensor([0.3, 0.3 + 1e-9, 0.6, 0.9, 0.9 + 1e-9], dtype=torch.float64)
    cal = InstanceCalibrator().fit(s, torch.tensor([0.1, 0.2, 0.5, 0.7, 0.8], dtype=torch.float64))
    out = cal.transform(torch.tensor([0.2, 0.3, 0.45, 0.9, 0.95], dtype=torch.float32))
    assert out.dtype == torch.float32 and torch.isfinite(out).all() and (out.diff() >= 0).all()


def test_constant_target_and_bad_input():
    """A constant target gives a constant map (one knot); mismatched inputs are refused in one line."""
    cal = InstanceCalibrator().fit(torch.rand(50, dtype=torch.float64), torch.full((50,), 0.2, dtype=torch.float64))
    torch.testing.assert_close(cal.transform(torch.tensor([0.0, 0.5, 1.0])), torch.full((3,), 0.2))
    with pytest.raises(ValueError, match="equal-length"):
        InstanceCalibrator().fit(torch.rand(5), torch.rand(4))


def test_a_negative_or_nan_std_is_refused_by_instance():
    """A std of −0.3 (or NaN) for instance 1: one line naming it. If this fails, the carried std
    ``(p̃(s + σ) − p̃(s − σ)) / 2`` came out negative (or NaN) and was returned as a std."""
    cal = InstanceCalibrator().fit(torch.tensor([0.1, 0.2, 0.3, 0.9], dtype=torch.float64),
                                   torch.tensor([0.0, 0.5, 0.5, 1.0], dtype=torch.float64))
    score = torch.tensor([0.5, 0.5], dtype=torch.float64)
    for bad in (-0.3, float("nan")):
        with pytest.raises(ValueError, match=r"^instance 1 has std .*; a standard deviation must be >= 0"):
            cal(score, torch.tensor([0.1, bad], dtype=torch.float64))


def test_std_is_at_most_the_largest_std_of_a_probability():
    """A probability with mean p has std at most sqrt(p(1 − p)). The map 0 up to score 0.2, 1 from
    0.8, linear between: a score 0.25 ± 0.6 maps to p̃ = 1/12 while its half spread
    (p̃(0.85) − p̃(0)) / 2 is 0.5, above sqrt(p̃(1 − p̃)) ≈ 0.276. If this fails, the half spread was
    returned uncapped (G-VGPMIL on notebook 01's digits bags showed p = 0.11 ± 0.40). A std within the
    bound must come back as the half spread, unchanged."""
    cal = InstanceCalibrator().fit(torch.tensor([0.1, 0.2, 0.8, 0.9], dtype=torch.float64),
                                   torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=torch.float64))
    p, sd = cal(torch.tensor([0.25, 0.5], dtype=torch.float64), torch.tensor([0.6, 0.05], dtype=torch.float64))
    torch.testing.assert_close(p, torch.tensor([1 / 12, 0.5], dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(sd, torch.tensor([(1 / 12 * 11 / 12) ** 0.5, 0.05 / 0.6], dtype=torch.float64), rtol=0, atol=1e-12)
    rng = np.random.default_rng(0)
    score, std = torch.tensor(rng.random(2000)), torch.tensor(rng.random(2000) * 0.5)
    p, sd = cal(score, std)
    assert (sd <= (p * (1 - p)).sqrt() + 1e-15).all() and (sd >= 0).all()
