"""The standardisation scale of features, with features that are constant in training ignored.

A feature with no spread in the training instances carries no information, and its unit is
unknown, so any scale given to it is arbitrary. Left at scale 1, a value it takes only at prediction
(a slice thickness of 0.6 mm where every training scan had 5 mm; a CNN unit that was never active on
the training slices) enters the kernel's distances in raw units and can move every prediction.
Its scale is infinite instead: it standardises to 0 in training and in prediction alike.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["standardization_scale"]


def standardization_scale(mean: Tensor, spread: Tensor) -> Tensor:
    """``spread`` ``(D,)``, or ``inf`` where a feature is constant: its ``spread`` at most
    ``1e-12 · max(1, |mean|)`` (``mean`` ``(D,)``), rounding's share of a constant value."""
    return torch.where(spread <= 1e-12 * mean.abs().clamp_min(1.0), torch.full_like(spread, torch.inf), spread)
