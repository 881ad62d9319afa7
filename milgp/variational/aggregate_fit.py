"""Training VBAgg models: natural-gradient steps on q(v) alternating with Adam on hyperparameters
(docs/aggregate.md, "Training").

**Natural step.** For the whitened ``q(v) = N(m, S)`` with prior ``N(0, I)`` and data term
``E(m, S)`` (the sum of :meth:`AggregateLikelihood.bag_terms` over bags), the natural gradient of
the ELBO ``E − KL`` with step ρ is ``η ← (1 − ρ) η + ρ (η_prior + ∇_μ E)`` (Hensman et al. 2013;
Salimbeni et al. 2018), ``∇_μ E`` the gradient with respect to the *expectation* parameters
``(m, S + mmᵀ)``. In the additive form of :class:`~milgp.variational.natural_update.NaturalStatistics`

    h = ∂E/∂m − 2 (∂E/∂S) m,      G = −2 ∂E/∂S,        (η̂₁, P̂) = (s·h, I + s·G),

the target of :meth:`~milgp.models.WhitenedPosterior.natural_step` (for a quadratic likelihood the
closed-form statistics; tested), with ``∂E/∂m``, ``∂E/∂S`` from autograd over chunks of whole bags.
The Normal model has exact closed-form statistics and ρ = 1 is its optimum. Poisson/Exponential:
full batch, ρ adapts by backtracking (a step is accepted when the ELBO does not decrease and the
precision is positive definite; ρ then grows ×1.5, up to ``rho_max``); with minibatches of bags ρ
follows a Robbins–Monro schedule (capped at ``rho_max``), halved until the precision is positive
definite.

**Hyperparameters** (kernel, constant mean, Normal noise τ, optionally Z): Adam on the ELBO with
``q(v)`` fixed, on random whole bags (at most ``hyper_max_instances`` instances). The loop is
:func:`~milgp.variational.fit_loop.fit_loop`; :class:`AggregateSteps` are this family's steps.

**Chunks.** Bags are sorted by size and packed into groups of at most ``chunk_instances``
instances and, when the likelihood needs within-bag covariances, ``block_budget`` padded block
entries (``B_g · n_max²``); a bag larger than the budget forms its own group. The Poisson-exp and
Exponential models need only marginals: ``O(chunk · M)`` memory whatever the bag sizes.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator, NamedTuple

import torch
from gpytorch.models import ApproximateGP
from torch import Tensor

from milgp.data.bags import BagBatch, BagGroup, Bags, make_bag_groups, segment_sum, weights_or_ones
from milgp.likelihoods.aggregate import AggregateLikelihood, BlockBase, bag_blocks, block_base, blocks_from_base, whitened_marginals
from milgp.linalg import robust_cholesky
from milgp.models.closed_form_strategy import ClosedFormStrategy, Projection, WhitenedPosterior
from milgp.variational.fit_loop import fit_loop
from milgp.variational.fit_result import FitResult
from milgp.variational.natural_update import NaturalStatistics
from milgp.variational.projection_cache import ProjectionCache

__all__ = ["AggregateSteps", "bag_log_predictive", "fit_aggregate", "predict_bag_moments"]


def _weights(batch: BagBatch) -> Tensor:
    return weights_or_ones(batch.instance_weights, batch.x[:, 0])


class _Cached(NamedTuple):
    """One group's projection and block base: hyperparameter-dependent, q-independent (no graph)."""

    proj: Projection
    block: BlockBase | None


