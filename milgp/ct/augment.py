"""Train-time augmentation of whole CT bags: one random transform per bag, applied to every slice
(a scan's slices are one 3-D object, so they move together), drawn from a ``torch.Generator`` the
caller seeds (``docs/ct_data.md``, "Dataset and augmentation").
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["AugmentParams", "BagAugment"]


@dataclass(frozen=True)
class AugmentParams:
    """One bag's transform.

    Attributes:
        flip: mirror left-right.
        angle_deg: in-plane rotation in degrees.
        translate: ``(tx, ty)`` shift as a fraction of the image width/height.
        scale: zoom factor (``> 1`` enlarges).
        contrast: intensity multiplier.
        brightness: intensity offset (in windowed units, ``[0, 1]`` scale).
    """

    flip: bool
    angle_deg: float
    translate: tuple[float, float]
    scale: float
    contrast: float
    brightness: float


@dataclass(frozen=True)
class BagAugment:
    """Bag-consistent random flip, affine and intensity jitter (off unless a dataset is given one).

    Attributes:
        flip_p: probability of a horizontal flip.
        max_rotation_deg: rotation drawn uniformly in ``[-max, max]`` degrees.
        max_translate: shift drawn uniformly in ``[-max, max]`` of the image size, per axis.
        scale_range: zoom drawn uniformly in this range.
        contrast_range: intensity multiplier drawn uniformly in this range.
        brightness_range: intensity offset drawn uniformly in this range.
    """

    flip_p: float = 0.5
    max_rotation_deg: float = 10.0
    max_translate: float = 0.05
    scale_range: tuple[float, float] = (0.95, 1.05)
    contrast_range: tuple[float, float] = (0.9, 1.1)
    brightness_range: tuple[float, float] = (-0.05, 0.05)

    def __post_init__(self) -> None:
        """Refuse settings that would serve NaN or meaningless bags (checked at construction, not at the
        first bag a worker draws)."""
        def check(name: str, ok: bool) -> None:
            if not ok:
                raise ValueError(f"BagAugment: {name} = {getattr(self, name)!r} is out of range")

        def finite_range(lo_hi: tuple[float, float], lowest: float) -> bool:
            lo, hi = (float(v) for v in lo_hi) if len(lo_hi) == 2 else (math.nan, math.nan)
            return math.isfinite(lo) and math.isfinite(hi) and lowest <= lo <= hi

        check("flip_p", 0.0 <= self.flip_p <= 1.0)
        check("max_rotation_deg", 0.0 <= self.max_rotation_deg <= 180.0)
        check("max_translate", 0.0 <= self.max_translate < 1.0)
        check("scale_range", finite_range(self.scale_range, 1e-6))
        check("contrast_range", finite_range(self.contrast_range, 0.0))
        check("brightness_range", finite_range(self.brightness_range, -math.inf))

    def sample(self, generator: torch.Generator) -> AugmentParams:
        """Draw one bag's :class:`AugmentParams`."""
        u = torch.rand(7, generator=generator, dtype=torch.float64).tolist()

        def between(v: float, lo: float, hi: float) -> float:
            return lo + (hi - lo) * v

        return AugmentParams(
            flip=u[0] < self.flip_p,
            angle_deg=between(u[1], -self.max_rotation_deg, self.max_rotation_deg),
            translate=(between(u[2], -self.max_translate, self.max_translate), between(u[3], -self.max_translate, self.max_translate)),
            scale=between(u[4], *self.scale_range),
            contrast=between(u[5], *self.contrast_range),
            brightness=between(u[6], *self.brightness_range),
        )

    @staticmethod
    def apply(slices: Tensor, params: AugmentParams) -> Tensor:
        """Apply one transform to every slice.

        Args:
            slices: ``(S, C, H, W)`` float, windowed values in ``[0, 1]``.
            params: the bag's transform.

        Returns:
            ``(S, C, H, W)`` float in ``[0, 1]``; pixels moved in from outside the image are 0
            (air in every window).
        """
        if slices.ndim != 4:
            raise ValueError(f"BagAugment expects slices of shape (S, C, H, W), got {tuple(slices.shape)}")
        x = slices.flip(-1) if params.flip else slices
        S, C, H, W = x.shape
        angle = math.radians(params.angle_deg)
        cos, sin = math.cos(angle) / params.scale, math.sin(angle) / params.scale
        # affine_grid maps output to input coordinates in [-1, 1] per axis: a shift of t (fraction of
        # the size) moves content by +t, i.e. samples from -2t; a rotation in pixels is D⁻¹RD in those
        # coordinates, D = diag(W, H), so that a non-square slice turns without shearing.
        theta = torch.tensor(
            [[cos, -sin * H / W, -2.0 * params.translate[0]], [sin * W / H, cos, -2.0 * params.translate[1]]],
            dtype=x.dtype, device=x.device,
        )
        # one grid for the whole bag: its slices and channels are sampled as the channels of one image
        grid = F.affine_grid(theta.unsqueeze(0), [1, S * C, H, W], align_corners=False)
        x = F.grid_sample(x.reshape(1, S * C, H, W), grid, mode="bilinear", padding_mode="zeros", align_corners=False).reshape(S, C, H, W)
        return (x * params.contrast + params.brightness).clamp_(0.0, 1.0)

    def __call__(self, slices: Tensor, generator: torch.Generator) -> Tensor:
        """Sample one transform with ``generator`` and apply it to all ``(S, C, H, W)`` slices."""
        return self.apply(slices, self.sample(generator))
