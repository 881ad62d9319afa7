"""A small per-slice CNN in the spirit of the AttCNN feature extractor of Castro-Macías et al. (2024), §6.3."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from lightning_modules.extractors.norm import make_norm_layer

__all__ = ["SmallCNN"]


class SmallCNN(nn.Module):
    """``(N, C, H, W) -> (N, D)``: blocks of conv3×3 → norm → ReLU → conv3×3 → norm → ReLU → max-pool,
    then global pooling (average, max or both) and a linear map to ``feature_dim`` features.

    Args:
        in_channels: input channels (3 CT windows).
        feature_dim: D, the feature dimension (the seed uses 8, 32 and 128).
        widths: channels of each block (each block halves the resolution).
        norm: ``"group"`` (default), ``"frozen_batch"``, ``"batch"`` or ``"none"``
            (:mod:`lightning_modules.extractors.norm`).
        groups: GroupNorm groups per layer (default 2: half the channels per group, so the
            normalisation keeps relative intensities across channels).
        dropout: dropout before the last linear layer.
        pool: global pooling ``"avg"``, ``"max"`` or ``"avgmax"`` (both, concatenated; max keeps
            small bright findings such as a few-pixel hemorrhage from being averaged away).
        checkpoint: optional path of a ``state_dict`` (``torch.save``) to load, read with
            ``weights_only=True``.
    """

    def __init__(
        self,
        in_channels: int = 3,
        feature_dim: int = 32,
        widths: Sequence[int] = (16, 32, 64),
        norm: str = "group",
        groups: int = 2,
        dropout: float = 0.0,
        pool: str = "avgmax",
        checkpoint: str | None = None,
    ):
        super().__init__()
        self._config = {"in_channels": in_channels, "feature_dim": feature_dim, "widths": list(widths), "norm": norm,
                        "groups": groups, "dropout": dropout, "pool": pool}
        make_norm = make_norm_layer(norm, groups)
        layers: list[nn.Module] = []
        c = in_channels
        for w in widths:
            layers += [
                nn.Conv2d(c, w, 3, padding=1, bias=False), make_norm(w), nn.ReLU(inplace=True),
                nn.Conv2d(w, w, 3, padding=1, bias=False), make_norm(w), nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            ]
            c = w
        self.features = nn.Sequential(*layers)
        if pool not in ("avg", "max", "avgmax"):
            raise ValueError(f"pool must be 'avg', 'max' or 'avgmax', got {pool!r}")
        self.pool_mode = pool
        width = 2 * c if pool == "avgmax" else c
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(width, feature_dim))
        self.feature_dim = int(feature_dim)
        if checkpoint:
            self.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True))

    def config(self) -> dict:
        """The constructor arguments that rebuild this architecture (the weights live in the state dict)."""
        return dict(self._config)

    def forward(self, x: Tensor) -> Tensor:
        f = self.features(x)
        pooled = [f.mean((-2, -1))] if self.pool_mode != "max" else []  # "avgmax": both, concatenated
        pooled += [f.amax((-2, -1))] if self.pool_mode != "avg" else []
        return self.head(torch.cat(pooled, dim=1))
