"""A whitened GPyTorch variational strategy that also serves the closed-form natural steps.

:class:`ClosedFormStrategy` is GPyTorch's whitened ``VariationalStrategy`` — ``q(v) = N(m, S)``
over ``v = L⁻¹(u − mean(Z))`` with ``K_zz + jitter·I = L Lᵀ`` (Hensman, Matthews and Ghahramani,
*Scalable Variational Gaussian Process Classification*, AISTATS 2015) — so a model built on it
works with ``gpytorch.mlls.VariationalELBO``, Adam and ``gpytorch.optim.NGD`` as before. It adds,
for *any* ``ApproximateGP`` that uses it and without ``N×N`` matrices, what the closed-form updates
of the bag likelihoods need: projections, ``q(v)`` read and written, marginals and per-bag blocks
of ``q(f)``, and the :meth:`~ClosedFormStrategy.natural_step` (:func:`milgp.variational.fit_closed_form`
trains it; example: README, "Your own model, closed-form steps"). The jitter is GPyTorch's own
(``jitter_val``), so the fast path and GPyTorch's predictions agree exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import gpytorch
import torch
from torch import Tensor

from milgp.data.bags import BagBatch, Bags, identity_padded, to_padded
from milgp.likelihoods.natural_statistics import NaturalStatistics
from milgp.linalg import cholesky_inverse_from_precision, robust_cholesky

__all__ = ["ClosedFormStrategy", "Projection", "WhitenedPosterior"]

_MARGINAL_BLOCK = 512
"""Instances per triangular solve in :meth:`ClosedFormStrategy.marginals` on the CPU (an ``M × 512`` block stays in cache)."""


@dataclass
class Projection:
    """Whitened projection of a set of inputs onto the inducing variables.

    Attributes:
        A: ``(M, N)`` ``L⁻¹ K_zx``.
        prior_var: ``(N,)`` ``k(x_n, x_n) + jitter``.
        prior_mean: ``(N,)`` the GP mean function at ``x_n``.
    """

    A: Tensor
    prior_var: Tensor
    prior_mean: Tensor
    residual: Tensor | None = None
    """``(N,)`` ``k(x_n, x_n) + jitter − ‖A_n‖²`` (the variance the inducing points do not explain),
    when already computed (a cache reuses it across sweeps)."""

    def with_residual(self) -> "Projection":
        """This projection with :attr:`residual` computed (no gradients)."""
        if self.residual is not None:
            return self
        with torch.no_grad():
            return Projection(self.A, self.prior_var, self.prior_mean, self.prior_var - (self.A * self.A).sum(0))


@dataclass
class WhitenedPosterior:
    """``q(v) = N(m, S)`` over the whitened inducing values ``v = L⁻¹(u − mean(Z))``.

    Attributes:
        m: ``(M,)`` mean.
        S: ``(M, M)`` covariance.
        precision: ``(M, M)`` ``S⁻¹``.
    """

    m: Tensor
    S: Tensor
    precision: Tensor
    chol_precision: Tensor | None = field(default=None, repr=False, compare=False)
    """Lower Cholesky factor of ``precision`` when already known (saves a factorisation)."""

    @property
    def natural(self) -> tuple[Tensor, Tensor]:
        """Natural parameters ``(η₁, η₂) = (S⁻¹m, −½S⁻¹)``."""
        return self.precision @ self.m, -0.5 * self.precision

    def kl_divergence(self) -> Tensor:
        """``KL(N(m, S) ‖ N(0, I)) = ½ (tr S + mᵀm − M − log|S|)``."""
        L_P = self.chol_precision if self.chol_precision is not None else robust_cholesky(self.precision, what="q(v) precision")
        logdet_S = -2.0 * torch.log(torch.diagonal(L_P)).sum()
        M = self.m.shape[0]
        return 0.5 * (torch.diagonal(self.S).sum() + self.m @ self.m - M - logdet_S)

    @classmethod
    def from_natural(cls, eta1: Tensor, precision: Tensor) -> "WhitenedPosterior":
        precision = 0.5 * (precision + precision.mT)
        S, L_P = cholesky_inverse_from_precision(precision, what="q(v) precision")
        return cls(m=S @ eta1, S=S, precision=precision, chol_precision=L_P)

    def natural_step(self, stats: NaturalStatistics, rho: float = 1.0, scale: float = 1.0) -> "WhitenedPosterior":
        """One natural-gradient step of size ``rho`` towards the closed-form optimum
        ``(η̂₁, P̂) = (s·h, I + s·G)`` of the statistics (``s = scale``).

        ``η ← (1 − ρ) η + ρ η̂`` in natural parameters; ``rho = 1`` jumps to the optimum (CAVI;
        Castro-Macías et al. 2024, Algorithm 1, Eqs. 26–27 whitened); ``rho < 1`` with minibatches
        of bags is stochastic variational inference (Hoffman et al., *Stochastic Variational
        Inference*, JMLR 2013).
        """
        if not 0.0 < rho <= 1.0:
            raise ValueError(f"the natural step size rho must be in (0, 1], got {rho}")
        if rho == 1.0:
            return WhitenedPosterior.from_natural(*stats.targets(scale))
        return WhitenedPosterior.from_natural(*self._towards(stats, rho, scale))

    def _towards(self, stats: NaturalStatistics, rho: float, scale: float) -> tuple[Tensor, Tensor]:
        """``(η₁, P) ← (1−ρ)(η₁, P) + ρ(η̂₁, P̂)`` for the targets of :meth:`NaturalStatistics.targets`."""
        eta1_hat, P_hat = stats.targets(scale)
        return (1.0 - rho) * (self.precision @ self.m) + rho * eta1_hat, (1.0 - rho) * self.precision + rho * P_hat

    def try_natural_step(self, stats: NaturalStatistics, rho: float, scale: float = 1.0) -> "WhitenedPosterior | None":
        """``η ← (1−ρ)η + ρη̂ = η + ρ(η̂ − η)`` for any ``ρ > 0`` (``ρ > 1`` goes past the optimum: the
        over-relaxed step of :mod:`milgp.variational.overrelaxation`), or ``None`` when the new
        precision is not positive definite (or not finite)."""
        eta1, P = self._towards(stats, rho, scale)
        P = 0.5 * (P + P.mT)
        L_P, info = torch.linalg.cholesky_ex(P)
        if int(info) != 0 or not torch.isfinite(L_P).all():
            return None
        S = torch.cholesky_inverse(L_P)
        S = 0.5 * (S + S.mT)
        return WhitenedPosterior(m=S @ eta1, S=S, precision=P, chol_precision=L_P)


class ClosedFormStrategy(gpytorch.variational.VariationalStrategy):
    """GPyTorch's whitened ``VariationalStrategy`` plus the fast path's projections and ``q(v)`` access.

    Args:
        model: the ``ApproximateGP`` it belongs to (its ``forward`` gives the prior mean and kernel).
        inducing_points: ``(M, D)`` inducing locations ``Z``.
        variational_distribution: ``NaturalVariationalDistribution`` (for ``gpytorch.optim.NGD``) or
            ``CholeskyVariationalDistribution`` (for Adam) over the ``M`` whitened values.
        learn_inducing_locations: make ``Z`` a trainable parameter (default ``False``: the
            closed-form steps leave ``Z`` where it is put).
        jitter_val: GPyTorch's jitter on ``K_zz`` (``None``: its default for the dtype).

    ``q(v)`` starts at the prior ``N(0, I)`` and is marked initialised, so GPyTorch never
    re-initialises (with noise) or "re-whitens" what a closed-form step wrote.
    """

    def __init__(
        self,
        model: gpytorch.models.ApproximateGP,
        inducing_points: Tensor,
        variational_distribution: gpytorch.variational._VariationalDistribution,
        learn_inducing_locations: bool = False,
        jitter_val: float | None = None,
    ):
        # the closed-form step reads and writes a full q(v) of one GP: refused here, not as an
        # AttributeError or a shape error deep in the first step
        if type(variational_distribution) not in (gpytorch.variational.NaturalVariationalDistribution,
                                                  gpytorch.variational.CholeskyVariationalDistribution):
            raise TypeError(f"ClosedFormStrategy needs a NaturalVariationalDistribution or a CholeskyVariationalDistribution, "
                            f"got {type(variational_distribution).__name__}")
        if inducing_points.dim() != 2 or tuple(variational_distribution.batch_shape) != ():
            raise TypeError(f"ClosedFormStrategy is for one GP: inducing points (M, D) and no batch shape, got inducing points "
                            f"{tuple(inducing_points.shape)} and batch shape {tuple(variational_distribution.batch_shape)}")
        super().__init__(model, inducing_points, variational_distribution, learn_inducing_locations, jitter_val)
        self.variational_params_initialized.fill_(1)  # the distributions start at N(0, I): the whitened prior
        self.updated_strategy.fill_(True)

    @classmethod
    def of(cls, model: gpytorch.models.ApproximateGP) -> "ClosedFormStrategy":
        """``model.variational_strategy``, which must be a :class:`ClosedFormStrategy` (one-line
        ``TypeError`` otherwise)."""
        strategy = getattr(model, "variational_strategy", None)
        if not isinstance(strategy, cls):
            raise TypeError(
                f"closed-form steps need a model whose variational_strategy is milgp's ClosedFormStrategy, "
                f"got {type(strategy).__name__} on {type(model).__name__}"
            )
        return strategy

    def check_batch(self, batch: BagBatch) -> BagBatch:
        """``batch`` (:meth:`BagBatch.check`) with features this model can take: as many as the
        inducing points have, in their dtype (a float32 model on float64 features was torch's
        "addmv input tensors must have the same dtype" from inside the first step)."""
        batch.check()
        Z = self.inducing_points
        if batch.x.dim() != 2 or batch.x.shape[1] != Z.shape[1]:
            raise ValueError(f"batch.x has shape {tuple(batch.x.shape)}; the model's inducing points have {Z.shape[1]} features")
        if batch.x.dtype != Z.dtype:
            raise ValueError(f"batch.x is {batch.x.dtype} but the model is {Z.dtype}: cast one to the other "
                             "(batch.to(dtype=...) or model.to(dtype))")
        return batch

    # -- properties ---------------------------------------------------------------------------
    @property
    def num_inducing(self) -> int:
        return int(self.inducing_points.shape[-2])

    @property
    def jitter(self) -> float:
        return float(self.jitter_val)

    @property
    def is_natural(self) -> bool:
        return isinstance(self._variational_distribution, gpytorch.variational.NaturalVariationalDistribution)

    def hyperparameters(self) -> list[torch.nn.Parameter]:
        """The model's trainable kernel and mean parameters (and ``Z`` when learned): all but q(v)."""
        var_ids = {id(p) for p in self._variational_distribution.parameters()}
        return [p for p in self.model.parameters() if id(p) not in var_ids and p.requires_grad]

    # -- projections ------------------------------------------------------------------------------
    def inducing_cholesky(self) -> Tensor:
        """``L`` with ``L Lᵀ = K_zz + jitter·I`` (escalating jitter on failure), ``(M, M)``."""
        Kzz = self.model.forward(self.inducing_points).lazy_covariance_matrix.to_dense()
        return robust_cholesky(Kzz, jitter=self.jitter, what="K_zz (inducing-point kernel matrix)")

    def projection(self, x: Tensor, L: Tensor | None = None) -> Projection:
        """Whitened projection of ``x`` ``(N, D)``; differentiable w.r.t. the hyperparameters.

        The prior comes from the model's ``forward`` on ``[Z; x]``, as GPyTorch's own strategy
        computes it; of its lazy kernel only the ``K_zx`` block and the diagonal of ``K_xx`` are
        evaluated.
        """
        L = self.inducing_cholesky() if L is None else L
        M = self.num_inducing
        prior = self.model.forward(torch.cat([self.inducing_points, x], dim=-2))
        covar = prior.lazy_covariance_matrix
        A = torch.linalg.solve_triangular(L, covar[..., :M, M:].to_dense(), upper=False)
        prior_var = covar[..., M:, M:].diagonal(dim1=-1, dim2=-2) + self.jitter
        return Projection(A=A, prior_var=prior_var, prior_mean=prior.mean[..., M:])

    # -- q(v) ---------------------------------------------------------------------------------------
    def whitened_posterior(self) -> WhitenedPosterior:
        """Current ``q(v)`` read from the variational distribution (detached)."""
        dist = self._variational_distribution
        with torch.no_grad():
            if self.is_natural:
                return WhitenedPosterior.from_natural(dist.natural_vec.detach().clone(), -2.0 * dist.natural_mat.detach())
            m = dist.variational_mean.detach().clone()
            L_S = torch.tril(dist.chol_variational_covar.detach())
            S = L_S @ L_S.mT
            precision = torch.cholesky_inverse(L_S)
            return WhitenedPosterior(m=m, S=S, precision=0.5 * (precision + precision.mT))

    def set_whitened_posterior(self, q: WhitenedPosterior) -> None:
        """Write ``q(v)`` into the variational distribution and clear this strategy's caches."""
        dist = self._variational_distribution
        with torch.no_grad():
            if self.is_natural:
                eta1, eta2 = q.natural
                dist.natural_vec.copy_(eta1)
                dist.natural_mat.copy_(eta2)
            else:
                dist.variational_mean.copy_(q.m)
                dist.chol_variational_covar.copy_(robust_cholesky(q.S, what="q(v) covariance"))
        self.clear_caches()

    def clear_caches(self) -> None:
        """Drop GPyTorch's cached predictive quantities of this strategy (after ``q(v)`` or the
        kernel hyperparameters changed)."""
        self._clear_cache()

    def natural_step(self, stats: NaturalStatistics, rho: float = 1.0, scale: float = 1.0) -> WhitenedPosterior:
        """The closed-form natural step of size ``rho`` from a likelihood's statistics
        (:meth:`WhitenedPosterior.natural_step`) on the current ``q(v)``, written back; returns the
        new ``q(v)``."""
        q = self.whitened_posterior().natural_step(stats, rho=rho, scale=scale)
        self.set_whitened_posterior(q)
        return q

    # -- marginals and bag blocks -------------------------------------------------------------------
    @staticmethod
    def marginals(proj: Projection, q: WhitenedPosterior) -> tuple[Tensor, Tensor]:
        """Marginals of ``q(f_n)``: mean ``(N,)`` and variance ``(N,)`` (clamped at 1e-10).

        ``σ²_n = k_nn − ‖A_n‖² + A_nᵀSA_n``. Without gradients, ``A_nᵀSA_n = ‖L_P⁻¹ A_n‖²`` with
        ``L_P`` the Cholesky factor of the precision ``S⁻¹`` (a triangular solve: half the flops of
        the general product), on the CPU over blocks of instances that stay in cache; with
        gradients ``A_nᵀ(S − I)A_n`` by one matrix product.
        """
        A = proj.A
        if torch.is_grad_enabled() and (A.requires_grad or q.S.requires_grad or q.m.requires_grad):
            S_minus_I = q.S - torch.eye(q.S.shape[0], dtype=q.S.dtype, device=q.S.device)
            var = proj.prior_var + ((S_minus_I @ A) * A).sum(0)
            return proj.prior_mean + A.mT @ q.m, var.clamp_min(1e-10)
        L_P = q.chol_precision if q.chol_precision is not None else robust_cholesky(q.precision, what="q(v) precision")
        N = A.shape[1]
        block = _MARGINAL_BLOCK if A.device.type == "cpu" else max(N, 1)
        mean, quad = torch.empty(N, dtype=A.dtype, device=A.device), torch.empty(N, dtype=A.dtype, device=A.device)
        for start in range(0, N, block):  # the mean from each block while it is in cache
            A_block = A[:, start : start + block]
            mean[start : start + block] = A_block.mT @ q.m
            quad[start : start + block] = torch.linalg.solve_triangular(L_P, A_block, upper=False).square_().sum(0)
        return proj.prior_mean + mean, (proj.with_residual().residual + quad).clamp_min(1e-10)

    def prior_variance(self, x: Tensor) -> Tensor:
        """``k(x_n, x_n) + jitter`` ``(N,)`` (the :attr:`Projection.prior_var` of ``x``) without the
        projection onto the inducing points; no gradients."""
        with torch.no_grad():
            return self.model.forward(x).lazy_covariance_matrix.diagonal(dim1=-1, dim2=-2) + self.jitter

    def predict_marginals(self, x: Tensor, chunk_size: int = 65536) -> tuple[Tensor, Tensor]:
        """``q(f*)`` mean and variance ``(N,)`` for new inputs, in chunks, without gradients."""
        q = self.whitened_posterior()
        with torch.no_grad():
            L = self.inducing_cholesky()
            starts = range(0, x.shape[0], chunk_size)
            parts = [self.marginals(self.projection(x[s : s + chunk_size], L), q) for s in starts]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def bag_covariances(self, x: Tensor, bags: Bags, q: WhitenedPosterior | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Per-bag predictive blocks of ``q(f)`` at the instances ``x`` of ``bags``: padded means ``(B, N_max)``, covariances
        ``(B, N_max, N_max)`` and the mask ``(B, N_max)``. Padded rows/columns are the identity.

        Each block is ``K_bb + jitter·I − A_bᵀA_b + A_bᵀ S A_b``; no N×N matrix is formed.
        """
        q = self.whitened_posterior() if q is None else q
        proj = self.projection(x, self.inducing_cholesky())
        A_pad, _ = to_padded(proj.A.mT, bags)  # (B, N_max, M)
        mean_pad, _ = to_padded(proj.prior_mean + proj.A.mT @ q.m, bags)
        cov, mask = self.block_covariances(x, bags, A_pad, A_pad @ q.S @ A_pad.mT)
        return mean_pad, cov, mask

    def cross_covariance(self, x1: Tensor, x2: Tensor, A1: Tensor, A2: Tensor, q: WhitenedPosterior) -> Tensor:
        """``Cov_q[f(x1), f(x2)] = K(x1, x2) − A1ᵀA2 + A1ᵀ S A2`` ``(n1, n2)`` for the projections
        ``A1`` ``(M, n1)``, ``A2`` ``(M, n2)`` of the inputs (no jitter: a block off the diagonal).
        The kernel is the model's own prior covariance at the stacked inputs, evaluated on that
        block alone: any kernel, and no ``(n1 + n2)²`` matrix."""
        n1 = x1.shape[0]
        K = self.model.forward(torch.cat([x1, x2])).lazy_covariance_matrix[:n1, n1:].to_dense()
        return K + A1.mT @ (q.S @ A2 - A2)

    def residual_blocks(self, x: Tensor, bags: Bags, A_pad: Tensor, kernel_grad: bool = True) -> tuple[Tensor, Tensor]:
        """The within-bag prior covariance the inducing points do not explain,
        ``K_bb + jitter·I − A_bᵀA_b`` ``(B, N_max, N_max)`` (padded entries unspecified), and the
        mask ``(B, N_max)``, for ``A_pad`` ``(B, N_max, M)`` the bags' padded projections.
        ``kernel_grad=False`` builds the kernel block without a graph."""
        x_pad, mask = to_padded(x, bags)
        with torch.set_grad_enabled(kernel_grad and torch.is_grad_enabled()):
            K = self.model.forward(x_pad).lazy_covariance_matrix.to_dense()  # (B, N_max, N_max)
        eye = torch.eye(mask.shape[1], dtype=x.dtype, device=x.device)
        return K + self.jitter * eye - A_pad @ A_pad.mT, mask

    def block_covariances(self, x: Tensor, bags: Bags, A_pad: Tensor, cov_v: Tensor) -> tuple[Tensor, Tensor]:
        """Padded within-bag covariances ``K_bb + jitter·I − A_bᵀA_b + cov_v`` ``(B, N_max, N_max)``
        and the mask ``(B, N_max)``, for ``A_pad`` ``(B, N_max, M)`` the bags' padded projections and
        ``cov_v`` ``(B, N_max, N_max)`` the covariance of ``A_bᵀv`` under whichever ``q(v)`` (the
        posterior's, or a leave-one-bag-out cavity's). Padded rows/columns are the identity; exactly
        symmetric."""
        base, mask = self.residual_blocks(x, bags, A_pad)
        return identity_padded(base + cov_v, mask), mask
