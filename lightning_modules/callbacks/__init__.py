"""Callbacks: reports after ``test``/``validate``/``fit``, predictions and feature files from ``predict``,
and the checkpoints of ``milgp-train`` (best and last)."""
from lightning_modules.callbacks.best_and_last_checkpoint import BestAndLastCheckpoint
from lightning_modules.callbacks.feature_writer import FeatureWriter
from lightning_modules.callbacks.prediction_writer import PredictionWriter
from lightning_modules.callbacks.report_writer import ReportWriter

__all__ = ["BestAndLastCheckpoint", "FeatureWriter", "PredictionWriter", "ReportWriter"]
