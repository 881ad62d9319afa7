"""Numerically stable truncated-normal moments, log-probabilities and exact samplers.

Everything the MIL probit model (Wang & Pinar 2021) needs about ``N(μ, 1)`` restricted to one side of 0,
written so that no expression cancels catastrophically or overflows for ``|μ|`` up to ~35 in
float64 (and degrades gracefully — finite, correct limits — beyond): the log hazard
:func:`log_hazard`, ``h(x) − x`` by a continued fraction (:func:`hazard_excess`: what cancels in
``E[m | m < 0] = μ − h(μ)`` for large ``μ``), the truncated moments (:func:`mean_below_zero`,
:func:`var_below_zero` and their ``above`` mirrors), the pieces :func:`log_neg_log_ndtr` and
:func:`log_expm1_ratio` of the positive-bag normaliser ``log(1 − Π_i Φ(−μ_i))``
(:func:`milgp.likelihoods.mil_probit.bag_log_normaliser`: finite even when every ``Φ(−μ_i)``
rounds to 1), and exact samplers (:func:`sample_above`, :func:`sample_truncated`).

In float32 the same forms stay finite over the same range and agree with float64 to float32
precision (no constant such as ``1e-300`` that underflows in the input's dtype; tested).

All functions are elementwise, keep the input's dtype and device, and are differentiable where
that makes sense (``torch.where`` with safe branches: no NaN gradients from the unused branch).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "hazard",
    "hazard_excess",
    "log_expm1_ratio",
    "log_hazard",
    "log_neg_log_ndtr",
    "mean_above_zero",
    "mean_below_zero",
    "sample_above",
    "sample_some_positive",
    "sample_truncated",
    "var_above_zero",
    "var_below_zero",
]

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
_LOG_SQRT_2_OVER_PI = 0.5 * math.log(2.0 / math.pi)
_SQRT_HALF = math.sqrt(0.5)
_CF_TERMS = 48


def _cf_threshold(dtype: torch.dtype) -> float:
    """Where the continued fraction takes over: ``x > 3`` in float64 (48 terms: ≤ 4e-14 relative
    there); ``x > 2`` in lower precision (≤ 2e-9 relative, far below float32's epsilon), which
    shortens the range where the direct ``h − x`` / ``1 − h(h − x)`` forms cancel."""
    return 3.0 if dtype == torch.float64 else 2.0


def log_hazard(x: Tensor, log_cdf_neg: Tensor | None = None) -> Tensor:
    """``log(φ(x) / Φ(−x))``: the log inverse Mills ratio (hazard of the standard normal), from
    ``log_ndtr`` on ``x < 0`` and ``h(x) = sqrt(2/π)/erfcx(x/√2)`` on ``x ≥ 0`` (``log_cdf_neg``:
    ``log Φ(−x)``, when already computed; only its entries at ``x < 0`` are read)."""
    neg = x < 0
    x_neg = torch.where(neg, x, torch.zeros_like(x))
    x_pos = torch.where(neg, torch.zeros_like(x), x)
    log_tail = torch.special.log_ndtr(-x_neg) if log_cdf_neg is None else log_cdf_neg
    left = -0.5 * x_neg * x_neg - _HALF_LOG_2PI - log_tail
    right = _LOG_SQRT_2_OVER_PI - torch.log(torch.special.erfcx(x_pos * _SQRT_HALF))
    return torch.where(neg, left, right)


def hazard(x: Tensor) -> Tensor:
    """``φ(x) / Φ(−x)`` = ``E[Z | Z > x]`` for ``Z ~ N(0, 1)``; ``≈ x + 1/x`` for large ``x``, ``→ 0``
    for ``x → −∞``."""
    return torch.exp(log_hazard(x))


def _continued_fraction_tails(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(t, w)`` with ``t = 1/(x + w)``, ``w = 2/(x + 3/(x + 4/(x + …)))`` (backward recurrence):
    Laplace's continued fraction ``h(x) − x = t`` (Abramowitz & Stegun 26.2.14)."""
    tail = torch.zeros_like(x)
    for k in range(_CF_TERMS, 2, -1):
        tail = k / (x + tail)
    w = 2.0 / (x + tail)
    return 1.0 / (x + w), w


def hazard_excess(x: Tensor, log_h: Tensor | None = None) -> Tensor:
    """``h(x) − x`` (≥ 0) without cancellation: ``≈ 1/x`` for large ``x``, ``≈ −x`` for ``x → −∞``
    (``log_h``: :func:`log_hazard` of ``x``, when already computed). The continued fraction
    (:func:`_continued_fraction_tails`) serves ``x > 3`` (``x > 2`` below float64), on those entries alone."""
    thr = _cf_threshold(x.dtype)
    big = x > thr
    out = (hazard(x) if log_h is None else torch.exp(log_h)) - x
    if bool(big.any()):
        t, _ = _continued_fraction_tails(x[big])
        out = out.masked_scatter(big, t)
    return out


def mean_below_zero(mu: Tensor, log_h: Tensor | None = None) -> Tensor:
    """``E[m]`` for ``m ~ N(μ, 1)`` truncated to ``(−∞, 0)``: ``μ − φ(μ)/Φ(−μ)`` (Wang & Pinar 2021,
    Eq. 22; ``log_h``: :func:`log_hazard` of ``μ``, when already computed)."""
    return -hazard_excess(mu, log_h)


def mean_above_zero(mu: Tensor) -> Tensor:
    """``E[m]`` for ``m ~ N(μ, 1)`` truncated to ``(0, ∞)``: ``μ + φ(μ)/Φ(μ)``."""
    return hazard_excess(-mu)


def var_below_zero(mu: Tensor) -> Tensor:
    """``Var[m]`` for ``m ~ N(μ, 1)`` truncated to ``(−∞, 0)``: ``1 − h(μ)(h(μ) − μ)``, in ``(0, 1)``.

    For ``μ > 3`` (``μ > 2`` below float64) it is evaluated as ``t(w − t)`` (``t = h − μ``, ``w`` the next continued-fraction
    tail), which equals ``1 − (μ + t) t`` exactly but does not cancel (``Var ≈ 1/μ²``).
    """
    thr = _cf_threshold(mu.dtype)
    big = mu > thr
    mu_cf = torch.where(big, mu, torch.full_like(mu, 2 * thr))
    t, w = _continued_fraction_tails(mu_cf)
    mu_small = torch.where(big, torch.zeros_like(mu), mu)
    h = hazard(mu_small)
    direct = 1.0 - h * (h - mu_small)
    return torch.where(big, t * (w - t), direct)


def var_above_zero(mu: Tensor) -> Tensor:
    """``Var[m]`` for ``m ~ N(μ, 1)`` truncated to ``(0, ∞)``."""
    return var_below_zero(-mu)


def log_neg_log_ndtr(x: Tensor, log_cdf: Tensor | None = None) -> Tensor:
    """``log(−log Φ(x))``, finite for every finite ``x`` (``log_cdf``: ``log Φ(x)``, when already
    computed; only its entries at ``x < 3`` are read).

    For ``x ≥ 3`` uses ``−log Φ(x) = −log1p(−q)``, ``q = Φ(−x) = exp(log_ndtr(−x)) ≤ 1.35e-3``,
    written as ``log q + log1p(q/2 + q²/3 + q³/4 + q⁴/5 + q⁵/6)`` (the series of
    ``log(−log1p(−q)/q)``; truncation error ``< q⁶/7 < 1e-17`` relative), on those entries alone:
    no division, so it stays exact when ``q`` underflows ``1 − Φ(x)`` or 0, in every floating dtype.
    """
    big = x >= 3.0
    log_cdf = torch.special.log_ndtr(torch.where(big, torch.zeros_like(x), x)) if log_cdf is None else log_cdf
    out = torch.log(-torch.where(big, torch.full_like(x, -1.0), log_cdf))
    if bool(big.any()):
        log_q = torch.special.log_ndtr(-x[big])
        q = torch.exp(log_q)  # may underflow to 0: harmless below
        series = q * (0.5 + q * (1.0 / 3.0 + q * (0.25 + q * (0.2 + q / 6.0))))
        out = out.masked_scatter(big, log_q + torch.log1p(series))
    return out


def log_expm1_ratio(s: Tensor) -> Tensor:
    """``log(expm1(s)/s)`` for ``s ≤ 0`` (→ 0 at ``s → 0``); the series
    ``s/2 + s²/24 − s⁴/2880 + s⁶/181440`` for ``|s| < 0.01`` (truncation error < 1e-20 relative)."""
    small = s > -1e-2
    s_big = torch.where(small, torch.full_like(s, -1.0), s)
    x = torch.where(small, s, torch.zeros_like(s))
    x2 = x * x
    series = x / 2 + x2 / 24 - x2 * x2 / 2880 + x2 * x2 * x2 / 181440
    return torch.where(small, series, torch.log(torch.expm1(s_big) / s_big))


# -- exact samplers ------------------------------------------------------------------------------


def sample_above(a: Tensor, generator: torch.Generator | None = None, max_rounds: int = 1000) -> Tensor:
    """Exact draws of ``Z ~ N(0, 1)`` conditioned on ``Z > a`` (elementwise, any shape).

    * ``a < 8``: inverse CDF on the upper side, ``Z = −Φ⁻¹(U·Φ(−a))``; ``Φ(−a) ≥ 6e-16`` is computed
      to full relative precision (``erfc``) and ``ndtri`` is relatively accurate for small
      arguments, so there is no cancellation (draws are clamped to ``≥ a`` against rounding);
    * ``a ≥ 8``: Robert (1995) — propose ``a + Exp(α)``, ``α = (a + sqrt(a² + 4))/2``, accept with
      probability ``exp(−(z − α)²/2)`` (acceptance > 0.98 there, → 1 as ``a → ∞``), so the far tail
      (``a = 30``, ``a = 1e3``) is sampled exactly without ever forming ``Φ(−a)``.
    """
    a = torch.as_tensor(a)
    tiny = torch.finfo(a.dtype).tiny
    tail = a >= 8.0
    a_body = torch.where(tail, torch.zeros_like(a), a)
    u = torch.rand(a.shape, dtype=a.dtype, device=a.device, generator=generator).clamp_min(tiny)
    out = torch.maximum(-torch.special.ndtri((u * torch.special.ndtr(-a_body)).clamp_min(tiny)), a_body)
    if bool(tail.any()):
        a_t = a[tail]
        alpha = 0.5 * (a_t + torch.sqrt(a_t * a_t + 4.0))
        z = torch.empty_like(a_t)
        todo = torch.ones_like(a_t, dtype=torch.bool)
        for _ in range(max_rounds):
            n = int(todo.sum())
            if n == 0:
                break
            e = torch.rand(n, dtype=a.dtype, device=a.device, generator=generator).clamp_min(tiny)
            prop = a_t[todo] - torch.log(e) / alpha[todo]
            u2 = torch.rand(n, dtype=a.dtype, device=a.device, generator=generator).clamp_min(tiny)
            ok = torch.log(u2) <= -0.5 * (prop - alpha[todo]) ** 2
            idx = torch.nonzero(todo, as_tuple=True)[0]
            z[idx[ok]] = prop[ok]
            todo[idx[ok]] = False
        else:  # pragma: no cover - probability < 0.02**1000
            raise RuntimeError("truncated-normal rejection sampler did not finish")
        out = out.masked_scatter(tail, z)
    return out


def sample_truncated(
    mean: Tensor, std: Tensor, lower: Tensor, generator: torch.Generator | None = None
) -> Tensor:
    """Exact draws of ``N(mean, std²)`` truncated to ``(0, ∞)`` where ``lower`` is True and to
    ``(−∞, 0)`` where it is False (broadcast elementwise)."""
    mean, std = torch.broadcast_tensors(mean, std)
    lower = torch.as_tensor(lower, device=mean.device).expand_as(mean)
    sign = torch.where(lower, torch.ones_like(mean), -torch.ones_like(mean))
    # m > 0  <=>  Z > −mean/std ;  m < 0  <=>  −Z > mean/std  (Z standard normal, m = mean + std·Z)
    z = sample_above(-sign * mean / std, generator=generator)
    return sign * (sign * mean + std * z)


def sample_some_positive(
    mean: Tensor, std: Tensor, segment: Tensor, num_segments: int, generator: torch.Generator | None = None
) -> Tensor:
    """Exact joint draws of independent ``m_i ~ N(mean_i, std_i²)`` conditioned on at least one
    ``m_i > 0`` in every segment (a positive bag's latents in the MIL probit model).

    The position ``K`` of a segment's first positive entry has ``P(K = k) ∝ Π_{i<k} Φ(−z_i) Φ(z_k)``,
    ``z = mean/std`` (the events "first positive at k" partition the constraint); it is drawn by the
    Gumbel-max trick on those log-weights, then the entries before ``K`` are drawn below 0, the
    ``K``-th above 0 and the rest unrestricted (:func:`sample_truncated`). Work and memory are linear
    in the entries, whatever the segments' lengths.

    Args:
        mean, std: ``(..., n)``; every leading index (e.g. a chain) is drawn independently.
        segment: ``(n,)`` segment of each entry, ``0..num_segments − 1``, non-decreasing (each
            segment's entries contiguous, in the order "first" refers to).
        num_segments: the number of segments (each must have an entry).
    """
    mean, std = torch.broadcast_tensors(mean, std)
    n = mean.shape[-1]
    z = (mean / std).double()
    log_below = torch.special.log_ndtr(-z)
    before = torch.cumsum(log_below, -1) - log_below  # Σ over all earlier entries of the row
    starts = torch.searchsorted(segment, torch.arange(num_segments, device=segment.device))
    log_w = before - before[..., starts][..., segment] + torch.special.log_ndtr(z)
    u = torch.rand(mean.shape, dtype=torch.float64, device=mean.device, generator=generator)
    score = log_w - torch.log(-torch.log(u.clamp_min(1e-300)))
    index = segment.expand(mean.shape)
    best = torch.full((*mean.shape[:-1], num_segments), -math.inf, dtype=score.dtype, device=mean.device)
    best = best.scatter_reduce(-1, index, score, "amax")
    position = torch.arange(n, device=mean.device).expand(mean.shape)
    # the first entry reaching its segment's maximum (ties have probability 0)
    first = torch.full(best.shape, n, dtype=position.dtype, device=mean.device).scatter_reduce(
        -1, index, torch.where(score == best.gather(-1, index), position, n), "amin"
    ).gather(-1, index)
    truncated = sample_truncated(mean, std, position == first, generator=generator)  # above 0 at K, below before
    free = mean + std * torch.randn(mean.shape, dtype=mean.dtype, device=mean.device, generator=generator)
    return torch.where(position > first, free, truncated)
