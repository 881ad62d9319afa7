"""Sparse variational GP head, whitened, usable by GPyTorch and by the closed-form fast path.

``SparseGP`` is an ordinary :class:`gpytorch.models.ApproximateGP` (whitened
``VariationalStrategy``, a scaled RBF kernel with optional ARD or a scaled linear kernel, zero or
constant mean), so it works with
``gpytorch.mlls.VariationalELBO`` and Adam or ``gpytorch.optim.NGD``. It also exposes what the
augmentation-based closed-form updates need, computed without N×N matrices:

* :meth:`projection` — ``A = L⁻¹ K_zx`` ``(M, N)`` with ``K_zz + jitter·I = L Lᵀ``, the prior
  diagonal ``k(x_n, x_n) + jitter`` ``(N,)`` and the prior mean ``(N,)``;
* :meth:`whitened_posterior` / :meth:`set_whitened_posterior` — ``q(v) = N(m, S)`` read from and
  written to GPyTorch's variational distribution (natural or Cholesky parameterisation), with the
  strategy's caches cleared after every in-place update;
* :meth:`marginals` — ``μ_n = mean(x_n) + A_nᵀ m``, ``σ²_n = k_nn − ‖A_n‖² + A_nᵀ S A_n``;
* :meth:`bag_covariances` — per-bag blocks ``K_bb − A_bᵀA_b + A_bᵀ S A_b`` (never N×N).

The jitter is GPyTorch's own (``variational_strategy.jitter_val``) so both paths agree exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import gpytorch
import numpy as np
import torch
from scipy.linalg import blas
from torch import Tensor

from milgp.data.bags import to_padded
from milgp.linalg import cholesky_inverse_from_precision, robust_cholesky

__all__ = ["KERNELS", "Projection", "WhitenedPosterior", "SparseGP"]

_BLAS_TRMM = {torch.float64: blas.dtrmm, torch.float32: blas.strmm}
_MARGINAL_BLOCK = 2048
"""Instances per triangular product in :meth:`SparseGP.marginals` (an ``M × 2048`` block stays in cache)."""

KERNELS = ("rbf", "linear")


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


class SparseGP(gpytorch.models.ApproximateGP):
    """Whitened sparse variational GP ``f ~ GP(mean, k)`` with ``M`` inducing points.

    Args:
        inducing_points: ``(M, D)`` initial inducing locations ``Z``.
        ard: one lengthscale per feature (ARD) instead of a shared one.
        constant_mean: learn a constant mean instead of a zero mean.
        learn_inducing_locations: make ``Z`` a trainable parameter.
        natural: use GPyTorch's ``NaturalVariationalDistribution`` (needed by ``gpytorch.optim.NGD``);
            otherwise ``CholeskyVariationalDistribution`` (Adam on ``m`` and ``chol(S)``).
        kernel: ``"rbf"``: ``s² exp(−‖x − x'‖²/(2ℓ²))``; ``"linear"``: ``s² xᵀx'/D`` (Bayesian linear
            regression on the features, restricted to the span of the inducing points).
        lengthscale, outputscale: initial kernel hyperparameters (``ℓ`` is unused by ``"linear"``).
    """

    def __init__(
        self,
        inducing_points: Tensor,
        *,
        ard: bool = False,
        constant_mean: bool = False,
        learn_inducing_locations: bool = False,
        natural: bool = True,
        kernel: str = "rbf",
        lengthscale: float | Tensor = 1.0,
        outputscale: float = 1.0,
    ):
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        num_inducing, dim = inducing_points.shape
        dist_cls = (
            gpytorch.variational.NaturalVariationalDistribution
            if natural
            else gpytorch.variational.CholeskyVariationalDistribution
        )
        variational_distribution = dist_cls(num_inducing)
        strategy = gpytorch.variational.VariationalStrategy(
            self, inducing_points, variational_distribution, learn_inducing_locations=learn_inducing_locations
        )
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ConstantMean() if constant_mean else gpytorch.means.ZeroMean()
        if kernel == "rbf":
            base = gpytorch.kernels.RBFKernel(ard_num_dims=dim if ard else None)
        else:
            base = gpytorch.kernels.LinearKernel()
            base.raw_variance.requires_grad_(False)  # the scale is the outputscale's alone
        self.kernel = kernel
        self.covar_module = gpytorch.kernels.ScaleKernel(base)
        self.to(inducing_points.dtype)  # before setting values: a float64 model gets them exactly
        if kernel == "rbf":
            base.lengthscale = lengthscale
        else:
            base.variance = 1.0 / dim
        self.covar_module.outputscale = outputscale
        # q(v) starts at the prior N(0, I), written in our own terms so that GPyTorch never
        # re-initialises or "re-whitens" it.
        M = num_inducing
        self.set_whitened_posterior(
            WhitenedPosterior(
                m=inducing_points.new_zeros(M),
                S=torch.eye(M, dtype=inducing_points.dtype, device=inducing_points.device),
                precision=torch.eye(M, dtype=inducing_points.dtype, device=inducing_points.device),
            )
        )

    # -- GPyTorch interface ------------------------------------------------------------------
    def forward(self, x: Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    # -- properties ---------------------------------------------------------------------------
    @property
    def inducing_points(self) -> Tensor:
        return self.variational_strategy.inducing_points

    @property
    def num_inducing(self) -> int:
        return int(self.inducing_points.shape[0])

    @property
    def jitter(self) -> float:
        return float(self.variational_strategy.jitter_val)

    @property
    def is_natural(self) -> bool:
        return isinstance(
            self.variational_strategy._variational_distribution, gpytorch.variational.NaturalVariationalDistribution
        )

    def hyperparameters(self) -> list[torch.nn.Parameter]:
        """Trainable kernel and mean parameters (and ``Z`` when learned): everything but q(v)."""
        var_ids = {id(p) for p in self.variational_parameters()}
        return [p for p in self.parameters() if id(p) not in var_ids and p.requires_grad]

    # -- fast path ------------------------------------------------------------------------------
    def inducing_cholesky(self) -> Tensor:
        """``L`` with ``L Lᵀ = K_zz + jitter·I`` (escalating jitter on failure), ``(M, M)``."""
        Z = self.inducing_points
        Kzz = self.covar_module(Z).to_dense()
        return robust_cholesky(Kzz, jitter=self.jitter, what="K_zz (inducing-point kernel matrix)")

    def projection(self, x: Tensor, L: Tensor | None = None) -> Projection:
        """Whitened projection of ``x`` ``(N, D)``; differentiable w.r.t. the hyperparameters."""
        L = self.inducing_cholesky() if L is None else L
        Kzx = self.covar_module(self.inducing_points, x).to_dense()
        A = torch.linalg.solve_triangular(L, Kzx, upper=False)
        prior_var = self.covar_module(x, diag=True) + self.jitter
        prior_mean = self.mean_module(x)
        return Projection(A=A, prior_var=prior_var, prior_mean=prior_mean)

    def whitened_posterior(self) -> WhitenedPosterior:
        """Current ``q(v)`` read from GPyTorch's variational distribution (detached)."""
        dist = self.variational_strategy._variational_distribution
        with torch.no_grad():
            if self.is_natural:
                return WhitenedPosterior.from_natural(dist.natural_vec.detach().clone(), -2.0 * dist.natural_mat.detach())
            m = dist.variational_mean.detach().clone()
            L_S = torch.tril(dist.chol_variational_covar.detach())
            S = L_S @ L_S.mT
            precision = torch.cholesky_inverse(L_S)
            return WhitenedPosterior(m=m, S=S, precision=0.5 * (precision + precision.mT))

    def set_whitened_posterior(self, q: WhitenedPosterior) -> None:
        """Write ``q(v)`` into GPyTorch's variational distribution and clear the strategy's caches."""
        strategy = self.variational_strategy
        dist = strategy._variational_distribution
        with torch.no_grad():
            if self.is_natural:
                eta1, eta2 = q.natural
                dist.natural_vec.copy_(eta1)
                dist.natural_mat.copy_(eta2)
            else:
                dist.variational_mean.copy_(q.m)
                dist.chol_variational_covar.copy_(robust_cholesky(q.S, what="q(v) covariance"))
            strategy.variational_params_initialized.fill_(1)
            strategy.updated_strategy.fill_(True)
        strategy._clear_cache()

    @staticmethod
    def marginals(proj: Projection, q: WhitenedPosterior) -> tuple[Tensor, Tensor]:
        """Marginals of ``q(f_n)``: mean ``(N,)`` and variance ``(N,)`` (clamped at 1e-10).

        ``σ²_n = k_nn − ‖A_n‖² + A_nᵀSA_n``. Without gradients on the CPU, and with ``A`` the
        transposed view of a row-major ``Aᵀ`` (the fit's cache), ``A_nᵀSA_n = ‖L_Sᵀ A_n‖²`` with
        ``S = L_S L_Sᵀ`` is a BLAS triangular product (half the flops of the general product), taken over column blocks;
        otherwise ``A_nᵀ(S − I)A_n`` by one matrix product.
        """
        A = proj.A
        mean = proj.prior_mean + A.mT @ q.m
        differentiable = torch.is_grad_enabled() and (A.requires_grad or q.S.requires_grad)
        if not differentiable and A.device.type == "cpu" and A.dtype in _BLAS_TRMM and A.mT.is_contiguous():
            L_S = torch.linalg.cholesky_ex(q.S)[0].numpy()
            A_np = A.numpy()
            quad = np.empty(A_np.shape[1], dtype=A_np.dtype)
            # column blocks keep L_Sᵀ A_block in cache for the squared column sums (no N×M temporaries)
            for start in range(0, A_np.shape[1], _MARGINAL_BLOCK):
                W = _BLAS_TRMM[A.dtype](1.0, L_S, A_np[:, start : start + _MARGINAL_BLOCK], side=0, lower=1, trans_a=1)
                quad[start : start + _MARGINAL_BLOCK] = np.einsum("ij,ij->j", W, W)
            var = proj.with_residual().residual + torch.from_numpy(quad)
            return mean, var.clamp_min(1e-10)
        # −‖Aₙ‖² + AₙᵀSAₙ = Aₙᵀ(S − I)Aₙ: one GEMM and one elementwise pass over M×N
        S_minus_I = q.S - torch.eye(q.S.shape[0], dtype=q.S.dtype, device=q.S.device)
        SA = S_minus_I @ A
        var = proj.prior_var + ((SA * A).sum(0) if differentiable else SA.mul_(A).sum(0))
        return mean, var.clamp_min(1e-10)

    def predict_marginals(self, x: Tensor, chunk_size: int = 65536) -> tuple[Tensor, Tensor]:
        """``q(f*)`` mean and variance ``(N,)`` for new inputs, in chunks, without gradients."""
        q = self.whitened_posterior()
        with torch.no_grad():
            L = self.inducing_cholesky()
            means, variances = [], []
            for start in range(0, x.shape[0], chunk_size):
                mu, var = self.marginals(self.projection(x[start : start + chunk_size], L), q)
                means.append(mu)
                variances.append(var)
        return torch.cat(means), torch.cat(variances)

    def bag_covariances(
        self, x: Tensor, bag_index: Tensor, num_bags: int | None = None, q: WhitenedPosterior | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Per-bag predictive blocks of ``q(f)``: padded means ``(B, N_max)``, covariances
        ``(B, N_max, N_max)`` and the mask ``(B, N_max)``. Padded rows/columns are the identity.

        Each block is ``K_bb + jitter·I − A_bᵀA_b + A_bᵀ S A_b``; no N×N matrix is formed.
        """
        q = self.whitened_posterior() if q is None else q
        L = self.inducing_cholesky()
        proj = self.projection(x, L)
        A_pad, _ = to_padded(proj.A.mT, bag_index, num_bags)  # (B, N_max, M)
        mean_pad, _ = to_padded(proj.prior_mean + proj.A.mT @ q.m, bag_index, num_bags)
        cov, mask = self.block_covariances(x, bag_index, num_bags, A_pad, A_pad @ q.S @ A_pad.mT)
        return mean_pad, cov, mask

    def block_covariances(
        self, x: Tensor, bag_index: Tensor, num_bags: int | None, A_pad: Tensor, cov_v: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Padded within-bag covariances ``K_bb + jitter·I − A_bᵀA_b + cov_v`` ``(B, N_max, N_max)``
        and the mask ``(B, N_max)``, for ``A_pad`` ``(B, N_max, M)`` the bags' padded projections and
        ``cov_v`` ``(B, N_max, N_max)`` the covariance of ``A_bᵀv`` under whichever ``q(v)`` (the
        posterior's, or a leave-one-bag-out cavity's). Padded rows/columns are the identity; exactly
        symmetric."""
        x_pad, mask = to_padded(x, bag_index, num_bags)
        K = self.covar_module(x_pad).to_dense()  # (B, N_max, N_max)
        n_max = mask.shape[1]
        eye = torch.eye(n_max, dtype=x.dtype, device=x.device)
        cov = K + self.jitter * eye - A_pad @ A_pad.mT + cov_v
        pair = mask.unsqueeze(-1) & mask.unsqueeze(-2)
        cov = torch.where(pair, cov, eye.expand_as(cov))
        return 0.5 * (cov + cov.mT), mask
