"""Callbacks: reports after ``test``/``validate``/``fit``, predictions and feature files from ``predict``."""
from lightning_modules.callbacks.feature_writer import FeatureWriter
from lightning_modules.callbacks.prediction_writer import PredictionWriter
from lightning_modules.callbacks.report_writer import ReportWriter

__all__ = ["FeatureWriter", "PredictionWriter", "ReportWriter"]
