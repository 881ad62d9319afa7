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


def test_a_small_spread_of_a_small_feature_is_kept():
    """The tolerance is relative to max(1, |mean|): a feature of spread 1e-9 around 0 varies."""
    scale = standardization_scale(torch.tensor([0.0], dtype=torch.float64), torch.tensor([1e-9], dtype=torch.float64))
    assert scale.item() == 1e-9
