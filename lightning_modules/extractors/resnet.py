"""torchvision ResNets as per-slice feature extractors (no downloads: ``weights=None`` or a local file)."""
from __future__ import annotations

import warnings

import torch
import torchvision
from torch import Tensor, nn

from lightning_modules.extractors.norm import make_norm_layer

__all__ = ["ResNetExtractor"]

_ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101")


class ResNetExtractor(nn.Module):
    """``(N, 3, H, W) -> (N, D)``: a torchvision ResNet trunk with its classifier replaced by a
    linear map to ``feature_dim`` features.

    Args:
        arch: ``"resnet18"``, ``"resnet34"``, ``"resnet50"`` or ``"resnet101"``.
        feature_dim: D.
        norm: ``"frozen_batch"`` (default: BatchNorm statistics fixed, safe for one-patient
            batches), ``"group"``, ``"batch"`` or ``"none"``.
        weights_path: optional local ``state_dict`` of the torchvision model (e.g. ImageNet weights
            saved beforehand), loaded with ``weights_only=True``; the ``fc`` layer and any
            normalisation buffers that do not fit are ignored. Never downloads anything.
        in_channels: input channels; other than 3 replaces the first convolution.
        groups: GroupNorm groups per layer (``norm="group"``).
    """

    def __init__(
        self,
        arch: str = "resnet18",
        feature_dim: int = 128,
        norm: str = "frozen_batch",
        weights_path: str | None = None,
        in_channels: int = 3,
        groups: int = 32,
    ):
        super().__init__()
        self._config = {"arch": arch, "feature_dim": feature_dim, "norm": norm, "in_channels": in_channels, "groups": groups}
        if arch not in _ARCHS:
            raise ValueError(f"unknown arch {arch!r}: use one of {_ARCHS}")
        net = getattr(torchvision.models, arch)(weights=None, norm_layer=make_norm_layer(norm, groups))
        if weights_path:
            state = torch.load(weights_path, map_location="cpu", weights_only=True)
            state = {k: v for k, v in state.items() if not k.startswith("fc.")}
            own = net.state_dict()
            fitting = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
            missing = [k for k in own if k not in fitting and not k.startswith("fc.")]
            net.load_state_dict(fitting, strict=False)
            if missing:
                warnings.warn(f"{weights_path}: {len(missing)} tensors not loaded (e.g. {missing[:3]})", stacklevel=2)
        if in_channels != 3:
            net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        net.fc = nn.Linear(net.fc.in_features, feature_dim)
        self.net = net
        self.feature_dim = int(feature_dim)

    def config(self) -> dict:
        """The constructor arguments that rebuild this architecture (the weights live in the state
        dict, so ``weights_path`` is left out)."""
        return dict(self._config)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)
