"""Sparse variational GP head: an RBF, linear or affine kernel on milgp's closed-form strategy.

``SparseGP`` is an ordinary :class:`gpytorch.models.ApproximateGP` whose variational strategy is
:class:`~milgp.models.closed_form_strategy.ClosedFormStrategy` (GPyTorch's whitened strategy plus
what the closed-form natural steps need: that module's docstring). Any ``ApproximateGP`` built on
that strategy is trained the same way; this one is the estimators'.
"""
from __future__ import annotations

import gpytorch
import torch
from torch import Tensor

from milgp.models.closed_form_strategy import ClosedFormStrategy

__all__ = ["KERNELS", "SparseGP"]

KERNELS = ("rbf", "linear", "affine")


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
            regression on the features, restricted to the span of the inducing points);
            ``"affine"``: ``s² (xᵀx'/D + 1)``, the same with an intercept of prior variance ``s²``.
        lengthscale, outputscale: initial kernel hyperparameters (``ℓ`` is unused by ``"linear"``
            and ``"affine"``).
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
        strategy = ClosedFormStrategy(
            self, inducing_points, variational_distribution, learn_inducing_locations=learn_inducing_locations
        )
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ConstantMean() if constant_mean else gpytorch.means.ZeroMean()
        if kernel == "rbf":
            base = gpytorch.kernels.RBFKernel(ard_num_dims=dim if ard else None)
        else:  # the scale is the outputscale's alone: the linear variance and the constant are fixed
            linear = gpytorch.kernels.LinearKernel()
            linear.raw_variance.requires_grad_(False)
            base = linear
            if kernel == "affine":
                constant = gpytorch.kernels.ConstantKernel()
                constant.raw_constant.requires_grad_(False)
                base = gpytorch.kernels.AdditiveKernel(linear, constant)
        self.kernel = kernel
        self.covar_module = gpytorch.kernels.ScaleKernel(base)
        dtype = inducing_points.dtype
        # the values as tensors of the model's dtype: GPyTorch's setters turn a Python float into a
        # tensor of torch's default dtype first (float32: lengthscale 7.8 became 7.8000002)
        self.to(dtype)
        if kernel == "rbf":
            base.lengthscale = torch.as_tensor(lengthscale, dtype=dtype)
        else:
            linear.variance = torch.tensor(1.0 / dim, dtype=dtype)
            if kernel == "affine":
                constant.constant = torch.tensor(1.0, dtype=dtype)
        self.covar_module.outputscale = torch.as_tensor(outputscale, dtype=dtype)

    def forward(self, x: Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
