"""Algorithm 1 of seed 000, generalised to any :class:`AugmentedBagLikelihood`.

One iteration (full batch):

1. the local quadratic coefficients ``(b, λ)`` from the current ``q(f)`` (e.g. ``θ = θ_ψ(c)``);
2. the closed-form natural update of ``q(v)`` (ρ = 1: CAVI, :mod:`milgp.variational.natural_update`);
3. the closed-form update of the persistent locals (e.g. ``q(y)``) given the new ``q(f)``;
4. optionally, gradient steps (Adam) on the kernel hyperparameters (and inducing locations) on the
   closed-form ELBO with ``q(v)`` and the locals held fixed.

With ``bags_per_batch`` set, each step uses a minibatch of whole bags: statistics are scaled by
``s = B / B_batch`` and mixed with a Robbins–Monro step size (stochastic natural gradient).
Hyperparameter steps always use a random subset of at most ``hyper_max_instances`` instances
(whole bags) so memory stays bounded for large N; the ELBO is rescaled accordingly.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor
from tqdm.auto import tqdm

from milgp.data.bags import BagBatch, bag_sizes
from milgp.likelihoods.base import AugmentedBagLikelihood
from milgp.models.sparse_gp import SparseGP, WhitenedPosterior
from milgp.variational.natural_update import NaturalStatistics, RobbinsMonro, natural_statistics, natural_step

__all__ = ["FitResult", "closed_form_elbo", "fit_closed_form"]


@dataclass
class FitResult:
    """What :func:`fit_closed_form` returns.

    Attributes:
        elbo: ELBO after each iteration (full batch) or epoch (minibatch).
        converged: whether the relative ELBO change fell below ``tol``.
        iterations: iterations (full batch) or epochs run.
        seconds: wall time.
        locals: the persistent locals at the end (e.g. ``π`` ``(N,)`` for VGPMIL).
    """

    elbo: list[float] = field(default_factory=list)
    converged: bool = False
    iterations: int = 0
    seconds: float = 0.0
    locals: Any = None


def _moments(model: SparseGP, x: Tensor, q: WhitenedPosterior, chunk_size: int) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        L = model.inducing_cholesky()
        parts = [model.marginals(model.projection(x[s : s + chunk_size], L), q) for s in range(0, x.shape[0], chunk_size)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _statistics(
    model: SparseGP, x: Tensor, b: Tensor, lam: Tensor, chunk_size: int
) -> NaturalStatistics:
    with torch.no_grad():
        L = model.inducing_cholesky()
        stats = None
        for s in range(0, x.shape[0], chunk_size):
            proj = model.projection(x[s : s + chunk_size], L)
            part = natural_statistics(proj.A, b[s : s + chunk_size], lam[s : s + chunk_size], proj.prior_mean)
            stats = part if stats is None else stats + part
    return stats


def closed_form_elbo(
    model: SparseGP,
    likelihood: AugmentedBagLikelihood,
    batch: BagBatch,
    locals_: Any,
    chunk_size: int = 65536,
) -> float:
    """The closed-form ELBO (data terms at ``locals_`` minus ``KL(q(v) ‖ N(0, I))``)."""
    q = model.whitened_posterior()
    mean, var = _moments(model, batch.x, q, chunk_size)
    with torch.no_grad():
        data = likelihood.elbo_terms(mean, var, batch.bag_index, batch.bag_labels, batch.num_bags, locals_).sum()
        return float(data - q.kl_divergence())


def _hyper_step(
    model: SparseGP,
    likelihood: AugmentedBagLikelihood,
    batch: BagBatch,
    locals_: Any,
    optimizer: torch.optim.Optimizer,
    scale: float,
    q: WhitenedPosterior,
) -> None:
    optimizer.zero_grad(set_to_none=True)
    proj = model.projection(batch.x)
    mean, var = model.marginals(proj, q)
    data = likelihood.hyperparameter_terms(mean, var, batch.bag_index, batch.bag_labels, batch.num_bags, locals_).sum()
    loss = -scale * data / max(1, batch.num_instances)
    loss.backward()
    optimizer.step()


def _subset_locals(locals_: Any, idx: Tensor) -> Any:
    return locals_[idx] if isinstance(locals_, Tensor) and locals_.ndim == 1 else locals_


def _bag_subset(batch: BagBatch, max_instances: int, generator: torch.Generator) -> tuple[BagBatch, Tensor, float]:
    """Random whole bags holding at most ``max_instances`` instances; returns the sub-batch, the
    original instance indices, and the scale ``N / N_sub``."""
    if batch.num_instances <= max_instances:
        return batch, torch.arange(batch.num_instances, device=batch.x.device), 1.0
    sizes = bag_sizes(batch.bag_index, batch.num_bags)
    order = torch.randperm(batch.num_bags, generator=generator).to(sizes.device)
    keep = order[torch.cumsum(sizes[order], 0) <= max_instances]
    if keep.numel() == 0:
        keep = order[:1]
    sub, idx = _select(batch, keep)
    return sub, idx, batch.num_instances / max(1, sub.num_instances)


def fit_closed_form(
    model: SparseGP,
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
) -> FitResult:
    """Fit ``model``'s q(v), the locals and (optionally) the hyperparameters on ``batch``.

    Args:
        batch: all training bags (``x`` ``(N, D)``, ``bag_index``, ``bag_labels``), on the model's
            device and dtype.
        max_iter: iterations (full batch) or epochs (``bags_per_batch`` set).
        tol: stop when the relative ELBO change is below ``tol`` for two iterations in a row
            (hyperparameter learning makes later changes small but not zero).
        bags_per_batch: ``None`` for full-batch CAVI; otherwise stochastic natural steps on
            minibatches of that many bags with step sizes from ``schedule`` (default
            :class:`RobbinsMonro` ``τ = 1, κ = 0.6``).
        callback: called as ``callback(iteration, elbo)``.
    """
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    result = FitResult()
    B, N = batch.num_bags, batch.num_instances
    optimizer = torch.optim.Adam(model.hyperparameters(), lr=lr) if learn_hyperparameters else None
    q = model.whitened_posterior()
    mean, var = _moments(model, batch.x, q, chunk_size)
    locals_ = likelihood.init_locals(batch.bag_index, batch.bag_labels, B, mean)
    schedule = schedule or RobbinsMonro()
    step_t = 0
    quiet = 0
    bar = tqdm(range(max_iter), disable=not progress, desc="fit", leave=False)
    for it in bar:
        if bags_per_batch is None:
            b, lam = likelihood.quadratic_terms(mean, var, batch.bag_index, batch.bag_labels, B, locals_)
            q = natural_step(q, _statistics(model, batch.x, b, lam, chunk_size), rho=1.0)
            model.set_whitened_posterior(q)
            mean, var = _moments(model, batch.x, q, chunk_size)
            locals_ = likelihood.update_locals(mean, var, batch.bag_index, batch.bag_labels, B, locals_)
        else:
            order = torch.randperm(B, generator=generator)
            for s in range(0, B, bags_per_batch):
                bags = order[s : s + bags_per_batch].to(batch.bag_index.device)
                mb, idx = _select(batch, bags)
                mb_mean, mb_var = _moments(model, mb.x, q, chunk_size)
                mb_locals = _subset_locals(locals_, idx)
                b, lam = likelihood.quadratic_terms(mb_mean, mb_var, mb.bag_index, mb.bag_labels, mb.num_bags, mb_locals)
                q = natural_step(q, _statistics(model, mb.x, b, lam, chunk_size), rho=schedule(step_t), scale=B / mb.num_bags)
                step_t += 1
                model.set_whitened_posterior(q)
                mb_mean, mb_var = _moments(model, mb.x, q, chunk_size)
                new_locals = likelihood.update_locals(mb_mean, mb_var, mb.bag_index, mb.bag_labels, mb.num_bags, mb_locals)
                if isinstance(locals_, Tensor) and locals_.ndim == 1:
                    locals_[idx] = new_locals
                if optimizer is not None:
                    for _ in range(hyper_steps):
                        _hyper_step(model, likelihood, mb, new_locals, optimizer, 1.0, q)
            mean, var = _moments(model, batch.x, q, chunk_size)
        if optimizer is not None and bags_per_batch is None:
            for _ in range(hyper_steps):
                sub, idx, scale = _bag_subset(batch, hyper_max_instances, generator)
                _hyper_step(model, likelihood, sub, _subset_locals(locals_, idx), optimizer, 1.0, q)
            model.set_whitened_posterior(q)  # clears GPyTorch's caches after the kernel changed
            mean, var = _moments(model, batch.x, q, chunk_size)
        with torch.no_grad():
            elbo = float(likelihood.elbo_terms(mean, var, batch.bag_index, batch.bag_labels, B, locals_).sum() - q.kl_divergence())
        if not math.isfinite(elbo):
            raise FloatingPointError(
                f"the ELBO became {elbo} at iteration {it}; check the features for extreme values "
                "or lower the hyperparameter learning rate"
            )
        prev = result.elbo[-1] if result.elbo else None
        result.elbo.append(elbo)
        bar.set_postfix(elbo=f"{elbo:.4g}")
        if callback is not None:
            callback(it, elbo)
        if prev is not None and abs(elbo - prev) <= tol * max(1.0, abs(prev)):
            quiet += 1
            if quiet >= 2 and it + 1 >= min_iter:
                result.converged = True
                break
        else:
            quiet = 0
    result.iterations = len(result.elbo)
    result.seconds = time.perf_counter() - start
    result.locals = locals_
    return result


def _select(batch: BagBatch, bags: Tensor) -> tuple[BagBatch, Tensor]:
    """Sub-batch of ``bags`` and the original indices of its instances (in its order)."""
    remap = torch.full((batch.num_bags,), -1, dtype=torch.long, device=batch.bag_index.device)
    remap[bags] = torch.arange(len(bags), device=bags.device)
    new_index = remap[batch.bag_index]
    members = torch.nonzero(new_index >= 0, as_tuple=True)[0]
    idx = members[torch.argsort(new_index[members], stable=True)]
    return batch.select_bags(bags), idx
