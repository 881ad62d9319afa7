"""The one projection cache of :class:`~milgp.variational.fit.ClosedFormSteps` (chunks of instances)
and :class:`~milgp.variational.aggregate_fit.AggregateSteps` (chunks = groups of whole bags)."""
from __future__ import annotations

import itertools
from typing import Iterator, Sequence

import torch
from torch import Tensor

from milgp.models.closed_form_strategy import ClosedFormStrategy, Projection, WhitenedPosterior
from milgp.variational.natural_update import NaturalStatistics, natural_statistics

__all__ = ["DEFAULT_CACHE_BYTES", "ProjectionCache"]


DEFAULT_CACHE_BYTES = 2 * 1024**3
"""Default budget of :class:`ProjectionCache`'s cache of ``A`` (``N·(M+2)`` floats; 2 GiB holds
``N = 10⁶`` at ``M = 200`` in float64)."""


class ProjectionCache:
    """The whitened projection ``A = L⁻¹K_zx`` of a fixed set of inputs ``x`` ``(N, D)``, chunked
    and cached.

    ``chunk_size`` is the number of instances per chunk, or the sizes of consecutive chunks (which
    then add up to ``N``: e.g. groups of whole bags laid out one after the other). With ``order``
    ``(N,)`` the inputs are taken in that order, ``x[order]``, chunk by chunk (no copy of ``x``).

    ``A`` is computed once and reused by every pass until :meth:`invalidate` (after a
    hyperparameter step). It is kept (as ``Aᵀ`` ``(N, M)``: contiguous chunks and minibatch rows)
    only when ``N·(M + 2)`` floats fit ``cache_bytes``; otherwise each pass recomputes it chunk by
    chunk. ``L`` is factorised once per hyperparameter setting either way. No gradients are recorded.
    """

    def __init__(
        self, strategy: ClosedFormStrategy, x: Tensor, chunk_size: int | Sequence[int], cache_bytes: float, order: Tensor | None = None
    ):
        self.strategy, self.x, self.order = strategy, x, order
        N, M = x.shape[0], strategy.num_inducing
        if isinstance(chunk_size, int):
            step = max(1, chunk_size)
            self.bounds = [(s, min(N, s + step)) for s in range(0, N, step)]
        else:
            ends = list(itertools.accumulate(chunk_size, initial=0))
            if ends[-1] != N:
                raise ValueError(f"the chunk sizes add up to {ends[-1]}, not to the {N} inputs")
            self.bounds = list(zip(ends[:-1], ends[1:]))
        self.cacheable = N * (M + 2) * x.element_size() <= cache_bytes
        self.invalidate()

    def invalidate(self) -> None:
        self._L: Tensor | None = None
        self._AT: Tensor | None = None
        self._prior_var: Tensor | None = None
        self._prior_mean: Tensor | None = None
        self._residual: Tensor | None = None

    def adopt(self, L: Tensor, proj: Projection) -> None:
        """Use an already computed projection of all of this projector's inputs."""
        proj = proj.with_residual()
        self._L, self._AT, self._prior_var, self._prior_mean = L, proj.A.mT, proj.prior_var, proj.prior_mean
        self._residual = proj.residual

    @property
    def cached(self) -> bool:
        return self._AT is not None

    def L(self) -> Tensor:
        if self._L is None:
            with torch.no_grad():
                self._L = self.strategy.inducing_cholesky()
        return self._L

    def _inputs(self, s: int, e: int) -> Tensor:
        """The inputs of positions ``s:e`` (in ``order`` when given)."""
        return self.x[s:e] if self.order is None else self.x[self.order[s:e]]

    def _fill(self) -> None:
        x, N, M = self.x, self.x.shape[0], self.strategy.num_inducing
        AT = x.new_empty((N, M))
        prior_var, prior_mean, residual = x.new_empty(N), x.new_empty(N), x.new_empty(N)
        with torch.no_grad():
            L = self.L()
            for s, e in self.bounds:  # the residual chunk by chunk: no second N × M temporary
                proj = self.strategy.projection(self._inputs(s, e), L).with_residual()
                AT[s:e], prior_var[s:e], prior_mean[s:e], residual[s:e] = proj.A.mT, proj.prior_var, proj.prior_mean, proj.residual
        self._AT, self._prior_var, self._prior_mean, self._residual = AT, prior_var, prior_mean, residual

    def chunks(self) -> Iterator[tuple[int, Projection]]:
        """Yield ``(start, Projection)`` of every chunk in turn."""
        for s, e in self.bounds:
            proj = self.rows(slice(s, e))  # None when not cached: computed (callers run under torch.no_grad())
            yield s, proj if proj is not None else self.strategy.projection(self._inputs(s, e), self.L())

    def moments(self, q: WhitenedPosterior) -> tuple[Tensor, Tensor]:
        """``q(f)`` mean and variance ``(N,)`` of all inputs under ``q``, chunk by chunk."""
        with torch.no_grad():
            parts = [self.strategy.marginals(proj, q) for _, proj in self.chunks()]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def statistics(self, b: Tensor, lam: Tensor) -> NaturalStatistics:
        """Natural statistics of ``Σ_n b_n f_n − ½ λ_n f_n²`` over all inputs (``b``, ``λ`` ``(N,)``)."""
        with torch.no_grad():
            stats = None
            for s, proj in self.chunks():
                e = s + proj.A.shape[1]
                part = natural_statistics(proj.A, b[s:e], lam[s:e], proj.prior_mean)
                stats = part if stats is None else stats + part
        return stats

    def rows(self, idx: Tensor | slice) -> Projection | None:
        """The projection of the inputs at positions ``idx`` (of ``x[order]`` with ``order``) from the
        cache (``None`` when nothing is cached)."""
        if self._AT is None and self.cacheable:
            self._fill()
        if self._AT is None:
            return None
        return Projection(self._AT[idx].mT, self._prior_var[idx], self._prior_mean[idx], self._residual[idx])
