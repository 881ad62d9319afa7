"""Closed-form natural updates of q(v) and the training loop (the step itself:
:meth:`milgp.models.ClosedFormStrategy.natural_step`)."""
from milgp.variational.fit import closed_form_elbo, fit_closed_form
from milgp.variational.fit_result import FitResult
from milgp.variational.natural_update import NaturalStatistics, RobbinsMonro, natural_statistics

__all__ = [
    "FitResult",
    "NaturalStatistics",
    "RobbinsMonro",
    "closed_form_elbo",
    "fit_closed_form",
    "natural_statistics",
]
