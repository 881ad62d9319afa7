"""MCMC convergence diagnostics: split-R̂ and effective sample size (multi-chain).

Both follow Gelman et al., *Bayesian Data Analysis* (3rd ed., §11.4–11.5) as implemented in
Stan: draws are arranged ``(chains, draws, ...)``; every trailing index is a separate scalar
quantity.

* :func:`split_rhat` — each chain is cut in half (so within-chain trends count as disagreement),
  ``W`` is the mean within-(half-)chain variance, ``B/n`` the variance of the half-chain means, and
  ``R̂ = sqrt(((n−1)/n · W + B/n) / W)``. Values above ~1.01–1.05 mean the chains have not mixed.
* :func:`effective_sample_size` — ``ESS = C·n / τ`` with the integrated autocorrelation time
  ``τ = −1 + 2 Σ_k Γ_k`` from the multi-chain autocorrelation
  ``ρ_t = 1 − (W − mean_c γ_{c,t}) / var⁺`` (autocovariances by FFT), ``Γ_k = ρ_{2k} + ρ_{2k+1}``
  truncated at the first negative pair and made monotone (Geyer's initial monotone sequence).
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["autocovariance", "effective_sample_size", "split_rhat"]


def _as_chains(draws: Tensor) -> Tensor:
    draws = torch.as_tensor(draws)
    if draws.ndim < 2:
        raise ValueError(f"draws must be (chains, draws, ...), got shape {tuple(draws.shape)}")
    if draws.shape[1] < 4:
        raise ValueError("need at least 4 draws per chain")
    return draws.to(torch.float64) if not draws.is_floating_point() else draws


def split_rhat(draws: Tensor) -> Tensor:
    """Split-R̂ of ``draws`` ``(C, S, ...)`` → ``(...)``. Constant quantities get R̂ = 1."""
    x = _as_chains(draws)
    n = x.shape[1] // 2
    halves = torch.cat([x[:, :n], x[:, x.shape[1] - n :]], 0)  # (2C, n, ...)
    chain_mean = halves.mean(1)
    W = halves.var(1, unbiased=True).mean(0)
    B_over_n = chain_mean.var(0, unbiased=True)
    var_plus = (n - 1) / n * W + B_over_n
    rhat = torch.sqrt(var_plus / W)
    return torch.where(W > 0, rhat, torch.ones_like(rhat))


def autocovariance(x: Tensor) -> Tensor:
    """Biased autocovariance along dim 1 of ``(C, S, ...)`` (lags ``0..S−1``), by FFT."""
    S = x.shape[1]
    centred = x - x.mean(1, keepdim=True)
    size = 1 << (2 * S - 1).bit_length()
    f = torch.fft.rfft(centred, n=size, dim=1)
    acov = torch.fft.irfft(f * f.conj(), n=size, dim=1)[:, :S]
    return acov / S


def effective_sample_size(draws: Tensor) -> Tensor:
    """Multi-chain effective sample size of ``draws`` ``(C, S, ...)`` → ``(...)`` (at most ``C·S·log10(C·S)``
    as in Stan; constant quantities get ``C·S``)."""
    x = _as_chains(draws)
    C, S = x.shape[:2]
    acov = autocovariance(x)  # (C, S, ...)
    chain_var = acov[:, 0] * S / (S - 1)
    W = chain_var.mean(0)
    var_plus = W * (S - 1) / S
    if C > 1:
        var_plus = var_plus + x.mean(1).var(0, unbiased=True)
    safe = torch.where(var_plus > 0, var_plus, torch.ones_like(var_plus))
    rho = 1.0 - (W - acov.mean(0)) / safe  # (S, ...)
    rho[0] = 1.0
    pairs = S // 2
    gamma = rho[0 : 2 * pairs : 2] + rho[1 : 2 * pairs : 2]  # (pairs, ...)
    # initial positive sequence: stop at the first non-positive pair
    positive = torch.cumprod((gamma > 0).to(x.dtype), 0)
    # initial monotone sequence
    gamma_mono = torch.cummin(torch.where(positive > 0, gamma, torch.zeros_like(gamma)), 0).values
    tau = -1.0 + 2.0 * (gamma_mono * positive).sum(0)
    tau = tau.clamp_min(1.0 / torch.log10(torch.tensor(float(C * S))))
    ess = C * S / tau
    return torch.where(var_plus > 0, ess, torch.full_like(ess, float(C * S)))
