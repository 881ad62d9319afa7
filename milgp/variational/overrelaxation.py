"""Adaptive over-relaxed closed-form steps: faster full-batch CAVI with an ELBO safeguard.

When q(v) and the locals are strongly coupled (which instance of a positive bag is the witness),
plain CAVI creeps along a shared direction and converges linearly and slowly (docs/performance.md).
An over-relaxed step goes past the optimum ``η̂`` along that direction, in natural parameters,

    η ← η + ω (η̂ − η),      P ← P + ω (P̂ − P),      ω ≥ 1

(:meth:`~milgp.models.WhitenedPosterior.try_natural_step` with ``ρ = ω``), and is kept only if the
ELBO after the local update has not decreased; otherwise (or when the precision is indefinite) the
plain step is taken and ``ω`` falls back to 1. The ELBO is then monotone when the plain steps are
coordinate ascent (``max_rule="exact"``); with the damped parallel ``"max"`` label update a plain
step can lower it, as in plain CAVI. ``ω`` grows by :data:`GROWTH` after every kept step,
up to a cap: the adaptive over-relaxed bound optimisation of Salakhutdinov & Roweis, *Adaptive
overrelaxed bound optimization methods*, ICML 2003 (§3), on the natural parameters of q(v). The
fixed points are those of CAVI; :func:`milgp.variational.fit.fit_closed_form` runs it
(``max_overrelaxation``).
"""
from __future__ import annotations

__all__ = ["GROWTH", "AdaptiveOverrelaxation"]

GROWTH = 1.25
"""Factor by which ``ω`` grows after a kept step (Salakhutdinov & Roweis use a constant factor > 1)."""


class AdaptiveOverrelaxation:
    """The step size ``ω`` of the over-relaxed natural step (module docstring): 1 at the start and
    after a rejected step, × :data:`GROWTH` after a kept one, up to ``max_omega`` (``≥ 1``; 1: plain
    CAVI)."""

    def __init__(self, max_omega: float):
        if not max_omega >= 1.0:
            raise ValueError(f"the over-relaxation cap must be >= 1 (1 = plain CAVI), got {max_omega}")
        self.max_omega = float(max_omega)
        self.omega = 1.0

    def accept(self) -> None:
        self.omega = min(self.max_omega, self.omega * GROWTH)

    def reject(self) -> None:
        self.omega = 1.0
