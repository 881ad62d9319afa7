"""BagAugment: one transform per bag, applied to every slice alike."""
import math

import torch
import torch.nn.functional as F

from milgp.ct.augment import AugmentParams, BagAugment


def test_every_slice_gets_the_transform_a_per_slice_warp_gives() -> None:
    """The bag's slices and channels are warped as the channels of one image on one sampling grid;
    each slice must come out exactly as warping it alone with the same affine map would give (a
    slice warped by another slice's grid, or channels mixed, would differ)."""
    g = torch.Generator().manual_seed(0)
    slices = torch.rand(5, 3, 24, 20, generator=g)
    params = AugmentParams(flip=True, angle_deg=12.0, scale=1.1, translate=(0.05, -0.08), contrast=1.2, brightness=-0.05)
    out = BagAugment.apply(slices, params)
    a = math.radians(params.angle_deg)
    theta = torch.tensor([[math.cos(a) / params.scale, -math.sin(a) / params.scale, -0.1],
                          [math.sin(a) / params.scale, math.cos(a) / params.scale, 0.16]])
    for s in range(slices.shape[0]):
        one = slices[s : s + 1].flip(-1)
        grid = F.affine_grid(theta.unsqueeze(0), list(one.shape), align_corners=False)
        ref = F.grid_sample(one, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        torch.testing.assert_close(out[s], (ref[0] * params.contrast + params.brightness).clamp(0.0, 1.0))