class AggregateSteps:
    """The steps of :func:`~milgp.variational.fit_loop.fit_loop` for an :class:`AggregateLikelihood`
    on ``batch``: natural steps of ``q(v)`` (:meth:`sweep`, :meth:`minibatch_step`) and Adam on the
    ELBO per instance. The Lightning GP head takes its training step with these steps on its batch
    (``bags=None`` in :meth:`minibatch_step`), the statistics and data terms summed over DDP ranks by
    ``reduce`` and ``reduce_value``. The objective's pieces on any groups of the batch:
    :meth:`group_terms`, :meth:`data_terms`, :meth:`aggregate_elbo`, :meth:`natural_statistics`.

    Attributes:
        rho: the step size of the next full-batch step (adaptive; 1 for the conjugate model).
        step_size: the ρ of the last step (0 when every step was rejected).
        elbo_estimate: the batch's ELBO estimate ``scale · data − KL`` before the last step.
    """

    def __init__(
        self,
        strategy: ClosedFormStrategy,
        likelihood: AggregateLikelihood,
        batch: BagBatch,
        *,
        rho: float = 0.5,
        rho_max: float = 1.0,
        chunk_instances: int = 32768,
        block_budget: int = 2_000_000,
        cache_entries: int = 50_000_000,
        reduce: Callable[[NaturalStatistics], NaturalStatistics] | None = None,
        reduce_value: Callable[[float], float] | None = None,
    ):
        for name, value in (("rho0", rho), ("rho_max", rho_max)):
            if not 0.0 < value < math.inf:  # ρ ≤ 0 would never step (ρ > 1: over-relaxed full-batch steps)
                raise ValueError(f"{name} must be a positive step size, got {value!r}")
        self.strategy, self.model, self.likelihood, self.batch = strategy, strategy.model, likelihood, batch
        self.rho_max, self.chunk_instances, self.reduce, self.reduce_value = rho_max, chunk_instances, reduce, reduce_value
        self.budget = block_budget if likelihood.needs_covariance else None
        self.groups = batch.bags.groups(chunk_instances, self.budget)
        self.conjugate = likelihood.conjugate
        # the groups' projections (one after the other) and blocks, kept while the hyperparameters
        # are fixed when they fit in ``cache_entries`` floats
        M = strategy.num_inducing
        entries = batch.num_instances * (M + 2)
        if likelihood.needs_covariance:
            for g in self.groups:
                n_max = g.local_bags.padding.n_max
                entries += g.num_bags * n_max * (n_max + M + 2)
        self.projector = None
        if entries <= cache_entries:
            order = torch.cat([g.inst for g in self.groups])
            self.projector = ProjectionCache(strategy, batch.x, [int(g.inst.numel()) for g in self.groups], math.inf, order=order)
        self._cached: list[_Cached] | None = None
        self.q = strategy.whitened_posterior()
        self.rho = 1.0 if self.conjugate else min(rho, rho_max)
        self.step_size, self.elbo_estimate = 0.0, math.nan
        self.elbo: float | None = None  # the ELBO of the current state, when a step computed it
        self.locals = None  # aggregate likelihoods have no locals
        self._minibatch: tuple[Tensor, list[BagGroup]] | None = None  # the last minibatch: bags, groups

    def _prepare(
        self, batch: BagBatch, group: BagGroup, L: Tensor | None, grad_hyper: bool, proj: Projection | None = None
    ) -> _Cached:
        """``group``'s projection (``proj`` when already computed) and, with ``needs_covariance``, its block base."""
        x = batch.x[group.inst]
        with torch.set_grad_enabled(grad_hyper and torch.is_grad_enabled()):
            proj = self.strategy.projection(x, L) if proj is None else proj
            block = None
            if self.likelihood.needs_covariance:
                block = block_base(self.model, x, proj, group.local_bags, _weights(batch)[group.inst], kernel_grad=grad_hyper)
        return _Cached(proj, block)

    def group_terms(
        self, group: BagGroup, m: Tensor, S: Tensor, L: Tensor | None, grad_hyper: bool,
        cached: _Cached | None = None, batch: BagBatch | None = None,
    ) -> Tensor:
        """Per-bag expected log-likelihood ``(B_g,)`` of one group of ``batch`` (default: this
        steps' batch); differentiable in ``m, S`` (and in the hyperparameters when ``grad_hyper``;
        then ``cached`` must be ``None``)."""
        batch = self.batch if batch is None else batch
        if cached is None:
            cached = self._prepare(batch, group, L, grad_hyper)
        proj, block = cached
        w = _weights(batch)[group.inst]
        y = batch.bag_labels[group.bags]
        mean, var = whitened_marginals(proj.A, proj.prior_var, proj.prior_mean, m, S)
        blocks = blocks_from_base(block, m, S) if block is not None else None
        return self.likelihood.bag_terms(y, w, mean, var, group.local_bags, blocks)

    def aggregate_elbo(self, groups: list[BagGroup], q: WhitenedPosterior, cached: list[_Cached] | None = None) -> float:
        """The VBAgg objective: ``Σ_a bag_terms − KL(q(v) ‖ N(0, I))`` (float) over the bags of ``groups``."""
        return self.data_terms(groups, q, cached) - float(q.kl_divergence())

    def data_terms(self, groups: list[BagGroup], q: WhitenedPosterior, cached: list[_Cached] | None = None) -> float:
        """``Σ_a bag_terms`` over the bags of ``groups`` under ``q`` (float; no KL); ``cached``: the
        groups' projections and blocks while the hyperparameters are fixed (``None``: computed here)."""
        with torch.no_grad():
            L = self.strategy.inducing_cholesky() if cached is None else None
            items = cached if cached is not None else [None] * len(groups)
            return sum(float(self.group_terms(g, q.m, q.S, L, False, c).sum()) for g, c in zip(groups, items))

    def natural_statistics(
        self, groups: list[BagGroup], q: WhitenedPosterior, closed_form: bool = True, cached: list[_Cached] | None = None
    ) -> tuple[NaturalStatistics, float]:
        """Natural-gradient statistics ``(h, G)`` of the data term of ``groups`` at ``q`` and the data
        term's value: closed form when the likelihood offers it (Normal) and ``closed_form``, else
        by the autograd route of the module docstring."""
        items = cached if cached is not None else [None] * len(groups)
        with torch.no_grad():
            L = self.strategy.inducing_cholesky()
        if closed_form and self.conjugate:
            stats, value = None, 0.0
            w_all = _weights(self.batch)
            with torch.no_grad():
                for g, c in zip(groups, items):
                    c = c if c is not None else self._prepare(self.batch, g, L, False)
                    part = self.likelihood.closed_form_statistics(
                        self.batch.bag_labels[g.bags], w_all[g.inst], c.proj.A, c.proj.prior_mean, g.local_bags
                    )
                    value += float(self.group_terms(g, q.m, q.S, L, False, c).sum())
                    stats = part if stats is None else stats + part
            return stats, value
        m = q.m.detach().clone().requires_grad_(True)
        S = q.S.detach().clone().requires_grad_(True)
        value = 0.0
        for g, c in zip(groups, items):
            terms = self.group_terms(g, m, S, L, False, c).sum()
            terms.backward()
            value += float(terms.detach())
        gm = m.grad if m.grad is not None else torch.zeros_like(m)
        gS = S.grad if S.grad is not None else torch.zeros_like(S)
        gS = 0.5 * (gS + gS.mT)
        h = gm - 2.0 * gS @ q.m
        return NaturalStatistics(h=h.detach(), G=(-2.0 * gS).detach()), value

    def _cache(self) -> list[_Cached] | None:
        """Every group's projection and (with ``needs_covariance``) block base, computed once per
        hyperparameter setting; ``None`` when they do not fit the budget."""
        if self.projector is not None and self._cached is None:
            with torch.no_grad():
                self._cached = [
                    self._prepare(self.batch, g, None, False, proj)
                    for g, (_, proj) in zip(self.groups, self.projector.chunks())
                ]
        return self._cached

    def _groups_of(self, bags: Tensor) -> list[BagGroup]:
        return make_bag_groups(self.batch.bags, self.chunk_instances, self.budget, subset=bags)

    def _step(self, groups: list[BagGroup], rho: float, scale: float, check: bool, cached: list[_Cached] | None) -> bool:
        """One natural step on the bags of ``groups``: the statistics of
        :meth:`natural_statistics` (summed over ranks by ``reduce``; ``reduce_value`` sums
        the data term), then :meth:`WhitenedPosterior.try_natural_step` with ``ρ`` halved (down to
        ``1e-6``; the requested ``ρ`` itself is always tried) until the new precision is positive
        definite and, with ``check``, the batch's ELBO estimate ``scale · data − KL`` does not
        fall. Writes the new ``q(v)``; returns whether a step was taken."""
        stats, data = self.natural_statistics(groups, self.q, cached=cached)
        if self.reduce is not None:
            stats = self.reduce(stats)
        total = self.reduce_value or float  # the data term is a sum over ranks, KL is not
        self.elbo_estimate = before = scale * total(data) - float(self.q.kl_divergence())
        checked: list[float] = []

        def ascends(q_new: WhitenedPosterior) -> bool:
            data_new = total(self.data_terms(groups, q_new, cached))
            checked.append(scale * data_new - float(q_new.kl_divergence()))
            return math.isfinite(checked[-1]) and checked[-1] >= before - 1e-9 * abs(before)

        self.rho, q_new, self.elbo = float(rho), None, None
        with torch.no_grad():
            while True:  # the requested ρ is tried however small; the halvings stop below 1e-6
                q_new = self.q.try_natural_step(stats, self.rho, scale)
                if q_new is not None and (not check or ascends(q_new)):
                    break
                q_new = None
                self.rho *= 0.5
                if self.rho < 1e-6:
                    break
        self.step_size = 0.0 if q_new is None else self.rho
        if q_new is not None:
            self.q = q_new
            self.strategy.set_whitened_posterior(q_new)
            if checked and scale == 1.0 and groups is self.groups and self.reduce_value is None:
                self.elbo = checked[-1]  # the whole batch's ELBO at the new q(v): evaluate() reuses it
        return q_new is not None

    def sweep(self) -> None:
        """A full-batch step: exact for the conjugate model, otherwise backtracking from ρ, then a
        larger first try next time."""
        if self._step(self.groups, 1.0 if self.conjugate else self.rho, 1.0, not self.conjugate, self._cache()) and not self.conjugate:
            self.rho = min(self.rho_max, self.rho * 1.5)

    def minibatch_step(self, bags: Tensor | None, rho: float, scale: float) -> None:
        """A step of size ``min(1, rho_max · rho)`` on the bags ``bags`` (``None``: the whole batch)
        with statistics × ``scale``; the minibatch's unbiased ELBO estimate must not fall (a
        non-conjugate step can overshoot), except for the conjugate model on all bags (exact)."""
        groups = self.groups if bags is None else self._groups_of(bags)
        exact = self.conjugate and scale == 1.0
        self._step(groups, 1.0 if exact else min(1.0, self.rho_max * rho), scale, not exact, self._cache() if bags is None else None)
        self._minibatch = None if bags is None else (bags, groups)

    def hyper_objective(self, x: Tensor | None = None) -> Tensor:
        """:meth:`~milgp.variational.fit_loop.FitSteps.hyper_objective`: ``Σ_a`` bag terms of the
        batch, differentiable in the likelihood's parameters too (the whitened KL does not depend on them)."""
        batch = self.batch if x is None else BagBatch(x, self.batch.bag_index, self.batch.bag_labels, instance_weights=self.batch.instance_weights)
        L = self.strategy.inducing_cholesky()
        return torch.stack([self.group_terms(g, self.q.m, self.q.S, L, True, batch=batch).sum() for g in self.groups]).sum()

    def hyper_step(self, bags: Tensor | None, optimizer: torch.optim.Optimizer) -> None:
        if bags is None:
            groups, n = self.groups, self.batch.num_instances
        else:
            groups = self._minibatch[1] if self._minibatch is not None and self._minibatch[0] is bags else self._groups_of(bags)
            n = int(self.batch.bags.sizes[bags].sum())
        # objective per instance of the subset: the ELBO / N estimated from whole bags; one backward
        # per group keeps one group's graph in memory at a time
        optimizer.zero_grad(set_to_none=True)
        for g in groups:
            L = self.strategy.inducing_cholesky()
            terms = self.group_terms(g, self.q.m, self.q.S, L, True).sum()
            (-terms / float(n)).backward()
        optimizer.step()

    def hyperparameters_changed(self) -> None:
        if self.projector is not None:
            self.projector.invalidate()
        self._cached, self.elbo = None, None

    def evaluate(self, with_objective: bool) -> tuple[float, float | None]:
        if self.elbo is None:
            self.elbo = self.aggregate_elbo(self.groups, self.q, self._cache())
        return self.elbo, (self.elbo if with_objective else None)  # the hyperparameters ascend the ELBO itself

    def finish(self, result: FitResult) -> None:
        result.rho = self.rho
        if not result.objective and result.elbo:  # max_iter = 0: no ELBO, no objective
            result.objective.append(result.elbo[-1])


