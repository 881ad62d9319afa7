"""Baselines for honest comparison (Law et al. 2018, Appendix B)."""
from milgp.baselines.aggregate import BagPixelRegressor, ConstantRateRegressor

__all__ = ["BagPixelRegressor", "ConstantRateRegressor"]
