"""Callbacks: feature files from ``predict`` and metrics/plots from ``test``."""
from lightning_modules.callbacks.feature_writer import FeatureWriter
from lightning_modules.callbacks.report_writer import ReportWriter

__all__ = ["FeatureWriter", "ReportWriter"]
