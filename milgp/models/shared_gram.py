"""Whitened projections of several kernels from one pass over the inputs.

A kernel search fits the same inducing points ``Z`` and inputs ``x`` under several kernels. The
kernels of :class:`~milgp.models.sparse_gp.SparseGP` are functions of the inner products alone —
RBF: ``s² exp(−(‖z‖² + ‖x‖² − 2zᵀx)/(2ℓ²))``, linear: ``s² zᵀx/D``, affine: ``s² (zᵀx/D + 1)`` —
so :class:`SharedGram` computes ``Z xᵀ`` (``2·M·N·D`` flops, the whole cost for wide features)
once and derives every candidate's projection ``A = L⁻¹K_zx`` from it. The result is what
:meth:`ClosedFormStrategy.projection` computes for a model with that kernel (to rounding; tested).
"""
from __future__ import annotations

import torch
from torch import Tensor

from milgp.linalg import robust_cholesky
from milgp.models.closed_form_strategy import Projection
from milgp.models.sparse_gp import SparseGP

__all__ = ["SharedGram"]


class SharedGram:
    """Inner products of inducing points ``Z`` ``(M, D)`` with themselves and with inputs ``x``
    ``(N, D)`` (``M·N + M²`` floats), for :meth:`projection` under any kernel of the family."""

    def __init__(self, Z: Tensor, x: Tensor):
        with torch.no_grad():
            self.zx = Z @ x.mT
            self.zz = Z @ Z.mT
            self.z_sq = (Z * Z).sum(1)
            self.x_sq = (x * x).sum(1)

    def _kernel(self, model: SparseGP) -> tuple[Tensor, Tensor, Tensor]:
        """``model``'s kernel at unit outputscale: ``K_zz`` ``(M, M)``, ``K_zx`` ``(M, N)``, ``k(x, x)`` ``(N,)``."""
        base = model.covar_module.base_kernel
        if model.kernel == "affine":
            linear, constant = base.kernels
            v, c = linear.variance.detach().reshape(()), constant.constant.detach().reshape(())
            return v * self.zz + c, v * self.zx + c, v * self.x_sq + c
        if model.kernel == "linear":
            v = base.variance.detach().reshape(())
            return v * self.zz, v * self.zx, v * self.x_sq
        ls = base.lengthscale.detach()
        if ls.numel() != 1:
            raise ValueError("SharedGram needs a shared (non-ARD) lengthscale")
        c = -0.5 / ls.reshape(()) ** 2
        d_zz = (self.z_sq.unsqueeze(1) + self.z_sq.unsqueeze(0) - 2 * self.zz).clamp_min(0)
        d_zx = (self.z_sq.unsqueeze(1) + self.x_sq.unsqueeze(0) - 2 * self.zx).clamp_min(0)
        return torch.exp(c * d_zz), torch.exp(c * d_zx), torch.ones_like(self.x_sq)

    @torch.no_grad()
    def projection(self, model: SparseGP) -> tuple[Tensor, Projection]:
        """``(L, Projection)`` of the inputs under ``model``'s kernel (zero mean, shared lengthscale):
        ``L Lᵀ = s²K_zz + jitter·I``, ``A = L⁻¹ s²K_zx``, prior variance ``s²k(x, x) + jitter``,
        the values of :meth:`ClosedFormStrategy.inducing_cholesky` and :meth:`ClosedFormStrategy.projection`."""
        if hasattr(model.mean_module, "constant"):
            raise ValueError("SharedGram projections assume a zero mean function")
        K_zz, K_zx, k_xx = self._kernel(model)
        outputscale, jitter = model.covar_module.outputscale.detach().reshape(()), model.variational_strategy.jitter
        L = robust_cholesky(outputscale * K_zz, jitter=jitter, what="K_zz (inducing-point kernel matrix)")
        A = torch.linalg.solve_triangular(L, outputscale * K_zx, upper=False)
        prior_var = outputscale * k_xx + jitter
        return L, Projection(A=A, prior_var=prior_var, prior_mean=torch.zeros_like(prior_var))
