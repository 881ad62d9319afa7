"""The fit loop, written once for every bag likelihood: Algorithm 1 of Castro-Macías et al.
(2024), "Introducing instance label correlation in multiple instance learning", generalised.

One iteration (full batch): a natural step of ``q(v)`` (with the locals' update, e.g. ``q(y)``),
then, optionally, ``hyper_steps`` Adam steps on the kernel hyperparameters with ``q(v)`` fixed, on
random whole bags holding at most ``hyper_max_instances`` instances. With ``bags_per_batch`` set,
an iteration is an epoch of minibatches of whole bags in random order: a stochastic natural step of
size ``schedule(t)`` with the statistics scaled by ``B / B_minibatch`` (Hoffman et al. 2013,
"Stochastic variational inference"), then the hyperparameter steps on the same minibatch.

Each likelihood family is one :class:`FitSteps`: :class:`milgp.variational.fit.ClosedFormSteps`
(augmented MIL likelihoods) and :class:`milgp.variational.aggregate_fit.AggregateSteps` (aggregate
outputs). The loop owns the order of the steps, the random bags, the ELBO trace and the stopping rule.
"""
from __future__ import annotations

import math
import numbers
import time
from typing import Any, Callable, Protocol

import torch
from torch import Tensor
from tqdm.auto import tqdm

from milgp.data.bags import BagBatch, random_bags_within
from milgp.models.closed_form_strategy import ClosedFormStrategy, WhitenedPosterior
from milgp.variational.fit_result import FitResult
from milgp.variational.natural_update import RobbinsMonro
from milgp.variational.stopping import RelativeChangeStop

__all__ = ["FitSteps", "fit_loop"]


class FitSteps(Protocol):
    """The steps of one likelihood family on one training batch, holding the current ``q(v)``
    (``q``), the locals (``None`` when the family has none) and whatever the family caches between
    passes. ``step_size`` is the ρ of the last natural step; ``elbo_estimate`` the batch's ELBO
    estimate before it, when the step computes one (else ``None``)."""

    strategy: ClosedFormStrategy
    batch: BagBatch
    q: WhitenedPosterior
    locals: Any
    step_size: float
    elbo_estimate: float | None

    def sweep(self) -> None:
        """A full-batch natural step of ``q(v)`` (and of the locals), written into the strategy."""

    def minibatch_step(self, bags: Tensor | None, rho: float, scale: float) -> None:
        """A stochastic natural step with step size ``rho`` on the bags ``bags`` (``None``: the whole
        batch), written into the strategy; ``scale`` = training bags / bags in the step."""

    def hyper_objective(self, x: Tensor | None = None) -> Tensor:
        """The data part of the ELBO with ``q(v)`` (and the locals) fixed at inputs ``x`` (default
        the batch's; e.g. features recomputed by a CNN), differentiable in ``x`` and the hyperparameters."""

    def hyper_step(self, bags: Tensor | None, optimizer: torch.optim.Optimizer) -> None:
        """One optimizer step on the hyperparameters, ``q(v)`` fixed, on the bags ``bags`` (``None``: all)."""

    def hyperparameters_changed(self) -> None:
        """Drop what depended on the hyperparameters (after a round of :meth:`hyper_step`)."""

    def evaluate(self, with_objective: bool) -> tuple[float, float | None]:
        """The ELBO of the current state and, when asked, the objective the hyperparameters ascend."""

    def finish(self, result: FitResult) -> None:
        """Write the family's final state into ``result``."""


@torch.enable_grad()  # the autograd statistics and the hyperparameter steps work inside a caller's torch.no_grad()
def fit_loop(
    steps: FitSteps,
    *,
    max_iter: int,
    tol: float,
    min_iter: int,
    optimizer: torch.optim.Optimizer | None,
    hyper_steps: int,
    hyper_max_instances: int,
    bags_per_batch: int | None,
    schedule: Callable[[int], float] | None,
    seed: int,
    progress: bool,
    callback: Callable[[int, float], None] | None,
    desc: str,
) -> FitResult:
    """Run the iterations of the module docstring until the watched value (the hyperparameters'
    objective when ``optimizer`` is given, else the ELBO) changes by less than ``tol`` twice in a
    row (:class:`RelativeChangeStop`) or ``max_iter`` iterations have run."""
    if bags_per_batch is not None and not (isinstance(bags_per_batch, numbers.Integral) and bags_per_batch >= 1):
        raise ValueError(f"bags_per_batch must be a positive integer or None (full batch), got {bags_per_batch!r}")
    start = time.perf_counter()
    batch, strategy = steps.batch, steps.strategy
    generator = torch.Generator().manual_seed(seed)
    B, N = batch.num_bags, batch.num_instances
    sizes = batch.bags.sizes if optimizer is not None and N > hyper_max_instances else None
    schedule = schedule or RobbinsMonro()
    stop = RelativeChangeStop(tol, min_iter)
    result = FitResult()
    step_t = 0
    bar = tqdm(range(max_iter), disable=not progress, desc=desc, leave=False)
    for it in bar:
        if bags_per_batch is None:
            steps.sweep()
            if optimizer is not None:
                for _ in range(hyper_steps):
                    bags = None if sizes is None else random_bags_within(sizes, hyper_max_instances, generator)
                    steps.hyper_step(bags, optimizer)
                steps.hyperparameters_changed()
        else:
            order = torch.randperm(B, generator=generator)
            for s in range(0, B, bags_per_batch):
                bags = order[s : s + bags_per_batch].to(batch.bag_index.device)
                rho = schedule(step_t)
                if not 0.0 < rho <= 1.0:
                    raise ValueError(f"schedule({step_t}) returned {rho!r}; the natural step size rho must be in (0, 1]")
                steps.minibatch_step(bags, rho, B / len(bags))
                step_t += 1
                if optimizer is not None:
                    for _ in range(hyper_steps):
                        steps.hyper_step(bags, optimizer)
                    steps.hyperparameters_changed()
        strategy.set_whitened_posterior(steps.q)  # writes q(v) and clears GPyTorch's caches
        elbo, objective = steps.evaluate(optimizer is not None)
        if not math.isfinite(elbo):
            raise FloatingPointError(
                f"the ELBO became {elbo} at iteration {it}; check the data for extreme values "
                "or lower the hyperparameter learning rate (lr)"
            )
        result.elbo.append(elbo)
        if objective is not None:
            result.objective.append(objective)
        bar.set_postfix(elbo=f"{elbo:.6g}")
        if callback is not None:
            callback(it, elbo)
        if stop(objective if optimizer is not None else elbo, it):
            result.converged = True
            break
    result.iterations = len(result.elbo)
    steps.finish(result)
    result.seconds = time.perf_counter() - start
    return result
