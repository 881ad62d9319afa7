"""Per-slice feature extractors ``(N, C, H, W) -> (N, D)``; each has a ``feature_dim`` attribute."""
from lightning_modules.extractors.resnet import ResNetExtractor
from lightning_modules.extractors.small_cnn import SmallCNN

__all__ = ["ResNetExtractor", "SmallCNN"]
