"""What a fit returns: the ELBO trace, convergence, the locals and the final moments."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

__all__ = ["FitResult"]


@dataclass
class FitResult:
    """What :func:`~milgp.variational.fit_loop.fit_loop` returns, for
    :func:`~milgp.variational.fit.fit_closed_form` and :func:`~milgp.variational.aggregate_fit.fit_aggregate`.

    Attributes:
        elbo: the closed-form (augmented) ELBO after each iteration (full batch) or epoch
            (minibatch): the objective the natural steps and local updates ascend.
        objective: the objective the hyperparameter steps ascend, ``Σ hyperparameter_terms − KL``
            (:meth:`AugmentedBagLikelihood.hyperparameter_terms`), after each iteration when they are
            learned (it is then the convergence criterion), else its final value only. VGPMIL: the
            un-augmented ELBO (Castro-Macías et al. 2024, Eq. 29), a tighter bound than ``elbo``.
        converged: whether the relative change of ``objective`` (with hyperparameter learning) or
            of ``elbo`` (without) fell below ``tol``.
        iterations: iterations (full batch) or epochs run.
        seconds: wall time.
        locals: the persistent locals at the end (e.g. ``π`` ``(N,)`` for VGPMIL).
        moments: ``(mean, var)`` ``(N,)`` of ``q(f)`` at the training inputs at the end.
        rejected_steps: over-relaxed steps that lowered the ELBO and were replaced by the plain
            step (``max_overrelaxation > 1``; each cost one extra pass for the moments).
        rho: the natural step size in use at the end (1 for the closed-form steps; the adapted
            step of non-conjugate aggregate likelihoods).

    For aggregate likelihoods there are no locals (``locals`` and ``moments`` stay ``None``) and
    the hyperparameters ascend the ELBO itself, so ``objective`` repeats ``elbo``.
    """

    elbo: list[float] = field(default_factory=list)
    objective: list[float] = field(default_factory=list)
    converged: bool = False
    iterations: int = 0
    seconds: float = 0.0
    locals: Any = None
    moments: tuple[Tensor, Tensor] | None = None
    rejected_steps: int = 0
    rho: float = 1.0

    def after(self, earlier: "FitResult") -> "FitResult":
        """This fit as the continuation of ``earlier`` (e.g. hyperparameter learning after a warm-up
        fit): ``earlier``'s ELBO trace before this one's, their iterations and seconds added."""
        self.elbo = earlier.elbo + self.elbo
        self.iterations += earlier.iterations
        self.seconds += earlier.seconds
        return self
