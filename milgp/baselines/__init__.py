"""Baselines for honest comparison (seed 001 Appendix B)."""
from milgp.baselines.aggregate import BagPixelRegressor, ConstantRateRegressor

__all__ = ["BagPixelRegressor", "ConstantRateRegressor"]
