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
    """``spread`` ``(D,)``, or ``inf`` where a feature is constant: its ``spread`` at most a
    millionth of ``|mean|`` (``mean`` ``(D,)``).

    A millionth is about the resolution of float32 numbers (7 significant digits), in which most
    feature pipelines compute: a slice thickness of 5 mm taken from float32 slice positions varies
    by about that much and carries nothing else. The test is relative, so scaling a feature by any
    factor does not change it (a feature at 1e-13 that varies is kept).
    """
    return torch.where(spread <= 1e-6 * mean.abs(), torch.full_like(spread, torch.inf), spread)
