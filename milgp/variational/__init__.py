"""Closed-form natural updates of q(v) and the fit loop (the step itself:
:meth:`milgp.models.ClosedFormStrategy.natural_step`)."""
from milgp.variational.aggregate_fit import fit_aggregate
from milgp.variational.bag_locals import BagLocals
from milgp.variational.fit import closed_form_elbo, fit_closed_form
from milgp.variational.fit_loop import FitSteps, fit_loop
from milgp.variational.fit_result import FitResult
from milgp.variational.natural_update import NaturalStatistics, RobbinsMonro, natural_statistics

__all__ = [
    "BagLocals",
    "FitResult",
    "FitSteps",
    "NaturalStatistics",
    "RobbinsMonro",
    "closed_form_elbo",
    "fit_aggregate",
    "fit_closed_form",
    "fit_loop",
    "natural_statistics",
]