def fit_aggregate(
    model: ApproximateGP,
    likelihood: AggregateLikelihood,
    batch: BagBatch,
    *,
    max_iter: int = 100,
    tol: float = 1e-6,
    learn_hyperparameters: bool = True,
    hyper_steps: int = 5,
    lr: float = 0.02,
    hyper_max_instances: int = 20000,
    bags_per_batch: int | None = None,
    schedule: Callable[[int], float] | None = None,
    rho0: float = 0.5,
    rho_max: float = 1.0,
    chunk_instances: int = 32768,
    block_budget: int = 2_000_000,
    cache_entries: int = 50_000_000,
    min_iter: int = 3,
    seed: int = 0,
    progress: bool = False,
    callback: Callable[[int, float], None] | None = None,
) -> FitResult:
    """Fit ``q(v)`` (natural steps) and the hyperparameters (Adam) of a VBAgg model.

    Args:
        batch: all training bags: ``x (N, D)``, ``bag_index (N,)``, ``bag_labels`` = ``y (B,)``,
            ``instance_weights`` = populations ``(N,)`` (``None`` = ones).
        max_iter: iterations (full batch) or epochs (``bags_per_batch`` set).
        tol: stop when the relative ELBO change stays below ``tol`` for two iterations.
        rho0, rho_max: initial and largest natural step (non-conjugate likelihoods; positive).
        bags_per_batch: minibatches of whole bags with Robbins–Monro steps ``schedule``
            (default :class:`~milgp.variational.natural_update.RobbinsMonro` ``τ = 1, κ = 0.6``; values in
            ``(0, 1]``) scaled by ``rho_max``; a step that
            lowers the minibatch's unbiased ELBO estimate ``(B / B_mb) Σ_{a∈mb} bag_terms − KL`` is
            halved until it does not (conjugate models with the whole data in one batch: exact step).
        chunk_instances, block_budget: memory bounds of one chunk of bags (module docstring).
        cache_entries: keep the q-independent projections/kernel blocks of all chunks between
            hyperparameter steps when they fit in this many floats (else recompute per pass).
    """
    strategy = ClosedFormStrategy.of(model)  # a one-line TypeError for a model on another strategy
    strategy.check_batch(batch)
    likelihood.check_data(batch.bag_labels, _weights(batch), batch.bags)
    steps = AggregateSteps(
        strategy, likelihood, batch, rho=rho0, rho_max=rho_max, chunk_instances=chunk_instances,
        block_budget=block_budget, cache_entries=cache_entries,
    )
    params = list(strategy.hyperparameters()) + list(likelihood.parameters())
    optimizer = torch.optim.Adam(params, lr=lr) if learn_hyperparameters and params else None
    return fit_loop(
        steps, max_iter=max_iter, tol=tol, min_iter=min_iter, optimizer=optimizer, hyper_steps=hyper_steps,
        hyper_max_instances=hyper_max_instances, bags_per_batch=bags_per_batch, schedule=schedule, seed=seed,
        progress=progress, callback=callback, desc="vbagg",
    )


