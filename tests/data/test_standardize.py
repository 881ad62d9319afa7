"""The standardisation scale: constant features get an infinite scale (they standardise to 0).

If these fail, a feature that never varied in training gets a finite, arbitrary scale, and a value
it takes only at prediction moves the kernel's distances in raw units."""
import torch

from milgp.data.standardize import standardization_scale


def test_constant_features_get_an_infinite_scale_and_the_others_their_spread():
    mean = torch.tensor([0.0, 5.0, 1e6, 2.0], dtype=torch.float64)
    spread = torch.tensor([0.0, 0.0, 1e-7, 0.3], dtype=torch.float64)  # 1e-7 on 1e6: rounding, constant
    scale = standardization_scale(mean, spread)
    assert torch.isinf(scale[:3]).all() and scale[3] == 0.3
    x = torch.tensor([[7.0, 400.0, 2e6, 2.3]], dtype=torch.float64)
    z = (x - mean) / scale
    assert (z[0, :3] == 0).all() and torch.isclose(z[0, 3], torch.tensor(1.0, dtype=torch.float64))


def test_the_rule_is_relative_to_the_features_magnitude():
    """Constant means a spread of at most a millionth of |mean|, whatever the unit: float32
    rounding around 5 (spread 5e-7) is constant; a feature at 1e-13 that varies by half its mean,
    or one of spread 1e-9 around 0, is kept (an absolute floor would call both constant and turn a
    data set scaled by 1e-13 into a model of the base rate)."""
    mean = torch.tensor([5.0, 5.0, 1e-13, 0.0], dtype=torch.float64)
    spread = torch.tensor([5e-7, 5e-5, 5e-14, 1e-9], dtype=torch.float64)
    scale = standardization_scale(mean, spread)
    assert torch.isinf(scale[0]) and torch.equal(scale[1:], spread[1:])
