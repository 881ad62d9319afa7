"""The standardisation scale of features, with features that are constant in training ignored.

A feature with no spread in training carries no information and has no known unit; left at scale
1, a value it takes only at prediction (a slice thickness never seen in training) would enter the
kernel's distances in raw units. Its scale is infinite instead: it standardises to 0 everywhere.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["standardization_scale"]


def standardization_scale(mean: Tensor, spread: Tensor) -> Tensor:
    """``spread`` ``(D,)``, or ``inf`` where a feature is constant: its ``spread`` at most a
    millionth of ``|mean|`` (``mean`` ``(D,)``).

    A millionth is about the resolution of float32, in which most feature pipelines compute. The
    test is relative, so scaling a feature does not change it (a feature at 1e-13 that varies is kept).
    """
    return torch.where(spread <= 1e-6 * mean.abs(), torch.full_like(spread, torch.inf), spread)