def _predictive_groups(
    strategy: ClosedFormStrategy, x: Tensor, bags: Bags, weights: Tensor, chunk_instances: int, block_budget: int
) -> Iterator[tuple[BagGroup, Tensor, Tensor, Projection]]:
    """The bags group by group of similar-sized bags within the memory bounds: ``(group, its
    inputs, its weights, their projection)``."""
    L = strategy.inducing_cholesky()
    for g in bags.groups(chunk_instances, block_budget):
        xg = x[g.inst]
        yield g, xg, weights[g.inst], strategy.projection(xg, L)


def _long_bag_rate_moments(
    strategy: ClosedFormStrategy, likelihood: AggregateLikelihood, x: Tensor, w: Tensor, proj: Projection,
    q: WhitenedPosterior, tile: int,
) -> tuple[Tensor, Tensor]:
    """Mean and variance of ``η = Σ w_i Ψ(f_i)`` over one bag's instances ``x`` ``(n, D)``, its
    covariance taken in ``tile × tile`` pieces (the upper triangle of tiles, each used once and
    dropped): ``O(n²)`` time, ``O(n · tile)`` memory, the same sums as the dense block."""
    mean, var = strategy.marginals(proj, q)
    rate_var = x.new_zeros(())
    starts = range(0, x.shape[0], tile)
    for i, r0 in enumerate(starts):
        r = slice(r0, r0 + tile)
        for c0 in starts[i:]:
            c = slice(c0, c0 + tile)
            cov = strategy.cross_covariance(x[r], x[c], proj.A[:, r], proj.A[:, c], q)
            if c0 == r0:
                cov.diagonal().copy_(var[r])  # the marginal variances, jitter included
            part = w[r] @ likelihood.rate_covariance(mean[r], var[r], mean[c], var[c], cov) @ w[c]
            rate_var = rate_var + (part if c0 == r0 else 2 * part)
    return (w * likelihood.link.mean(mean, var)).sum(), rate_var.clamp_min(0)


