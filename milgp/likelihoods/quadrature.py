"""Gauss–Hermite expectations under univariate Gaussians ``N(mean, var)``."""
from __future__ import annotations

from functools import lru_cache
from typing import Callable

import numpy as np
import torch
from torch import Tensor

__all__ = ["gauss_hermite_expectation"]


@lru_cache(maxsize=16)
def _nodes(num_points: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """Nodes and weights for ``N(0, 1)``, made once per device (a copy to a GPU each call would be
    a host synchronisation) — as ordinary tensors even when first asked for under
    ``torch.inference_mode`` (e.g. Lightning's validation), so that gradients can flow past them later."""
    x, w = np.polynomial.hermite.hermgauss(num_points)
    with torch.inference_mode(False):
        return torch.as_tensor(x * np.sqrt(2.0), dtype=dtype, device=device), torch.as_tensor(w / np.sqrt(np.pi), dtype=dtype, device=device)


def gauss_hermite_expectation(fn: Callable[[Tensor], Tensor], mean: Tensor, var: Tensor, num_points: int = 40) -> Tensor:
    """``E[fn(f)]`` for ``f ~ N(mean, var)`` elementwise, ``(N,)``, by Gauss–Hermite quadrature.

    ``fn`` maps ``(N, Q)`` values to ``(N, Q)`` (or to ``(K, N, Q)``, several functions at once:
    the result is then ``(K, N)``); 40 nodes integrate smooth functions such as the
    logistic function to well below 1e-6 for the variances that occur in practice.
    """
    nodes_t, weights_t = _nodes(num_points, mean.dtype, mean.device)
    f = mean.unsqueeze(-1) + var.clamp_min(0).sqrt().unsqueeze(-1) * nodes_t
    return (fn(f) * weights_t).sum(-1)
