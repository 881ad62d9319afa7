"""BagAugment: one transform per bag, applied to every slice alike."""
import math

import pytest
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
    a, (H, W) = math.radians(params.angle_deg), slices.shape[-2:]
    theta = torch.tensor([[math.cos(a) / params.scale, -math.sin(a) / params.scale * H / W, -0.1],
                          [math.sin(a) / params.scale * W / H, math.cos(a) / params.scale, 0.16]])
    for s in range(slices.shape[0]):
        one = slices[s : s + 1].flip(-1)
        grid = F.affine_grid(theta.unsqueeze(0), list(one.shape), align_corners=False)
        ref = F.grid_sample(one, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        torch.testing.assert_close(out[s], (ref[0] * params.contrast + params.brightness).clamp(0.0, 1.0))


def _centre_of_mass(image: torch.Tensor) -> torch.Tensor:
    """``(row, column)`` of an image's mass, in pixels from the image centre."""
    H, W = image.shape
    rows, cols = torch.meshgrid(torch.arange(H) - (H - 1) / 2, torch.arange(W) - (W - 1) / 2, indexing="ij")
    return torch.stack([(rows * image).sum(), (cols * image).sum()]) / image.sum()


def test_a_rotation_turns_a_non_square_slice_without_shearing() -> None:
    """A 32 × 64 slice turned by 90° and by 10°: a blob 10 px right of the centre must stay 10 px
    from it and turn by the angle. affine_grid's coordinates span each axis as [-1, 1], so a
    rotation written there without the aspect ratio moved the blob to 5 px and turned it 5.1° at 10°."""
    image = torch.zeros(1, 1, 32, 64)
    image[0, 0, 14:18, 40:44] = 1.0  # centre (15.5, 41.5): 10 px right of the centre (15.5, 31.5)
    before = _centre_of_mass(image[0, 0])
    for angle in (90.0, 10.0):
        params = AugmentParams(flip=False, angle_deg=angle, translate=(0.0, 0.0), scale=1.0, contrast=1.0, brightness=0.0)
        after = _centre_of_mass(BagAugment.apply(image, params)[0, 0])
        assert abs(float(after.norm()) - float(before.norm())) < 0.3
        turned = math.degrees(math.atan2(after[0], after[1]) - math.atan2(before[0], before[1]))
        assert abs(abs(turned) - angle) < 1.0


def test_settings_that_would_serve_nan_or_nonsense_are_refused_at_construction() -> None:
    """A NaN contrast served NaN slices (the dataset's finite check runs before augmentation), and a
    reversed range drew outside it; both were accepted until a worker drew the first bag."""
    for kwargs in ({"contrast_range": (math.nan, 1.0)}, {"scale_range": (1.1, 0.9)}, {"scale_range": (0.0, 1.0)},
                   {"flip_p": 1.5}, {"max_translate": -0.1}, {"max_rotation_deg": math.inf},
                   {"brightness_range": (0.1,)}):
        name = next(iter(kwargs))
        with pytest.raises(ValueError, match=f"BagAugment: {name} = .* is out of range"):
            BagAugment(**kwargs)
    BagAugment(flip_p=0.0, max_rotation_deg=0.0, max_translate=0.0, scale_range=(1.0, 1.0), contrast_range=(1.0, 1.0))