def predict_bag_moments(
    model: ApproximateGP,
    likelihood: AggregateLikelihood,
    x: Tensor,
    bags: Bags,
    weights: Tensor | None = None,
    chunk_instances: int = 32768,
    block_budget: int = 2_000_000,
) -> dict[str, Tensor]:
    """Bag-level predictive moments ``(B,)`` under the joint ``q(f_b)`` of each of the bags ``bags``
    of the inputs ``x`` ``(N, D)``.

    Returns ``rate_mean``/``rate_var`` of ``η_a = Σ w_i Ψ(f_i)`` (full within-bag covariance) and
    ``y_mean``/``y_var`` of the observed aggregate (:meth:`AggregateLikelihood.observation_moments`).
    Bags are taken in groups within ``chunk_instances`` and ``block_budget``; a bag whose ``n²``
    exceeds ``block_budget`` is summed tile by tile, never as one ``n × n`` block.
    """
    weights = weights_or_ones(weights, x[:, 0])
    bag_index, num_bags = bags.index, bags.num_bags
    rate_mean = x.new_zeros(num_bags)
    rate_var = x.new_zeros(num_bags)
    strategy = ClosedFormStrategy.of(model)
    q = strategy.whitened_posterior()
    with torch.no_grad():
        for g, xg, wg, proj in _predictive_groups(strategy, x, bags, weights, chunk_instances, block_budget):
            if g.num_bags == 1 and xg.shape[0] ** 2 > block_budget:  # one bag longer than a dense block allows
                mu, var = _long_bag_rate_moments(strategy, likelihood, xg, wg, proj, q, math.isqrt(block_budget))
            else:
                mu, var = likelihood.bag_rate_moments(bag_blocks(model, xg, proj, g.local_bags, q.m, q.S, wg, kernel_grad=False))
            rate_mean[g.bags] = mu
            rate_var[g.bags] = var
        w_sq = segment_sum(weights * weights, bag_index, num_bags)
        y_mean, y_var = likelihood.observation_moments(rate_mean, rate_var, w_sq)
    return {"rate_mean": rate_mean, "rate_var": rate_var, "y_mean": y_mean, "y_var": y_var}


