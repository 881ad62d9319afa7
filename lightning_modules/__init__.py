"""PyTorch Lightning modules, data modules and the CLI for milgp (imports the library; the library never imports Lightning).

* :class:`AttentionMILModule` — AttCNN: per-slice CNN, (gated) attention pooling, bag classifier.
* :class:`GPMILModule` — sparse-GP bag classifier on CNN features, two-stage or end-to-end.
* data modules (:mod:`lightning_modules.data`), extractors (:mod:`lightning_modules.extractors`),
  callbacks (:mod:`lightning_modules.callbacks`), and ``milgp-train`` (:mod:`lightning_modules.cli`).
"""
from lightning_modules.attention_mil import AttentionMILModule
from lightning_modules.callbacks import FeatureWriter, ReportWriter
from lightning_modules.data import BagArrayDataModule, CTCacheDataModule, FeatureDataModule
from lightning_modules.extractors import ResNetExtractor, SmallCNN
from lightning_modules.gp_mil import GPMILModule

__all__ = [
    "AttentionMILModule",
    "BagArrayDataModule",
    "CTCacheDataModule",
    "FeatureDataModule",
    "FeatureWriter",
    "GPMILModule",
    "ReportWriter",
    "ResNetExtractor",
    "SmallCNN",
]
