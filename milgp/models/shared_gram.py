"""Whitened projections of several kernels from one pass over the inputs.

A kernel search fits the same inducing points ``Z`` and inputs ``x`` under several kernels. The
kernels of :class:`~milgp.models.sparse_gp.SparseGP` are functions of the inner products alone —
RBF: ``s² exp(−(‖z‖² + ‖x‖² − 2zᵀx)/(2ℓ²))``, linear: ``s² zᵀx/D``, affine: ``s² (zᵀx/D + 1)`` —
so :class:`SharedGram` computes ``Z xᵀ`` (``2·M·N·D`` flops, the whole cost for wide features)
once and derives every candidate's projection ``A = L⁻¹K_zx`` from it. The result is what
:meth:`ClosedFormStrategy.projection` computes for a model with that kernel (to rounding; tested).
The fitted candidates predict the same way (:func:`predict_marginals`: one ``Z xᵀ`` per chunk of
new inputs for all of them).
"""
from __future__ import annotations

from typing import Sequence

import torch
from gpytorch.models import ApproximateGP
from torch import Tensor

from milgp.linalg import robust_cholesky
from milgp.models.closed_form_strategy import Projection
from milgp.models.sparse_gp import SparseGP

__all__ = ["SharedGram", "predict_marginals"]


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
        c = -0.5 / base.lengthscale.detach().reshape(()) ** 2
        d_zz = (self.z_sq.unsqueeze(1) + self.z_sq.unsqueeze(0) - 2 * self.zz).clamp_min(0)
        d_zx = (self.z_sq.unsqueeze(1) + self.x_sq.unsqueeze(0) - 2 * self.zx).clamp_min(0)
        return torch.exp(c * d_zz), torch.exp(c * d_zx), torch.ones_like(self.x_sq)

    @staticmethod
    def serves(model: ApproximateGP) -> bool:
        """Whether :meth:`projection` serves ``model``: a :class:`SparseGP` with a zero mean and, for
        RBF, one shared lengthscale."""
        if not isinstance(model, SparseGP) or hasattr(model.mean_module, "constant"):
            return False
        return model.kernel != "rbf" or model.covar_module.base_kernel.lengthscale.numel() == 1

    @torch.no_grad()
    def projection(self, model: SparseGP) -> tuple[Tensor, Projection]:
        """``(L, Projection)`` of the inputs under ``model``'s kernel (zero mean, shared lengthscale):
        ``L Lᵀ = s²K_zz + jitter·I``, ``A = L⁻¹ s²K_zx``, prior variance ``s²k(x, x) + jitter``,
        the values of :meth:`ClosedFormStrategy.inducing_cholesky` and :meth:`ClosedFormStrategy.projection`."""
        if not self.serves(model):
            raise ValueError("SharedGram projections need a SparseGP with a zero mean and a shared (non-ARD) lengthscale")
        K_zz, K_zx, k_xx = self._kernel(model)
        outputscale, jitter = model.covar_module.outputscale.detach().reshape(()), model.variational_strategy.jitter
        L = robust_cholesky(outputscale * K_zz, jitter=jitter, what="K_zz (inducing-point kernel matrix)")
        A = torch.linalg.solve_triangular(L, outputscale * K_zx, upper=False)
        prior_var = outputscale * k_xx + jitter
        return L, Projection(A=A, prior_var=prior_var, prior_mean=torch.zeros_like(prior_var))


@torch.no_grad()
def predict_marginals(models: Sequence[ApproximateGP], x: Tensor, chunk_size: int = 65536) -> list[tuple[Tensor, Tensor]]:
    """``q(f*)`` mean and variance ``(N,)`` of each of ``models`` at the inputs ``x`` ``(N, D)``.

    Models that :class:`SharedGram` serves and that share their inducing points (the candidates of
    a kernel search, grouped by their points) are projected from one ``Z xᵀ`` per group and chunk
    of ``chunk_size`` inputs — for wide features the whole cost of a prediction, paid once instead
    of once per model; any other model by its own :meth:`ClosedFormStrategy.predict_marginals`.
    """
    out: list[tuple[Tensor, Tensor] | None] = [None] * len(models)
    groups: list[list[int]] = []
    for k, m in enumerate(models):
        if SharedGram.serves(m):
            Z = m.variational_strategy.inducing_points
            group = next((g for g in groups if torch.equal(models[g[0]].variational_strategy.inducing_points, Z)), None)
            if group is None:
                groups.append(group := [])
            group.append(k)
    for shared in (g for g in groups if len(g) > 1):
        Z = models[shared[0]].variational_strategy.inducing_points
        parts: list[list[tuple[Tensor, Tensor]]] = [[] for _ in shared]
        posteriors = [models[k].variational_strategy.whitened_posterior() for k in shared]
        for start in range(0, x.shape[0], chunk_size):
            gram = SharedGram(Z, x[start : start + chunk_size])
            for part, k, q in zip(parts, shared, posteriors):
                part.append(models[k].variational_strategy.marginals(gram.projection(models[k])[1], q))
        for part, k in zip(parts, shared):
            out[k] = (torch.cat([p[0] for p in part]), torch.cat([p[1] for p in part]))
    return [o if o is not None else m.variational_strategy.predict_marginals(x, chunk_size) for o, m in zip(out, models)]
