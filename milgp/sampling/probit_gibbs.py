"""Collapsed Gibbs sampler for the MIL-GP-Probit model (seed 003 §3.5, Eqs. 26–28).

The model is the FITC one of seed 003 (Eqs. 5–12): ``u ~ N(0, K_zz)``,
``f | u ~ N(K_xz K_zz⁻¹ u, diag(K̃))``, ``m_n ~ N(f_n, 1)``, bag constraints on ``m``. Integrating
``f`` out gives ``m | u ~ N(K_xz K_zz⁻¹ u, D)`` with ``D = diag(1 + K̃_nn)`` — the per-instance
variance is ``1 + K̃_nn``, not 1 (DESIGN §4; the paper's Eq. 26 prints ``Σ^u`` of Eq. 17, which
is the ``K̃ = 0`` special case). Whitened (``v = L⁻¹u``, ``A = L⁻¹K_zx``, prior mean ``μ₀``):

* ``v | m ~ N(P⁻¹ A D⁻¹ (m − μ₀), P⁻¹)``, ``P = I + A D⁻¹ Aᵀ`` (Eq. 26; ``P`` is fixed, factorised once);
* ``m_n | v, m_{b∖n} ~ N(μ₀_n + A_nᵀ v, 1 + K̃_nn)`` restricted to (Eq. 28)
  ``(−∞, 0)`` if ``Y_b = 0``; ``(0, ∞)`` if ``Y_b = 1`` and every other ``m_i`` of the bag is negative;
  unrestricted otherwise.

The ``m`` of a positive bag are updated one position at a time (all bags and all chains at once,
each update seeing the bag-mates' latest values), so every state satisfies the constraint; the
negative-bag ``m`` are conditionally independent and drawn in one go. Truncated normals are drawn
exactly (:func:`milgp.likelihoods.truncated_normal.sample_truncated`). Chains are vectorised
(``(C, M)`` and ``(C, N)`` tensors), start from ``q(v)`` when given (else the prior), and report
split-R̂ and ESS (:mod:`milgp.sampling.diagnostics`) of the latent means ``μ₀_n + A_nᵀ v`` of up to
``diagnostic_instances`` training instances.

Predictions average over the kept draws of ``v`` and are Rao–Blackwellised over ``f*`` and ``m*``:
``P(h* = 1 | v) = Φ(μ*(v)/sqrt(1 + K̃**))`` and, FITC making the ``f*`` of a bag independent given
``v``, ``P(Y* = 0 | v) = Π_n Φ(−μ*_n(v)/sqrt(1 + K̃*_nn))`` (no orthant integral needed).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor
from tqdm.auto import tqdm

from milgp.data.bags import BagBatch, segment_sum, to_padded
from milgp.likelihoods.mil_probit import probit_instance_probability
from milgp.likelihoods.truncated_normal import sample_truncated
from milgp.linalg import robust_cholesky
from milgp.models.sparse_gp import SparseGP, WhitenedPosterior
from milgp.sampling.diagnostics import effective_sample_size, split_rhat

__all__ = ["ProbitGibbsResult", "sample_probit_posterior"]


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
    """

    v: Tensor
    m_last: Tensor
    rhat: Tensor
    ess: Tensor
    monitored: Tensor
    seconds: float = 0.0
    settings: dict = field(default_factory=dict)

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

    # -- predictions ----------------------------------------------------------------------------
    def _latent_draws(self, model: SparseGP, x: Tensor) -> tuple[Tensor, Tensor]:
        with torch.no_grad():
            proj = model.projection(x)
            mu = proj.prior_mean + self.draws @ proj.A  # (S, N)
            resid = (proj.prior_var - (proj.A * proj.A).sum(0)).clamp_min(0.0)  # K̃_nn
        return mu, resid

    def latent_mean(self, model: SparseGP, x: Tensor) -> Tensor:
        """Posterior mean of ``f*`` ``(N,)``."""
        mu, _ = self._latent_draws(model, x)
        return mu.mean(0)

    def instance_probability(self, model: SparseGP, x: Tensor) -> tuple[Tensor, Tensor]:
        """``E[Φ(f*)]`` and ``std[Φ(f*)]`` under the posterior, ``(N,)`` each."""
        mu, resid = self._latent_draws(model, x)
        p_s, sd_s = probit_instance_probability(mu, resid.expand_as(mu))
        p = p_s.mean(0)
        second = (sd_s * sd_s + p_s * p_s).mean(0)
        return p, (second - p * p).clamp_min(0.0).sqrt()

    def bag_probability(self, model: SparseGP, x: Tensor, bag_index: Tensor, num_bags: int) -> tuple[Tensor, Tensor]:
        """``P(Y* = 1)`` per bag and its Monte-Carlo standard error (draws treated as independent)."""
        mu, resid = self._latent_draws(model, x)
        log_neg = torch.special.log_ndtr(-mu / torch.sqrt(1.0 + resid))  # (S, N)
        per_draw = torch.exp(segment_sum(log_neg.mT, bag_index, num_bags)).mT  # (S, B)
        p = 1.0 - per_draw.mean(0)
        return p.clamp(0.0, 1.0), per_draw.std(0) / math.sqrt(per_draw.shape[0])