def bag_log_predictive(
    model: ApproximateGP,
    likelihood: AggregateLikelihood,
    x: Tensor,
    bags: Bags,
    y: Tensor,
    weights: Tensor | None = None,
    *,
    samples: int = 256,
    generator: torch.Generator | None = None,
    chunk_instances: int = 32768,
    block_budget: int = 2_000_000,
    moments: dict[str, Tensor] | None = None,
) -> Tensor:
    """Predictive log-likelihood ``log p(y_a | data)`` of each bag's observed aggregate ``(B,)``.

    Conjugate models (Normal): exact, ``y_a | data ~ N(E[η_a], Var[η_a] + τ Σ w_i²)`` from
    :func:`predict_bag_moments` (pass its result as ``moments`` to reuse it). Otherwise a
    Monte-Carlo average of :meth:`AggregateLikelihood.log_prob_given_rate` over ``samples`` draws
    of the joint ``q(f_b)`` of each bag (in log space), drawn from ``generator``.
    """
    weights = weights_or_ones(weights, x[:, 0])
    y = y.to(x)
    if likelihood.conjugate:
        moments = moments or predict_bag_moments(model, likelihood, x, bags, weights, chunk_instances, block_budget)
        var_y = moments["y_var"].clamp_min(1e-300)
        return -0.5 * (math.log(2 * math.pi) + torch.log(var_y) + (y - moments["y_mean"]) ** 2 / var_y)
    w_sq = segment_sum(weights * weights, bags.index, bags.num_bags)
    out = x.new_empty(bags.num_bags)
    strategy = ClosedFormStrategy.of(model)
    q = strategy.whitened_posterior()
    with torch.no_grad():
        for g, xg, wg, proj in _predictive_groups(strategy, x, bags, weights, chunk_instances, block_budget):
            blocks = bag_blocks(model, xg, proj, g.local_bags, q.m, q.S, wg, kernel_grad=False)
            chol = robust_cholesky(blocks.cov, what="within-bag covariance of q(f_b)")
            B_g, n = blocks.mean.shape
            per = max(1, 4_000_000 // max(1, B_g * n * n))  # draws per pass: bounded memory
            parts = []
            for s0 in range(0, max(1, samples), per):
                s = min(per, max(1, samples) - s0)
                eps = torch.randn((s, B_g, n, 1), generator=generator, dtype=x.dtype, device=x.device)
                f = blocks.mean + (chol @ eps).squeeze(-1)
                rate = (blocks.weights * likelihood.link(f)).sum(-1).clamp_min(1e-300)  # (s, B_g)
                parts.append(likelihood.log_prob_given_rate(y[g.bags], rate, w_sq[g.bags]))
            lp = torch.cat(parts)
            out[g.bags] = torch.logsumexp(lp, 0) - math.log(lp.shape[0])
    return out
