"""Normalisation layers for per-slice CNNs where one batch may be one patient (one scan's slices: BatchNorm statistics would be one patient's).

``"group"`` (GroupNorm, default): statistics per slice, so a bag's features never depend on the
other slices in the batch, on the batch size, or on padding. ``"frozen_batch"``: BatchNorm with
fixed statistics and affine parameters (torchvision's ``FrozenBatchNorm2d``; load them from a
checkpoint). ``"batch"``: ordinary BatchNorm (only for large, mixed batches; a bag's prediction
then depends on its batch mates in training mode). ``"none"``: identity.
"""
from __future__ import annotations

from typing import Callable

from torch import nn
from torchvision.ops import FrozenBatchNorm2d

__all__ = ["NORMS", "make_norm_layer"]

NORMS = ("group", "frozen_batch", "batch", "none")


def make_norm_layer(norm: str, groups: int = 8) -> Callable[[int], nn.Module]:
    """A factory ``channels -> nn.Module`` for ``norm`` in :data:`NORMS`."""

    def group(channels: int) -> nn.Module:  # the most groups up to ``groups`` that divide ``channels``
        g = max(g for g in range(1, min(groups, channels) + 1) if channels % g == 0)
        return nn.GroupNorm(g, channels)

    factories = {"group": group, "frozen_batch": FrozenBatchNorm2d, "batch": nn.BatchNorm2d,
                 "none": lambda channels: nn.Identity()}
    if norm not in factories:
        raise ValueError(f"unknown norm {norm!r}: use one of {NORMS}")
    return factories[norm]
