"""GP heads."""
from milgp.models.sparse_gp import Projection, SparseGP, WhitenedPosterior

__all__ = ["Projection", "SparseGP", "WhitenedPosterior"]
