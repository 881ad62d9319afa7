"""GP heads: milgp's closed-form variational strategy and the estimators' sparse GP built on it."""
from milgp.models.closed_form_strategy import ClosedFormStrategy, Projection, WhitenedPosterior
from milgp.models.sparse_gp import SparseGP

__all__ = ["ClosedFormStrategy", "Projection", "SparseGP", "WhitenedPosterior"]
