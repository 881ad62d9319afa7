"""PyTorch Lightning modules, data modules and command-line tools for milgp (imports the library;
the library never imports Lightning); docs/lightning.md lists the pieces and what each does.

The names below are imported on first use, so that the command-line tools answer ``--help``
without importing torch and Lightning.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AttentionMILModule": "lightning_modules.attention_mil",
    "BagArrayDataModule": "lightning_modules.data",
    "CTCacheDataModule": "lightning_modules.data",
    "DicomDataModule": "lightning_modules.data",
    "FeatureDataModule": "lightning_modules.data",
    "AggregateGPHead": "lightning_modules.aggregate_gp_head",
    "FeatureWriter": "lightning_modules.callbacks",
    "GPMILModule": "lightning_modules.gp_mil",
    "InputError": "lightning_modules.input_error",
    "PredictionWriter": "lightning_modules.callbacks",
    "ReportWriter": "lightning_modules.callbacks",
    "ResNetExtractor": "lightning_modules.extractors",
    "SmallCNN": "lightning_modules.extractors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_modules' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