def sample_probit_posterior(
    model: SparseGP,
    batch: BagBatch,
    *,
    num_samples: int = 1000,
    burn_in: int = 500,
    thin: int = 1,
    num_chains: int = 4,
    init: WhitenedPosterior | None = None,
    diagnostic_instances: int = 500,
    seed: int = 0,
    progress: bool = False,
) -> ProbitGibbsResult:
    """Run ``num_chains`` collapsed Gibbs chains at ``model``'s current hyperparameters.

    Args:
        batch: training bags (``x`` on the model's device/dtype, ``bag_labels`` in {0, 1}).
        num_samples: kept draws per chain (after ``burn_in`` iterations, every ``thin``-th).
        init: start ``v`` from draws of this ``q(v)`` (e.g. the VI posterior); ``None``: the prior.
        diagnostic_instances: how many training instances' latent means feed R̂/ESS.
    """
    if num_samples < 4 or burn_in < 0 or thin < 1 or num_chains < 1:
        raise ValueError("need num_samples >= 4, burn_in >= 0, thin >= 1, num_chains >= 1")
    start = time.perf_counter()
    gen = torch.Generator(device=batch.x.device).manual_seed(seed)
    x, bag_index, B = batch.x, batch.bag_index, batch.num_bags
    labels = batch.bag_labels.to(torch.bool)
    dtype, device = x.dtype, x.device
    with torch.no_grad():
        proj = model.projection(x)
        A, mu0 = proj.A, proj.prior_mean  # (M, N), (N,)
        M, N = A.shape
        d = 1.0 + (proj.prior_var - (A * A).sum(0)).clamp_min(0.0)  # 1 + K̃_nn
        sd = d.sqrt()
        P = torch.eye(M, dtype=dtype, device=device) + (A / d) @ A.mT
        L_P = robust_cholesky(0.5 * (P + P.mT), what="Gibbs u|m precision")
        pos_inst = labels[bag_index]
        # positive-bag instances in a padded (B₊, n_max) layout for the sequential sweep
        pos_bags = torch.nonzero(labels, as_tuple=True)[0]
        has_pos = pos_bags.numel() > 0
        if has_pos:
            orig = torch.nonzero(pos_inst, as_tuple=True)[0]
            remap = torch.full((B,), -1, dtype=torch.long, device=device)
            remap[pos_bags] = torch.arange(len(pos_bags), device=device)
            pad_idx, pad_mask = to_padded(orig, remap[bag_index[orig]], len(pos_bags), fill=0)

        def randn(*shape: int) -> Tensor:
            return torch.randn(shape, dtype=dtype, device=device, generator=gen)

        C = num_chains
        if init is not None:
            L_S = robust_cholesky(init.S, what="initial q(v) covariance")
            v = init.m + randn(C, M) @ L_S.mT
        else:
            v = randn(C, M)
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
            # m | v (Eq. 28). The mean does not depend on the other m, so both candidates of every
            # instance — constrained (negative bag: < 0; positive bag: > 0) and free — are drawn at
            # once; the sweep over positions of positive bags then only picks one per instance.
            forced = sample_truncated(mean_m, sd.expand_as(mean_m), pos_inst.expand_as(mean_m), generator=gen)
            if has_pos:
                free = mean_m + sd * randn(C, N)
                f_pad, c_pad = free[:, pad_idx], forced[:, pad_idx]  # (C, B₊, n_max)
                cur = torch.where(pad_mask, m[:, pad_idx], torch.full_like(f_pad, -1.0))
                n_pos = (cur > 0).sum(-1)  # (C, B₊)
                for k in range(pad_idx.shape[1]):
                    was = cur[..., k] > 0
                    others = n_pos - was.long()
                    new = torch.where(others > 0, f_pad[..., k], c_pad[..., k])
                    new = torch.where(pad_mask[:, k], new, cur[..., k])
                    cur[..., k] = new
                    n_pos = others + (new > 0).long()
                forced[:, pad_idx[pad_mask]] = cur[:, pad_mask]
            m = forced
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
        settings=dict(num_samples=num_samples, burn_in=burn_in, thin=thin, num_chains=num_chains, seed=seed),
    )
