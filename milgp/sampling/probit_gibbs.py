"""Collapsed Gibbs sampler for the MIL-GP-Probit model (Wang & Pinar, *The Multiple
Instance Learning Gaussian Process Probit Model*, AISTATS 2021, §3.5, Eqs. 26–28).

The model is the FITC one of Wang & Pinar 2021 (Eqs. 5–12): ``u ~ N(0, K_zz)``,
``f | u ~ N(K_xz K_zz⁻¹ u, diag(K̃))``, ``m_n ~ N(f_n, 1)``, bag constraints on ``m``. Integrating
``f`` out gives ``m | u ~ N(K_xz K_zz⁻¹ u, D)`` with ``D = diag(1 + K̃_nn)`` — the per-instance
variance is ``1 + K̃_nn``, not 1 (the paper's Eq. 26 prints ``Σ^u`` of Eq. 17, which
is the ``K̃ = 0`` special case). Whitened (``v = L⁻¹u``, ``A = L⁻¹K_zx``, prior mean ``μ₀``):

* ``v | m ~ N(P⁻¹ A D⁻¹ (m − μ₀), P⁻¹)``, ``P = I + A D⁻¹ Aᵀ`` (Eq. 26; ``P`` is fixed, factorised once);
* ``m_n | v, m_{b∖n} ~ N(μ₀_n + A_nᵀ v, 1 + K̃_nn)`` restricted to (Eq. 28)
  ``(−∞, 0)`` if ``Y_b = 0``; ``(0, ∞)`` if ``Y_b = 1`` and every other ``m_i`` of the bag is negative;
  unrestricted otherwise.

Given ``v`` the bags' ``m`` are independent, and the ``m`` of a positive bag are drawn jointly and
exactly, conditioned on at least one being positive
(:func:`~milgp.likelihoods.truncated_normal.sample_some_positive`): the blocked form of the
single-site updates of Eq. 28, with the same stationary distribution, every state within the
constraint, and work linear in the instances (the single-site sweep over a bag's positions cost one
pass per position of the longest positive bag: about 15 minutes for one bag of 20,000 instances);
the negative-bag ``m`` are drawn in one go (:func:`~milgp.likelihoods.truncated_normal.sample_truncated`).
Chains are vectorised, start over-dispersed and report split-R̂ and ESS
(:mod:`milgp.sampling.diagnostics`) of the latent means ``μ₀_n + A_nᵀ v`` of up to
``diagnostic_instances`` training instances.

Predictions average over the kept draws of ``v``, Rao–Blackwellised over ``f*`` and ``m*``:
``P(h* = 1 | v) = Φ(μ*(v)/sqrt(1 + K̃**))`` and, the FITC ``f*`` of a bag being independent given
``v``, ``P(Y* = 0 | v) = Π_n Φ(−μ*_n(v)/sqrt(1 + K̃*_nn))`` (not the full within-bag covariance of
VI's ``bag_rule="joint"``: docs/probit.md, "Gibbs sampler").
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from gpytorch.models import ApproximateGP
from torch import Tensor
from tqdm.auto import tqdm

from milgp.data.bags import BagBatch, Bags, segment_sum
from milgp.likelihoods.instance_link import ProbitLink
from milgp.likelihoods.truncated_normal import sample_some_positive, sample_truncated
from milgp.linalg import robust_cholesky
from milgp.models.closed_form_strategy import WhitenedPosterior
from milgp.sampling.diagnostics import effective_sample_size, split_rhat

__all__ = ["DEFAULT_INIT_DISPERSION", "DEFAULT_MAX_ELEMENTS", "ProbitGibbsResult", "sample_probit_posterior"]

DEFAULT_MAX_ELEMENTS = 2**22
"""Default bound on the (draw, instance[, node]) entries of one prediction block (4.2 M: 32 MiB
in float64 per temporary)."""

DEFAULT_INIT_DISPERSION = 4.0
"""Default inflation of the starting covariance: chains start from ``N(m, 4·S)`` for a given
``q(v) = N(m, S)`` (twice its standard deviation)."""

RHAT_LIMIT = 1.05
"""Largest split-R̂ of a monitored latent mean below which the chains count as mixed."""
ESS_LIMIT = 100.0
"""Smallest effective sample size (all chains together) of a monitored latent mean that counts as
enough. Looser than the R̂ < 1.01, ESS > 400 of Vehtari et al. (*Rank-normalization, folding, and
localization: an improved R̂ for assessing convergence of MCMC*, Bayesian Analysis 2021), as they
apply to the worst of several hundred latent means: only plainly unmixed chains are flagged."""


@dataclass
class ProbitGibbsResult:
    """Draws of the whitened inducing values and their diagnostics.

    Attributes:
        v: ``(C, S, M)`` kept draws (after burn-in and thinning) per chain.
        m_last: ``(C, N)`` the last augmentation state (to continue sampling).
        rhat: ``(K,)`` split-R̂ of the latent means of the monitored instances.
        ess: ``(K,)`` effective sample sizes of the same.
        monitored: ``(K,)`` indices of the monitored training instances.
        seconds: wall time.
        v_start: ``(C, M)`` the chains' starting points (over-dispersed draws, see
            :func:`sample_probit_posterior`).
    """

    v: Tensor
    m_last: Tensor
    rhat: Tensor
    ess: Tensor
    monitored: Tensor
    seconds: float = 0.0
    settings: dict = field(default_factory=dict)
    v_start: Tensor | None = None

    @property
    def draws(self) -> Tensor:
        """``(C·S, M)`` all kept draws."""
        return self.v.reshape(-1, self.v.shape[-1])

    def summary(self) -> dict:
        """Max/median split-R̂ and min/median ESS over the monitored quantities."""
        return {
            "max_rhat": float(self.rhat.max()),
            "median_rhat": float(self.rhat.median()),
            "min_ess": float(self.ess.min()),
            "median_ess": float(self.ess.median()),
            "draws": int(self.v.shape[0] * self.v.shape[1]),
            "chains": int(self.v.shape[0]),
            "seconds": self.seconds,
        }

    def convergence_problem(self, rhat_limit: float = RHAT_LIMIT, ess_limit: float = ESS_LIMIT) -> str | None:
        """One line naming what is short of the limits (split-R̂ above ``rhat_limit``, ESS below
        ``ess_limit`` for some monitored latent mean), or ``None``."""
        s = self.summary()
        problems = [f"max split-R̂ {s['max_rhat']:.3f} > {rhat_limit}"] if s["max_rhat"] > rhat_limit else []
        problems += [f"min ESS {s['min_ess']:.0f} < {ess_limit:.0f}"] if s["min_ess"] < ess_limit else []
        if not problems:
            return None
        return f"{' and '.join(problems)} over {len(self.rhat)} monitored latent means ({s['chains']} chains × {s['draws'] // s['chains']} draws)"

    # -- predictions: in blocks of at most ``max_elements`` (draw, instance) pairs (docs/probit.md, "Memory") --
    def latent_mean(self, model: ApproximateGP, x: Tensor, max_elements: int = DEFAULT_MAX_ELEMENTS) -> Tensor:
        """Posterior mean of ``f*`` ``(N,)``; instances in chunks of ``max_elements // (C·S)``."""
        draws = self.draws
        with torch.no_grad():
            out = [(mu0 + draws @ A).mean(0) for mu0, A, _ in _fitc_chunks(model, x, max(1, max_elements // draws.shape[0]))]
        return torch.cat(out) if out else x.new_zeros(0)

    def instance_probability(
        self, model: ApproximateGP, x: Tensor, num_points: int = 32, max_elements: int = DEFAULT_MAX_ELEMENTS
    ) -> tuple[Tensor, Tensor]:
        """``E[Φ(f*)]`` and ``std[Φ(f*)]`` under the posterior, ``(N,)`` each.

        Per draw ``v``: ``Φ(μ*(v)/sqrt(1 + K̃))`` and its std over ``f* | v`` (Sheppard, ``num_points``
        Gauss–Legendre nodes), then the law of total variance over the draws; instances (and, when
        ``C·S·num_points > max_elements``, draws) in chunks of at most ``max_elements`` entries
        (docs/probit.md, "Memory").
        """
        draws = self.draws
        S = draws.shape[0]
        per_draw = S * num_points
        if per_draw <= max_elements:
            chunk, draw_chunk = max(1, max_elements // per_draw), S
        else:
            chunk, draw_chunk = 1, max(1, max_elements // num_points)
        ps, sds = [], []
        with torch.no_grad():
            for mu0, A, resid in _fitc_chunks(model, x, chunk):
                sum_p = mu0.new_zeros(mu0.shape)
                sum_2 = mu0.new_zeros(mu0.shape)
                for d0 in range(0, S, draw_chunk):  # one pass (all S draws) unless they exceed max_elements
                    mu = mu0 + draws[d0 : d0 + draw_chunk] @ A  # (s, n_c)
                    p_s, sd_s = ProbitLink().moments(mu, resid.expand_as(mu), num_points)
                    sum_p += p_s.sum(0)
                    sum_2 += (sd_s * sd_s + p_s * p_s).sum(0)
                p, second = sum_p / S, sum_2 / S
                ps.append(p)
                sds.append((second - p * p).clamp_min(0.0).sqrt())
        if not ps:
            return x.new_zeros(0), x.new_zeros(0)
        return torch.cat(ps), torch.cat(sds)

    def bag_probability_draws(self, model: ApproximateGP, x: Tensor, bags: Bags, max_elements: int = DEFAULT_MAX_ELEMENTS) -> Tensor:
        """Per-draw ``P(Y* = 0 | v) = Π_n Φ(−μ*_n(v)/sqrt(1 + K̃*_nn))`` laid out ``(C, S, B)``.

        Bags in groups of whole bags (:meth:`milgp.data.bags.Bags.groups`, at most
        ``max_elements // (C·S)`` instances unless one bag alone is larger), the draws in chunks of
        ``max_elements // n_g``: apart from the output, peak ``O(max_elements + M·n_g)`` elements.
        """
        draws = self.draws
        S = draws.shape[0]
        C = self.v.shape[0]
        num_bags = bags.num_bags
        out = x.new_zeros(S, num_bags)
        with torch.no_grad():
            L = model.variational_strategy.inducing_cholesky()
            for g in bags.groups(max(1, max_elements // S)):
                mu0, A, resid = _fitc_projection(model, x[g.inst], L)
                scale = torch.sqrt(1.0 + resid)
                n_g = g.inst.shape[0]
                draw_chunk = S if S * n_g <= max_elements else max(1, max_elements // n_g)
                for d0 in range(0, S, draw_chunk):
                    mu = mu0 + draws[d0 : d0 + draw_chunk] @ A  # (s, n_g)
                    log_neg = torch.special.log_ndtr(-mu / scale)
                    out[d0 : d0 + draw_chunk, g.bags] = torch.exp(segment_sum(log_neg.mT, g.local, g.num_bags)).mT
        return out.reshape(C, S // C, num_bags)

    def bag_probability(
        self, model: ApproximateGP, x: Tensor, bags: Bags, max_elements: int = DEFAULT_MAX_ELEMENTS
    ) -> tuple[Tensor, Tensor]:
        """``P(Y* = 1)`` per bag and its Monte-Carlo standard error, ``(B,)`` each.

        The estimate is ``1 − mean_draws P(Y* = 0 | v)`` (Rao–Blackwellised over ``f*``, ``m*``), its
        standard error ``sd_draws / sqrt(ESS)``: the draws are autocorrelated, ESS is the multi-chain
        :func:`~milgp.sampling.diagnostics.effective_sample_size` of the per-draw bag probabilities
        (docs/probit.md, "Gibbs sampler"). Memory as :meth:`bag_probability_draws`.
        """
        per_draw = self.bag_probability_draws(model, x, bags, max_elements)  # (C, S, B)
        flat = per_draw.reshape(-1, bags.num_bags)
        p = 1.0 - flat.mean(0)
        ess = effective_sample_size(per_draw)
        se = flat.std(0) / torch.sqrt(ess)
        return p.clamp(0.0, 1.0), se


def _fitc_projection(model: ApproximateGP, x: Tensor, L: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(prior_mean, A, K̃)`` of ``x`` ``(n, D)``: ``(n,)``, ``(M, n)``, ``(n,)`` (``L``: ``None`` = computed)."""
    proj = model.variational_strategy.projection(x, L).with_residual()
    return proj.prior_mean, proj.A, proj.residual.clamp_min(0.0)  # K̃_nn


def _fitc_chunks(model: ApproximateGP, x: Tensor, chunk: int) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """:func:`_fitc_projection` of ``x`` ``(N, D)`` in chunks of ``chunk`` instances (one ``K_zz`` factorisation)."""
    L = model.variational_strategy.inducing_cholesky()
    for start in range(0, x.shape[0], chunk):
        yield _fitc_projection(model, x[start : start + chunk], L)


def sample_probit_posterior(
    model: ApproximateGP,
    batch: BagBatch,
    *,
    num_samples: int = 1000,
    burn_in: int = 500,
    thin: int = 1,
    num_chains: int = 4,
    init: WhitenedPosterior | None = None,
    init_dispersion: float = DEFAULT_INIT_DISPERSION,
    diagnostic_instances: int = 500,
    seed: int = 0,
    progress: bool = False,
) -> ProbitGibbsResult:
    """Run ``num_chains`` collapsed Gibbs chains at ``model``'s current hyperparameters.

    Args:
        batch: training bags (``x`` on the model's device/dtype, ``bag_labels`` in {0, 1}).
        num_samples: kept draws per chain (after ``burn_in`` iterations, every ``thin``-th).
        init: start each chain's ``v`` from an independent draw of this ``q(v) = N(m, S)`` (e.g. the
            VI posterior) with its covariance inflated to ``init_dispersion · S``; ``None``: draws
            of the prior ``N(0, I)``.
        init_dispersion: covariance inflation ``≥ 1`` of the starting distribution
            (:data:`DEFAULT_INIT_DISPERSION`), so that split-R̂ can detect chains that have not
            forgotten their start (docs/probit.md, "Gibbs sampler"); the starts are drawn from ``seed``.
        diagnostic_instances: how many training instances' latent means feed R̂/ESS.
    """
    if num_samples < 4 or burn_in < 0 or thin < 1 or num_chains < 1:
        raise ValueError("need num_samples >= 4, burn_in >= 0, thin >= 1, num_chains >= 1")
    if not (math.isfinite(init_dispersion) and init_dispersion >= 1.0):
        raise ValueError(f"init_dispersion must be a finite number >= 1, got {init_dispersion!r}")
    start = time.perf_counter()
    gen = torch.Generator(device=batch.x.device).manual_seed(seed)
    x, bag_index = batch.x, batch.bag_index
    labels = batch.bag_labels.to(torch.bool)
    dtype, device = x.dtype, x.device
    with torch.no_grad():
        mu0, A, resid = _fitc_projection(model, x, None)  # (N,), (M, N), (N,)
        M, N = A.shape
        d = 1.0 + resid
        sd = d.sqrt()
        P = torch.eye(M, dtype=dtype, device=device) + (A / d) @ A.mT
        L_P = robust_cholesky(0.5 * (P + P.mT), what="Gibbs u|m precision")
        pos_inst = labels[bag_index]
        # the positive bags' instances, each bag's contiguous (in its own order), for their joint draw
        in_positive = torch.nonzero(pos_inst, as_tuple=True)[0]
        in_positive = in_positive[torch.argsort(bag_index[in_positive], stable=True)]
        in_negative = torch.nonzero(~pos_inst, as_tuple=True)[0]
        positive_bag = torch.unique_consecutive(bag_index[in_positive], return_inverse=True)[1]
        num_positive = int(positive_bag[-1]) + 1 if len(in_positive) else 0

        def randn(*shape: int) -> Tensor:
            return torch.randn(shape, dtype=dtype, device=device, generator=gen)

        C = num_chains
        if init is not None:
            L_S = robust_cholesky(init.S, what="initial q(v) covariance")
            v = init.m + math.sqrt(init_dispersion) * (randn(C, M) @ L_S.mT)  # N(m, init_dispersion·S)
        else:
            v = randn(C, M)
        v_start = v.clone()
        mean_m = mu0 + v @ A  # (C, N)
        m = sample_truncated(mean_m, sd.expand_as(mean_m), pos_inst.expand_as(mean_m), generator=gen)

        K = min(diagnostic_instances, N)
        monitored = torch.randperm(N, generator=torch.Generator().manual_seed(seed))[:K].to(device)
        kept = []
        total = burn_in + num_samples * thin
        for it in tqdm(range(total), disable=not progress, desc="gibbs", leave=False):
            # v | m
            h = ((m - mu0) / d) @ A.mT  # (C, M)
            mean_v = torch.cholesky_solve(h.mT, L_P).mT
            v = mean_v + torch.linalg.solve_triangular(L_P.mT, randn(M, C), upper=True).mT
            mean_m = mu0 + v @ A  # (C, N)
            # m | v (Eq. 28 for every bag at once): a negative bag's m below 0; a positive bag's
            # jointly, exactly, given that at least one is positive
            m = torch.empty_like(mean_m)
            m[:, in_negative] = sample_truncated(mean_m[:, in_negative], sd[in_negative], False, generator=gen)
            if num_positive:
                m[:, in_positive] = sample_some_positive(
                    mean_m[:, in_positive], sd[in_positive], positive_bag, num_positive, generator=gen
                )
            if it >= burn_in and (it - burn_in) % thin == thin - 1:
                kept.append(v.clone())
        V = torch.stack(kept, 1)  # (C, S, M)
        f_mon = mu0[monitored] + V @ A[:, monitored]  # (C, S, K)
        rhat = split_rhat(f_mon) if C * V.shape[1] >= 8 else torch.ones(K, dtype=dtype)
        ess = effective_sample_size(f_mon)
    return ProbitGibbsResult(
        v=V,
        m_last=m,
        rhat=rhat,
        ess=ess,
        monitored=monitored,
        seconds=time.perf_counter() - start,
        v_start=v_start,
        settings=dict(
            num_samples=num_samples, burn_in=burn_in, thin=thin, num_chains=num_chains, seed=seed,
            init="prior" if init is None else "q(v)", init_dispersion=init_dispersion,
        ),
    )
