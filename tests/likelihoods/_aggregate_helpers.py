"""Small shared fixtures for the aggregate-likelihood tests (float64, tiny sizes)."""
from __future__ import annotations

import torch

from milgp.data.bags import BagBatch, bag_index_from_sizes
from milgp.models.closed_form_strategy import WhitenedPosterior
from milgp.models.sparse_gp import SparseGP
from milgp.variational.aggregate_fit import AggregateSteps


def random_model(dim: int = 2, num_inducing: int = 6, seed: int = 0, constant_mean: bool = True, natural: bool = True) -> SparseGP:
    g = torch.Generator().manual_seed(seed)
    Z = torch.randn(num_inducing, dim, generator=g, dtype=torch.float64)
    model = SparseGP(Z, constant_mean=constant_mean, natural=natural, lengthscale=1.3, outputscale=0.8)
    if constant_mean:
        model.mean_module.constant.data.fill_(0.3)
    return model


def random_posterior(M: int, seed: int = 1, scale: float = 0.5) -> WhitenedPosterior:
    g = torch.Generator().manual_seed(seed)
    m = scale * torch.randn(M, generator=g, dtype=torch.float64)
    R = torch.randn(M, M, generator=g, dtype=torch.float64) / M**0.5
    S = 0.3 * R @ R.mT + 0.2 * torch.eye(M, dtype=torch.float64)
    return WhitenedPosterior(m=m, S=S, precision=torch.linalg.inv(S))


def random_bags(sizes: list[int], dim: int = 2, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    bag_index = bag_index_from_sizes(sizes)
    x = torch.randn(len(bag_index), dim, generator=g, dtype=torch.float64)
    return x, bag_index


def dense_posterior(model: SparseGP, x: torch.Tensor, q: WhitenedPosterior) -> tuple[torch.Tensor, torch.Tensor]:
    """The full N×N q(f) by the textbook formula (small N only): the reference for blocks."""
    with torch.no_grad():
        L = model.variational_strategy.inducing_cholesky()
        Kzx = model.covar_module(model.variational_strategy.inducing_points, x).to_dense()
        A = torch.linalg.solve_triangular(L, Kzx, upper=False)
        K = model.covar_module(x).to_dense() + model.variational_strategy.jitter * torch.eye(x.shape[0], dtype=x.dtype)
        mean = model.mean_module(x) + A.mT @ q.m
        cov = K - A.mT @ A + A.mT @ q.S @ A
    return mean, 0.5 * (cov + cov.mT)


def make_batch(x, bag_index, y, weights=None) -> BagBatch:
    return BagBatch(x, bag_index, y, instance_weights=weights)


def steps_of(model: SparseGP, likelihood, batch: BagBatch) -> AggregateSteps:
    """The :class:`AggregateSteps` of ``model`` and ``likelihood`` on ``batch``: its methods are the
    aggregate objective's terms, ELBO and natural statistics."""
    return AggregateSteps(model.variational_strategy, likelihood, batch)
