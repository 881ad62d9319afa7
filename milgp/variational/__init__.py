"""Closed-form natural updates of q(u) and the training loop."""
from milgp.variational.fit import FitResult, closed_form_elbo, fit_closed_form
from milgp.variational.natural_update import (
    NaturalStatistics,
    RobbinsMonro,
    apply_natural_step,
    natural_statistics,
    natural_step,
)

__all__ = [
    "FitResult",
    "NaturalStatistics",
    "RobbinsMonro",
    "apply_natural_step",
    "closed_form_elbo",
    "fit_closed_form",
    "natural_statistics",
    "natural_step",
]
