"""Closed-form fits of augmented bag likelihoods: Algorithm 1 of Castro-Macías et al. (2024),
"Introducing instance label correlation in multiple instance learning", for any
:class:`AugmentedBagLikelihood`.

One iteration (full batch):

1. the local quadratic coefficients ``(b, λ)`` from the current ``q(f)`` (e.g. ``θ = θ_ψ(c)``);
2. the closed-form natural update of ``q(v)`` (ρ = 1: CAVI, :mod:`milgp.variational.natural_update`);
3. the closed-form update of the persistent locals (e.g. ``q(y)``) given the new ``q(f)``;
4. optionally, gradient steps (Adam) on the kernel hyperparameters (and inducing locations) on the
   closed-form ELBO with ``q(v)`` and the locals held fixed.

The loop is :func:`~milgp.variational.fit_loop.fit_loop`; :class:`ClosedFormSteps` are this family's steps.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from gpytorch.models import ApproximateGP
from torch import Tensor

from milgp.data.bags import BagBatch
from milgp.likelihoods.base import AugmentedBagLikelihood
from milgp.models.closed_form_strategy import ClosedFormStrategy, Projection, WhitenedPosterior
from milgp.variational.fit_loop import fit_loop
from milgp.variational.fit_result import FitResult
from milgp.variational.natural_update import NaturalStatistics
from milgp.variational.overrelaxation import AdaptiveOverrelaxation
from milgp.variational.projection_cache import DEFAULT_CACHE_BYTES, ProjectionCache

__all__ = ["ClosedFormSteps", "closed_form_elbo", "fit_closed_form"]


def closed_form_elbo(
    model: ApproximateGP,
    likelihood: AugmentedBagLikelihood,
    batch: BagBatch,
    locals_: Any,
    chunk_size: int = 65536,
) -> float:
    """The closed-form ELBO (data terms at ``locals_`` minus ``KL(q(v) ‖ N(0, I))``) of a model
    built on :class:`~milgp.models.ClosedFormStrategy`: :meth:`ClosedFormSteps.evaluate` at its current q(v).
    ``locals_`` ``None``: the likelihood's initial locals at that q(v) (:meth:`AugmentedBagLikelihood.init_locals`),
    as :func:`fit_closed_form` starts from."""
    likelihood.check_locals(locals_, batch.bags, "locals_")
    steps = ClosedFormSteps(ClosedFormStrategy.of(model), likelihood, batch, chunk_size=chunk_size, cache_bytes=0, initial_locals=locals_)
    return steps.evaluate(False)[0]


class ClosedFormSteps:
    """The steps of :func:`~milgp.variational.fit_loop.fit_loop` for an :class:`AugmentedBagLikelihood`
    on ``batch``: closed-form natural steps of ``q(v)`` and the locals (steps 1–3 of the module
    docstring) and Adam on :meth:`AugmentedBagLikelihood.hyperparameter_terms` per instance. The
    Lightning GP head steps its batch with :meth:`sweep` (``scale`` = training bags / bags in the
    global batch, ``reduce`` summing over DDP ranks) and :meth:`hyper_objective` on its features.

    Args:
        chunk_size, cache_bytes, projection, initial_locals: as :func:`fit_closed_form`.
        cache_all: ``False`` keeps nothing of the whole batch (the minibatches' projections are
            still cached within ``cache_bytes``).
        relax: the adaptive over-relaxation of full-batch sweeps (``None``: plain CAVI).
        reduce: maps this batch's natural statistics to the global ones (a DDP all-reduce).
        q: the current ``q(v)`` (``None``: read from the strategy).
    """

    def __init__(
        self,
        strategy: ClosedFormStrategy,
        likelihood: AugmentedBagLikelihood,
        batch: BagBatch,
        *,
        chunk_size: int = 65536,
        cache_bytes: float = DEFAULT_CACHE_BYTES,
        cache_all: bool = True,
        projection: tuple[Tensor, Projection] | None = None,
        initial_locals: Any = None,
        relax: AdaptiveOverrelaxation | None = None,
        reduce: Callable[[NaturalStatistics], NaturalStatistics] | None = None,
        q: WhitenedPosterior | None = None,
    ):
        self.strategy, self.likelihood, self.batch, self.relax, self.reduce = strategy, likelihood, batch, relax, reduce
        self.chunk_size, self.cache_bytes = chunk_size, cache_bytes
        self.projector = ProjectionCache(strategy, batch.x, chunk_size, cache_bytes if cache_all else 0)
        if projection is not None:
            self.projector.adopt(*projection)
        self.q = strategy.whitened_posterior() if q is None else q
        self.mean, self.var = self.projector.moments(self.q)
        if initial_locals is None:
            self.locals = likelihood.init_locals(batch.bags, batch.bag_labels, self.mean)
        else:  # in the batch's dtype: BagLocals keeps float64, a float32 model computes in float32
            self.locals = initial_locals.to(batch.x).clone() if isinstance(initial_locals, Tensor) else initial_locals
        self.moments_current = True
        self.elbo: float | None = None  # the ELBO of the current state, when a step computed it
        self.step_size, self.elbo_estimate = 0.0, None  # the closed-form step computes no ELBO estimate
        self.rejected_steps = 0
        self._minibatch: tuple[Tensor, BagBatch, Any] | None = None  # the last minibatch: bags, batch, locals

    def _data_terms(self, mean: Tensor, var: Tensor, locals_: Any) -> Tensor:
        b = self.batch
        return self.likelihood.elbo_terms(mean, var, b.bags, b.bag_labels, locals_)

    def _moments_and_locals(self, q: WhitenedPosterior) -> tuple[Tensor, Tensor, Any]:
        b = self.batch
        mean, var = self.projector.moments(q)
        return mean, var, self.likelihood.update_locals(mean, var, b.bags, b.bag_labels, self.locals)

    def sweep(self, rho: float = 1.0, scale: float = 1.0) -> None:
        """The natural step of size ``rho`` on the whole batch (statistics × ``scale``), written into
        the strategy, then the locals; over-relaxed with ``relax`` (at ``rho = scale = 1``)."""
        b, q, relax = self.batch, self.q, self.relax
        lin, lam = self.likelihood.quadratic_terms(self.mean, self.var, b.bags, b.bag_labels, self.locals)
        stats = self.projector.statistics(lin, lam)
        if self.reduce is not None:
            stats = self.reduce(stats)
        step, elbo = None, None
        if relax is not None and relax.omega > 1.0:  # past the optimum
            step = q.try_natural_step(stats, relax.omega, 1.0)  # None: the extrapolated precision is indefinite
            if step is not None:  # the safeguard: keep the over-relaxed step only if the ELBO did not fall
                mean, var, locals_ = self._moments_and_locals(step)
                with torch.no_grad():
                    elbo = float(self._data_terms(mean, var, locals_).sum() - step.kl_divergence())
                if self.elbo is not None and not elbo >= self.elbo:
                    self.rejected_steps += 1
                    step, elbo = None, None
        if relax is not None and relax.omega > 1.0 and step is None:  # the plain step, ω back to 1
            relax.reject()
        elif relax is not None:  # a kept over-relaxed step or a plain one by design: ω grows
            relax.accept()
        if step is None:  # the plain step, factorised only when it is taken
            step = q.natural_step(stats, rho=rho, scale=scale)
            mean, var, locals_ = self._moments_and_locals(step)
        self.q, self.mean, self.var, self.locals, self.elbo = step, mean, var, locals_, elbo
        self.moments_current, self.step_size = True, rho
        self.strategy.set_whitened_posterior(step)

    def minibatch_step(self, bags: Tensor | None, rho: float, scale: float) -> None:
        """:meth:`sweep` of the bags ``bags`` alone, from their current locals (written back);
        ``None``: of the whole batch."""
        if bags is None:
            self.sweep(rho, scale)
            return
        mb, idx = self.batch.select_bags_with_index(bags)
        cached_rows = self.projector.rows(idx)
        # one projection of the minibatch serves both passes of its step
        steps = ClosedFormSteps(
            self.strategy, self.likelihood, mb, chunk_size=self.chunk_size, cache_bytes=self.cache_bytes,
            projection=None if cached_rows is None else (self.projector.L(), cached_rows),
            initial_locals=_subset_locals(self.locals, idx), reduce=self.reduce, q=self.q,
        )
        steps.sweep(rho, scale)
        self.q, self.step_size = steps.q, rho
        if isinstance(self.locals, Tensor) and self.locals.ndim == 1:
            self.locals[idx] = steps.locals
        self._minibatch = (bags, mb, steps.locals)
        self.moments_current, self.elbo = False, None

    def _hyper_terms(self, batch: BagBatch, locals_: Any, x: Tensor) -> Tensor:
        mean, var = self.strategy.marginals(self.strategy.projection(x), self.q)
        return self.likelihood.hyperparameter_terms(mean, var, batch.bags, batch.bag_labels, locals_).sum()

    def hyper_objective(self, x: Tensor | None = None) -> Tensor:
        """:meth:`~milgp.variational.fit_loop.FitSteps.hyper_objective`: ``Σ`` hyperparameter terms
        of the batch (the whitened KL does not depend on the hyperparameters)."""
        return self._hyper_terms(self.batch, self.locals, self.batch.x if x is None else x)

    def hyper_step(self, bags: Tensor | None, optimizer: torch.optim.Optimizer) -> None:
        if bags is None:
            sub, locals_ = self.batch, self.locals
        elif self._minibatch is not None and self._minibatch[0] is bags:
            _, sub, locals_ = self._minibatch
        else:
            sub, idx = self.batch.select_bags_with_index(bags)
            locals_ = _subset_locals(self.locals, idx)
        optimizer.zero_grad(set_to_none=True)
        (-self._hyper_terms(sub, locals_, sub.x) / max(1, sub.num_instances)).backward()
        optimizer.step()

    def hyperparameters_changed(self) -> None:
        self.projector.invalidate()  # A is recomputed once, at the next pass, and reused after it
        self.moments_current, self.elbo = False, None

    def evaluate(self, with_objective: bool) -> tuple[float, float | None]:
        if not self.moments_current:
            self.mean, self.var = self.projector.moments(self.q)
            self.moments_current = True
        with torch.no_grad():
            kl = self.q.kl_divergence()
            if self.elbo is None:
                self.elbo = float(self._data_terms(self.mean, self.var, self.locals).sum() - kl)
            return self.elbo, (self._objective(kl) if with_objective else None)

    def _objective(self, kl: Tensor) -> float:
        """``Σ hyperparameter_terms − KL`` at the current moments (:attr:`FitResult.objective`)."""
        b = self.batch
        terms = self.likelihood.hyperparameter_terms(self.mean, self.var, b.bags, b.bag_labels, self.locals)
        return float(terms.sum() - kl)

    def finish(self, result: FitResult) -> None:
        if not result.objective:  # only the final value: the sweeps ascend ``elbo``, nothing watches it
            with torch.no_grad():
                result.objective.append(self._objective(self.q.kl_divergence()))
        result.rejected_steps = self.rejected_steps
        result.locals = self.locals
        result.moments = (self.mean, self.var)


def _subset_locals(locals_: Any, idx: Tensor) -> Any:
    return locals_[idx] if isinstance(locals_, Tensor) and locals_.ndim == 1 else locals_


def fit_closed_form(
    model: ApproximateGP,
    likelihood: AugmentedBagLikelihood,
    batch: BagBatch,
    *,
    max_iter: int = 100,
    tol: float = 1e-5,
    learn_hyperparameters: bool = True,
    hyper_steps: int = 5,
    lr: float = 0.01,
    hyper_max_instances: int = 20000,
    bags_per_batch: int | None = None,
    schedule: Callable[[int], float] | None = None,
    chunk_size: int = 65536,
    min_iter: int = 3,
    seed: int = 0,
    progress: bool = False,
    callback: Callable[[int, float], None] | None = None,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    initial_locals: Any = None,
    projection: tuple[Tensor, Projection] | None = None,
    max_overrelaxation: float = 1.0,
) -> FitResult:
    """Fit ``model``'s q(v), the locals and (optionally) the hyperparameters on ``batch``.

    Args:
        model: any ``ApproximateGP`` whose ``variational_strategy`` is
            :class:`~milgp.models.ClosedFormStrategy` (e.g. :class:`~milgp.models.SparseGP`, or a
            user's own model with their kernel and mean).
        batch: all training bags (``x`` ``(N, D)``, ``bag_index``, ``bag_labels``), on the model's
            device and dtype.
        max_iter: iterations (full batch) or epochs (``bags_per_batch`` set).
        tol: stop when the relative ELBO change is below ``tol`` for two iterations in a row
            (hyperparameter learning makes later changes small but not zero).
        bags_per_batch: ``None`` for full-batch CAVI; otherwise stochastic natural steps on
            minibatches of that many bags with step sizes from ``schedule`` (default
            :class:`RobbinsMonro` ``τ = 1, κ = 0.6``).
        callback: called as ``callback(iteration, elbo)``.
        chunk_size: instances per chunk of ``A`` in the statistics and moment passes.
        cache_bytes: memory budget of the :class:`ProjectionCache` of ``A = L⁻¹K_zx`` (``0``
            disables it); results are the same either way (to rounding).
        initial_locals: the locals to start from (e.g. ``result.locals`` of an earlier fit on the
            same ``batch``, so that q(y) is not reset; checked by
            :meth:`AugmentedBagLikelihood.check_locals`); ``None`` initialises them from the
            current q(v) with :meth:`AugmentedBagLikelihood.init_locals`.
        projection: ``(L, Projection)`` of ``batch.x`` under the model's current hyperparameters,
            already computed (e.g. by :class:`milgp.models.shared_gram.SharedGram` for a kernel
            search); used until a hyperparameter step changes the kernel.
        max_overrelaxation: cap of the adaptive over-relaxed step
            (:mod:`milgp.variational.overrelaxation`; full-batch sweeps without hyperparameter
            learning only); 1 (default) is plain CAVI (docs/performance.md compares them).
    """
    if max_overrelaxation != 1.0 and (bags_per_batch is not None or learn_hyperparameters):
        raise ValueError(
            "max_overrelaxation > 1 needs full-batch sweeps without hyperparameter learning "
            "(bags_per_batch=None, learn_hyperparameters=False): its safeguard compares ELBOs of one objective"
        )
    strategy = ClosedFormStrategy.of(model)
    strategy.check_batch(batch)
    likelihood.check_bag_labels(batch.bag_labels)
    likelihood.check_locals(initial_locals, batch.bags)
    relax = AdaptiveOverrelaxation(max_overrelaxation) if max_overrelaxation != 1.0 else None
    optimizer = torch.optim.Adam(strategy.hyperparameters(), lr=lr) if learn_hyperparameters else None
    steps = ClosedFormSteps(
        strategy, likelihood, batch, chunk_size=chunk_size, cache_bytes=cache_bytes,
        # with minibatches and hyperparameter steps A changes after every minibatch: no full cache
        cache_all=bags_per_batch is None or not learn_hyperparameters,
        projection=projection, initial_locals=initial_locals, relax=relax,
    )
    return fit_loop(
        steps, max_iter=max_iter, tol=tol, min_iter=min_iter, optimizer=optimizer, hyper_steps=hyper_steps,
        hyper_max_instances=hyper_max_instances, bags_per_batch=bags_per_batch, schedule=schedule, seed=seed,
        progress=progress, callback=callback, desc="fit",
    )
