"""The GP-MIL head as a plain ``nn.Module`` (float64): standardisation, sparse GP, bag likelihood.

Wraps :class:`milgp.models.SparseGP` and any :class:`milgp.likelihoods.AugmentedBagLikelihood`
with what a trainer needs around them:

* feature standardisation buffers (``feature_mean``, ``feature_scale``), inducing points and the
  initial lengthscale set once from training features (:meth:`GPHead.initialize`: z-scores,
  k-means++ split between positive and negative bags, median heuristic);
* the closed-form natural step of q(v) from additive :class:`NaturalStatistics`, with a hook to
  all-reduce them (DDP) before the step (:meth:`GPHead.natural_update`);
* the hyperparameter objective with q(v) and the locals fixed (:meth:`GPHead.hyper_objective`);
* predictions with uncertainty for instances and bags (:meth:`GPHead.predict`).

Everything here runs in float64; callers cast features with :meth:`GPHead.standardize`.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor, nn

from milgp.data.bags import segment_sum
from milgp.inducing import kmeans_pp_inducing, median_lengthscale
from milgp.likelihoods.base import AugmentedBagLikelihood
from milgp.likelihoods.mil_bernoulli import MILBernoulliLikelihood
from milgp.models.sparse_gp import SparseGP, WhitenedPosterior
from milgp.variational.natural_update import NaturalStatistics, natural_statistics, natural_step

__all__ = ["GPHead"]

_BAG_RULES = ("noisy_or", "max", "joint")


def _reset_position_cache(likelihood: Any) -> None:
    # MILBernoulliLikelihood caches within-bag positions keyed by (data_ptr, numel) of bag_index;
    # with fresh minibatch tensors the allocator may reuse an address for a different bag layout,
    # so the cache is dropped before every call from here.
    if hasattr(likelihood, "_positions_cache"):
        likelihood._positions_cache = None


class GPHead(nn.Module):
    """Sparse-GP bag classifier on ``D``-dimensional instance features.

    Args:
        feature_dim: D.
        num_inducing: M.
        likelihood: any :class:`AugmentedBagLikelihood`; default VGPMIL
            (:class:`MILBernoulliLikelihood` with ``psi="pg"``, H = 100).
        ard: one lengthscale per feature.
        learn_inducing_locations: make Z trainable.
        constant_mean: constant instead of zero GP mean.
        standardize: z-score features with training statistics.
        lengthscale: initial RBF lengthscale (``None``: median pairwise distance of the
            standardised training features).
        outputscale: initial kernel variance.
        bag_rule: bag prediction ``"noisy_or"`` (seed 000 Eq. 34), ``"max"`` or ``"joint"``.
        seed: k-means++ and sampling seed.
    """

    def __init__(
        self,
        feature_dim: int,
        num_inducing: int = 64,
        likelihood: AugmentedBagLikelihood | None = None,
        ard: bool = False,
        learn_inducing_locations: bool = False,
        constant_mean: bool = False,
        standardize: bool = True,
        lengthscale: float | None = None,
        outputscale: float = 1.0,
        bag_rule: str = "noisy_or",
        seed: int = 0,
    ):
        super().__init__()
        if bag_rule not in _BAG_RULES:
            raise ValueError(f"bag_rule must be one of {_BAG_RULES}, got {bag_rule!r}")
        gen = torch.Generator().manual_seed(seed)
        Z0 = torch.randn(num_inducing, feature_dim, generator=gen, dtype=torch.float64)
        self.gp = SparseGP(
            Z0, ard=ard, constant_mean=constant_mean, learn_inducing_locations=learn_inducing_locations,
            natural=True, lengthscale=1.0 if lengthscale is None else lengthscale, outputscale=outputscale,
        )
        for p in self.gp.variational_parameters():  # q(v) is updated in closed form only
            p.requires_grad_(False)
        self.likelihood = likelihood if likelihood is not None else MILBernoulliLikelihood(psi="pg", H=100.0)
        self.likelihood.to(torch.float64)
        self.register_buffer("feature_mean", torch.zeros(feature_dim, dtype=torch.float64))
        self.register_buffer("feature_scale", torch.ones(feature_dim, dtype=torch.float64))
        self.register_buffer("initialized", torch.tensor(False))
        self.feature_dim = feature_dim
        self.num_inducing = num_inducing
        self.standardize_features = standardize
        self.init_lengthscale = lengthscale
        self.bag_rule = bag_rule
        self.seed = seed

    # -- set-up ----------------------------------------------------------------------------------
    @torch.no_grad()
    def initialize(self, features: Tensor, instance_bag_labels: Tensor) -> None:
        """Standardisation statistics, inducing points (k-means++, half on instances of positive
        bags) and the initial lengthscale from training features ``(N, D)``; q(v) reset to the prior."""
        x = features.detach().to(torch.float64).cpu()
        if self.standardize_features:
            mean, scale = x.mean(0), x.std(0, unbiased=False)
            scale = torch.where(scale > 1e-12, scale, torch.ones_like(scale))
            self.feature_mean.copy_(mean)
            self.feature_scale.copy_(scale)
        z = ((x - self.feature_mean.cpu()) / self.feature_scale.cpu()).numpy()
        labels = instance_bag_labels.detach().cpu().numpy()
        M = self.num_inducing
        Z = kmeans_pp_inducing(z, labels, M, seed=self.seed)
        if len(Z) < M:  # fewer training instances than inducing points
            rng = np.random.default_rng(self.seed)
            Z = np.concatenate([Z, Z[rng.integers(len(Z), size=M - len(Z))] + 1e-3 * rng.standard_normal((M - len(Z), Z.shape[1]))])
        device = self.feature_mean.device
        self.gp.variational_strategy.inducing_points.data.copy_(torch.as_tensor(Z, dtype=torch.float64, device=device))
        ls = self.init_lengthscale if self.init_lengthscale is not None else median_lengthscale(z, seed=self.seed)
        self.gp.covar_module.base_kernel.lengthscale = ls
        self.reset_posterior()
        self.initialized.fill_(True)

    def reset_posterior(self) -> None:
        """q(v) ← N(0, I)."""
        M = self.num_inducing
        dev = self.feature_mean.device
        eye = torch.eye(M, dtype=torch.float64, device=dev)
        self.gp.set_whitened_posterior(WhitenedPosterior(m=torch.zeros(M, dtype=torch.float64, device=dev), S=eye, precision=eye.clone()))

    @torch.no_grad()
    def update_standardization(self, h: Tensor, momentum: float, reduce: Callable[[Tensor], Tensor] | None = None) -> None:
        """Exponential moving average of the standardisation statistics towards those of the
        features ``h`` ``(N, D)`` (end-to-end training, where the CNN's features drift).

        ``reduce`` sums ``[count, Σh, Σh²]`` over DDP ranks so every rank keeps the same statistics.
        """
        if not self.standardize_features or momentum <= 0:
            return
        h = h.detach().to(torch.float64)
        packed = torch.cat([h.new_tensor([h.shape[0]]), h.sum(0), (h * h).sum(0)])
        if reduce is not None:
            packed = reduce(packed)
        D = h.shape[1]
        n, s1, s2 = packed[0], packed[1 : 1 + D], packed[1 + D :]
        mean = s1 / n
        var = (s2 / n - mean * mean).clamp_min(0)
        self.feature_mean.mul_(1 - momentum).add_(momentum * mean)
        new_var = (1 - momentum) * self.feature_scale**2 + momentum * var
        self.feature_scale.copy_(new_var.sqrt().clamp_min(1e-8))

    def hyperparameters(self) -> list[nn.Parameter]:
        """Kernel (and mean, and Z when learned) parameters: everything Adam may update."""
        return [p for p in self.gp.hyperparameters() if p.requires_grad] + [p for p in self.likelihood.parameters() if p.requires_grad]

    # -- computations ----------------------------------------------------------------------------
    def standardize(self, h: Tensor) -> Tensor:
        """Features ``(N, D)`` (any float dtype) → standardised float64."""
        return (h.to(torch.float64) - self.feature_mean) / self.feature_scale

    def posterior(self) -> WhitenedPosterior:
        return self.gp.whitened_posterior()

    def moments(self, z: Tensor, q: WhitenedPosterior | None = None) -> tuple[Tensor, Tensor]:
        """``q(f_n)`` mean and variance ``(N,)`` of standardised features; differentiable in ``z``
        and the hyperparameters (q(v) fixed)."""
        q = self.posterior() if q is None else q
        return self.gp.marginals(self.gp.projection(z), q)

    def initial_locals(self, mean: Tensor, var: Tensor, bag_index: Tensor, bag_labels: Tensor, num_bags: int) -> Any:
        _reset_position_cache(self.likelihood)
        return self.likelihood.init_locals(bag_index, bag_labels.to(mean.dtype), num_bags, mean)

    @torch.no_grad()
    def natural_update(
        self,
        z: Tensor,
        bag_index: Tensor,
        bag_labels: Tensor,
        num_bags: int,
        locals_: Any,
        rho: float = 1.0,
        scale: float = 1.0,
        reduce: Callable[[NaturalStatistics], NaturalStatistics] | None = None,
    ) -> tuple[WhitenedPosterior, Any]:
        """One closed-form natural step of q(v) on standardised features ``z`` (detached), then the
        locals' closed-form update under the new q(f).

        ``locals_`` are the current locals of these instances (``None``: initialised from the
        current q(f)). ``reduce`` maps this process's statistics to the global ones (the DDP
        all-reduce); ``scale`` = training bags / bags in the (global) batch.

        Returns:
            ``(new q(v), new locals)``.
        """
        z = z.detach()
        labels = bag_labels.to(torch.float64)
        q = self.posterior()
        L = self.gp.inducing_cholesky()
        proj = self.gp.projection(z, L)
        mean, var = self.gp.marginals(proj, q)
        if locals_ is None:
            locals_ = self.initial_locals(mean, var, bag_index, labels, num_bags)
        b, lam = self.likelihood.quadratic_terms(mean, var, bag_index, labels, num_bags, locals_)
        stats = natural_statistics(proj.A, b, lam, proj.prior_mean)
        if reduce is not None:
            stats = reduce(stats)
        q = natural_step(q, stats, rho=rho, scale=scale)
        self.gp.set_whitened_posterior(q)
        mean, var = self.gp.marginals(proj, q)
        _reset_position_cache(self.likelihood)
        locals_ = self.likelihood.update_locals(mean, var, bag_index, labels, num_bags, locals_)
        return q, locals_

    def hyper_objective(self, z: Tensor, bag_index: Tensor, bag_labels: Tensor, num_bags: int, locals_: Any) -> Tensor:
        """``Σ_n`` of the likelihood's hyperparameter terms (the ELBO's data part with q(v) and the
        locals fixed; ``KL(q(v) ‖ N(0, I))`` does not depend on the hyperparameters when whitened).
        Differentiable in ``z`` (the CNN) and the kernel hyperparameters."""
        mean, var = self.moments(z)
        return self.likelihood.hyperparameter_terms(mean, var, bag_index, bag_labels.to(torch.float64), num_bags, locals_).sum()

    @torch.no_grad()
    def elbo(self, z: Tensor, bag_index: Tensor, bag_labels: Tensor, num_bags: int, locals_: Any) -> float:
        """The closed-form ELBO on these bags (data terms at ``locals_`` minus KL)."""
        q = self.posterior()
        mean, var = self.moments(z, q)
        data = self.likelihood.elbo_terms(mean, var, bag_index, bag_labels.to(torch.float64), num_bags, locals_).sum()
        return float(data - q.kl_divergence())

    def clear_caches(self) -> None:
        """Clear GPyTorch's variational caches (after kernel hyperparameters changed)."""
        self.gp.variational_strategy._clear_cache()

    @torch.no_grad()
    def predict(self, z: Tensor, bag_index: Tensor, num_bags: int, num_samples: int = 256) -> dict[str, Tensor]:
        """Instance and bag predictions with standard deviations.

        Returns:
            ``{"mean", "var", "instance_prob", "instance_std"}`` ``(N,)`` and ``{"bag_prob",
            "bag_std"}`` ``(B,)``. Uses the likelihood's own prediction methods when it has them
            (``instance_probability``, ``bag_probability_noisy_or``/``_max``/``_joint``), else
            Monte Carlo through ``likelihood(f)`` (a Bernoulli) with the noisy-OR bag rule.
        """
        z = z.to(torch.float64)
        q = self.posterior()
        mean, var = self.moments(z, q)
        lik = self.likelihood
        out = {"mean": mean, "var": var}
        gen = torch.Generator(device=z.device).manual_seed(self.seed)
        if hasattr(lik, "instance_probability"):
            p, s = lik.instance_probability(mean, var)
        else:
            f = mean + var.sqrt() * torch.randn((num_samples,) + mean.shape, generator=gen, dtype=mean.dtype, device=mean.device)
            pf = lik(f).probs
            p, s = pf.mean(0), pf.std(0)
        out["instance_prob"], out["instance_std"] = p, s
        if self.bag_rule == "joint" and hasattr(lik, "bag_probability_joint"):
            mean_pad, cov_pad, mask = self.gp.bag_covariances(z, bag_index, num_bags, q)
            bp, bs = lik.bag_probability_joint(mean_pad, cov_pad, mask, generator=gen)
        elif self.bag_rule == "max" and hasattr(lik, "bag_probability_max"):
            bp, bs = lik.bag_probability_max(mean, var, bag_index, num_bags)
        elif hasattr(lik, "bag_probability_noisy_or"):
            bp, bs = lik.bag_probability_noisy_or(mean, var, bag_index, num_bags)
        elif hasattr(lik, "bag_probability"):
            bp, bs = lik.bag_probability(mean, var, bag_index, num_bags)
        else:
            f = mean + var.sqrt() * torch.randn((num_samples,) + mean.shape, generator=gen, dtype=mean.dtype, device=mean.device)
            log_neg = torch.log1p(-lik(f).probs.clamp(max=1 - 1e-12))
            pb = -torch.expm1(segment_sum(log_neg.mT, bag_index, num_bags).mT)
            bp, bs = pb.mean(0), pb.std(0)
        out["bag_prob"], out["bag_std"] = bp, bs
        return out
