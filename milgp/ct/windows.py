"""Display windows: Hounsfield units -> channels in ``[0, 1]``, and antialiased resizing.

The attention-CNN pipeline of Castro-Macias et al., "Hyperbolic Secant representation of the
logistic function: probabilistic MIL for CT intracranial hemorrhage detection" (Artificial
Intelligence, 2024; Section 6.3) feeds three head-CT windows as channels: brain (40, 80),
subdural/blood (80, 200) and soft tissue (40, 380) (:data:`HEAD_CT_WINDOWS`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["HEAD_CT_WINDOWS", "apply_window", "ct_channels", "resize_images"]

#: Head-CT display windows ``(center, width)`` in HU, in channel order (module docstring).
HEAD_CT_WINDOWS: tuple[tuple[float, float], ...] = ((40.0, 80.0), (80.0, 200.0), (40.0, 380.0))


def apply_window(hu: np.ndarray, center: float, width: float) -> np.ndarray:
    """Display window: HU ``[center - width/2, center + width/2]`` -> ``[0, 1]``, clipped outside.

    Args:
        hu: array of any shape in HU.
        center, width: window level and width in HU (``width > 0``).

    Returns:
        float32 array of the same shape with values in ``[0, 1]``.
    """
    if not width > 0:
        raise ValueError(f"window width must be positive, got {width} (center {center})")
    out = np.array(hu, dtype=np.float32)
    out -= np.float32(center - width / 2.0)
    out *= np.float32(1.0 / width)
    return np.clip(out, 0.0, 1.0, out=out)


def resize_images(images: np.ndarray, size: int | tuple[int, int]) -> np.ndarray:
    """Bilinear, antialiased resize of the last two axes.

    Args:
        images: ``(..., H, W)`` float array.
        size: output ``(H', W')``, or one int for a square output.

    Returns:
        ``(..., H', W')`` float32 array. Antialiasing (a triangle filter widened by the scale
        factor when shrinking) keeps thin structures from aliasing; the weights are non-negative,
        so values stay inside the input range up to float rounding.
    """
    out_hw = (int(size), int(size)) if isinstance(size, (int, np.integer)) else (int(size[0]), int(size[1]))
    if min(out_hw) < 1:
        raise ValueError(f"resize size must be positive, got {size}")
    arr = np.asarray(images, dtype=np.float32)
    if arr.shape[-2:] == out_hw:
        return arr
    import torch  # here, not at module level: milgp-cache's parser needs this module's windows, not torch
    import torch.nn.functional as F

    lead = arr.shape[:-2]
    t = torch.from_numpy(np.ascontiguousarray(arr.reshape((-1, 1) + arr.shape[-2:])))
    resized = F.interpolate(t, size=out_hw, mode="bilinear", align_corners=False, antialias=True)
    return resized.reshape(lead + out_hw).numpy()


def ct_channels(
    hu: np.ndarray,
    windows: Sequence[tuple[float, float]] = HEAD_CT_WINDOWS,
    size: int | tuple[int, int] | None = None,
) -> np.ndarray:
    """Stack display windows of HU images as channels, optionally resized.

    Windows are applied first, then the ``[0, 1]`` maps are resized (:func:`resize_images`), so
    the output stays in ``[0, 1]``.

    Args:
        hu: ``(H, W)`` slice or ``(S, H, W)`` slices in HU.
        windows: ``(center, width)`` pairs in HU, one per output channel (default
            :data:`HEAD_CT_WINDOWS`: brain, subdural, soft tissue).
        size: output ``(H', W')`` or one int; ``None`` keeps ``H, W``.

    Returns:
        float32 ``(C, H', W')`` for a slice or ``(S, C, H', W')`` for slices, ``C = len(windows)``.
    """
    hu = np.asarray(hu, dtype=np.float32)
    if hu.ndim not in (2, 3):
        raise ValueError(f"ct_channels expects (H, W) or (S, H, W) HU, got shape {hu.shape}")
    if len(windows) == 0:
        raise ValueError("ct_channels needs at least one (center, width) window")
    win = np.asarray(windows, dtype=np.float32).reshape(-1, 2)
    if (win[:, 1] <= 0).any():
        raise ValueError(f"window widths must be positive, got windows {list(windows)}")
    low = (win[:, 0] - win[:, 1] / 2)[:, None, None]
    inv_width = (1.0 / win[:, 1])[:, None, None]
    # one broadcast pass per operation over (..., C, H, W), same values as apply_window per channel
    stacked = np.subtract(hu[..., None, :, :], low, dtype=np.float32)
    stacked *= inv_width
    np.clip(stacked, 0.0, 1.0, out=stacked)
    if size is None:
        return stacked
    return np.clip(resize_images(stacked, size), 0.0, 1.0)  # clip float rounding (e.g. 1 + 1e-7)
