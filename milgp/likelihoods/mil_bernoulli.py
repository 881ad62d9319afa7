"""ψ-VGPMIL bag likelihood: logistic instances, noisy bag label (Castro-Macías et al., *Hyperbolic
secant representation of the logistic function: application to probabilistic multiple instance
learning for CT intracranial hemorrhage detection*, Artificial Intelligence 2024, §2–5).

Model (Castro-Macías et al. 2024, Eqs. 1, 4, 18): ``p(y_n | f_n) = sigmoid(f_n)^{y_n} sigmoid(−f_n)^{1−y_n}`` with the
hyperbolic secant part of the logistic replaced by a GSM density ψ, and the bag label
``p(T_b | y_b) = H^{G_b} / (H + 1)``, ``G_b = T_b max y_b + (1 − T_b)(1 − max y_b)``.

Local variables, closed form (Algorithm 1): ``c_n = sqrt(μ_n² + σ²_n)``, ``θ_n = θ_ψ(c_n)`` (Eq. 28),
and ``q(y_n) = Bern(π_n)`` (Eq. 25, :mod:`milgp.likelihoods.noisy_or`). The augmented expected
log-likelihood is quadratic with ``b_n = π_n − ½`` and ``λ_n = θ_n`` (Eqs. 26–27).

ELBO (closed form, every term exact for ψ = φ):

    Σ_n [(π_n − ½) μ_n + log ψ(c_n) + log π] + Σ_b (log H · E[G_b] − log(H+1)) + Σ_n H[Bern(π_n)] − KL,

with ``E[max y_b] = 1 − Π_b (1 − π_i)``. For ψ = φ (VGPMIL) ``log φ(c) + log π = −log(2cosh(c/2))``
and the objective is a true lower bound of ``log p(T)``. For other ψ, Castro-Macías et al. 2024, Eq. 29 has a
global normaliser ``−log Z`` that depends on the kernel (Eq. 20); like the authors' code we replace
it by its ψ = φ value ``N log π``, so the objective drives the same updates of q(v), q(y) but is a
surrogate, not a bound, for model comparison across ψ.

Hyperparameters: for every ψ the kernel is learned on the ELBO of the logistic MIL model, while ψ
shapes the updates of q(v) (:meth:`MILBernoulliLikelihood.hyperparameter_terms` says why).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.distributions import Bernoulli

from milgp.data.bags import Bags
from milgp.likelihoods.base import AugmentedBagLikelihood, bag_share, check_bag_size_cap
from milgp.likelihoods.instance_link import LogisticLink
from milgp.likelihoods.noisy_or import MAX_RULE_DAMPING, PI_CLAMP, log_prob_bag_all_negative, update_instance_labels
from milgp.likelihoods.psi import GammaPsi, GSMDensity, HyperbolicSecantPsi
from milgp.likelihoods.quadrature import gauss_hermite_expectation

__all__ = ["MILBernoulliLikelihood", "make_psi"]

_LOG_PI = math.log(math.pi)
_LOGISTIC_PSI = HyperbolicSecantPsi()


def make_psi(psi: str | GSMDensity) -> GSMDensity:
    """``"pg"``/``"vgpmil"`` → :class:`HyperbolicSecantPsi`, ``"gamma"`` → :class:`GammaPsi`, or
    a :class:`GSMDensity` instance as is."""
    if isinstance(psi, GSMDensity):
        return psi
    names = {"pg": HyperbolicSecantPsi, "vgpmil": HyperbolicSecantPsi, "hyperbolic_secant": HyperbolicSecantPsi, "gamma": GammaPsi}
    if psi not in names:
        raise ValueError(f"unknown psi {psi!r}: use 'pg', 'gamma' or a GSMDensity instance")
    return names[psi]()


class MILBernoulliLikelihood(AugmentedBagLikelihood):
    """The ψ-VGPMIL bag likelihood for GPyTorch and for the closed-form fast path.

    Args:
        psi: the GSM density (``"pg"`` = VGPMIL, ``"gamma"`` = G-VGPMIL, or a :class:`GSMDensity`).
        H: bag-label noise parameter of Eq. 4 (the paper uses 100; some reference code 1e12).
        max_rule: ``"exact"`` leave-one-out noisy-OR for ``E[max y_{b∖n}]``, ``"max"`` (the largest
            other π, the reference code's) or ``"single"`` (0: single-instance learning); see
            :mod:`milgp.likelihoods.noisy_or`.
        damping: step of the ``"max"`` rule's parallel update (1: the reference code's undamped
            update, which can oscillate; see :data:`milgp.likelihoods.noisy_or.MAX_RULE_DAMPING`).
        bag_size_cap: temper the instance terms of bags longer than this
            (:class:`~milgp.likelihoods.base.AugmentedBagLikelihood`); ``None``: the published model.

    Persistent locals: ``π`` ``(N,)``. Per-call locals: ``c``, ``θ``.

    Bag predictions: :mod:`milgp.prediction.bag_rules` with :attr:`instance_link` (``σ``).
    """

    instance_link = LogisticLink()
    """``p(y = 1 | f) = σ(f)`` and its moments under ``q(f)`` (Castro-Macías et al. 2024, Eqs. 31–33)."""

    locals_range = (0.0, 1.0)  # π_n = q(y_n = 1)

    def __init__(
        self,
        psi: str | GSMDensity = "pg",
        H: float = 100.0,
        max_rule: str = "exact",
        damping: float = MAX_RULE_DAMPING,
        bag_size_cap: float | None = None,
    ):
        super().__init__()
        if not 1 < H < math.inf:
            raise ValueError(f"H must be a finite number > 1 (bag labels more likely right than wrong), got {H}")
        if max_rule not in ("exact", "max", "single"):
            raise ValueError(f"max_rule must be 'exact', 'max' or 'single', got {max_rule!r}")
        if not 0 < damping <= 1:
            raise ValueError(f"damping must be in (0, 1], got {damping}")
        self.psi = make_psi(psi)
        self.H = float(H)
        self.max_rule = max_rule
        self.damping = float(damping)
        self.bag_size_cap = check_bag_size_cap(bag_size_cap)

    @property
    def log_h(self) -> float:
        return math.log(self.H)

    # -- augmented-likelihood interface ----------------------------------------------------------
    def init_locals(self, bags: Bags, bag_labels: Tensor, mean: Tensor) -> Tensor:
        """``π`` at the fixed point of one pass from ``π = ½·T_b`` given the current means."""
        pi0 = (0.5 * bag_labels.to(mean.dtype))[bags.index].clamp(PI_CLAMP, 1 - PI_CLAMP)
        return self.update_locals(mean, None, bags, bag_labels, pi0)

    def update_locals(self, mean: Tensor, var: Tensor | None, bags: Bags, bag_labels: Tensor, locals_: Tensor) -> Tensor:
        # the exact sweep runs on the bags' position-major layout, computed once per Bags; with a
        # bag-size cap π ascends the tempered objective, whose instance term is w_b (π − ½) μ
        return update_instance_labels(self._tempered(mean, bags), locals_, bags, bag_labels, self.log_h, self.max_rule, damping=self.damping)

    def _quadratic_terms(self, mean: Tensor, var: Tensor, bags: Bags, bag_labels: Tensor, locals_: Tensor) -> tuple[Tensor, Tensor]:
        c = torch.sqrt(mean * mean + var)
        return locals_ - 0.5, self.psi.theta(c)

    def instance_label_posterior(self, mean: Tensor, var: Tensor, bags: Bags, bag_labels: Tensor, locals_: Tensor) -> Tensor:
        """``π`` itself: ``q(y)`` is the mean-field factor over the instance labels."""
        return locals_.clamp(0.0, 1.0)

    def elbo_terms(self, mean: Tensor, var: Tensor, bags: Bags, bag_labels: Tensor, locals_: Tensor) -> Tensor:
        c = torch.sqrt(mean * mean + var)
        return self._terms_given(self.psi.log_psi(c), mean, bags, bag_labels, locals_)

    def hyperparameter_terms(self, mean: Tensor, var: Tensor, bags: Bags, bag_labels: Tensor, locals_: Tensor) -> Tensor:
        """The exact logistic (ψ = φ) expected log-likelihood at the current π, whatever ψ is.

        ``(π_n − ½) μ_n + E_q[log φ(f_n)] + log π`` (20-node Gauss–Hermite) plus the q(y) entropy and
        bag terms: summed, minus the KL, the ELBO of the un-augmented logistic MIL model, a lower
        bound of ``log p(T)`` for every ψ (``FitResult.objective``, the estimators' ``elbo_``). The
        slack of the closed-form bound ``log φ(c)`` grows with the predictive variance and biases the
        kernel (docs/core.md, "Hyperparameter learning: what we found"); the ψ ≠ φ surrogate, without
        ``−log Z``, is unbounded in the kernel variance when ψ has heavier tails than φ.
        """
        expected_log_phi = gauss_hermite_expectation(_LOGISTIC_PSI.log_psi, mean, var, 20)
        return self._terms_given(expected_log_phi, mean, bags, bag_labels, locals_)

    def _terms_given(self, log_psi: Tensor, mean: Tensor, bags: Bags, bag_labels: Tensor, locals_: Tensor) -> Tensor:
        """The per-instance ELBO terms ``(N,)`` given the (bound on the) expected ``log ψ(f_n)``: the
        tempered ``(π_n − ½) μ_n + log ψ + log π`` plus the q(y) entropy and the bag terms
        (:meth:`bag_log_likelihood`)."""
        pi = locals_.clamp(PI_CLAMP, 1 - PI_CLAMP)
        instance = self._tempered((pi - 0.5) * mean + log_psi + _LOG_PI, bags)
        entropy = -(pi * torch.log(pi) + (1 - pi) * torch.log1p(-pi))
        return instance + entropy + bag_share(self.bag_log_likelihood(pi, bags, bag_labels), bags)

    def bag_log_likelihood(self, pi: Tensor, bags: Bags, bag_labels: Tensor) -> Tensor:
        """``E_q[log p(T_b | y_b)] = log H · E[G_b] − log(H + 1)`` per bag ``(B,)``."""
        p_any = -torch.expm1(log_prob_bag_all_negative(pi, bags.index, bags.num_bags))
        t = bag_labels.to(pi.dtype)
        expected_g = t * p_any + (1 - t) * (1 - p_any)
        return self.log_h * expected_g - math.log1p(self.H)

    # -- GPyTorch Likelihood API ----------------------------------------------------------------
    def forward(self, function_samples: Tensor, *args: Any, **kwargs: Any) -> Bernoulli:
        """Instance label given ``f``: ``Bernoulli(sigmoid(f))``."""
        return Bernoulli(logits=function_samples)

    def extra_repr(self) -> str:
        return f"H={self.H}, max_rule={self.max_rule!r}, damping={self.damping}, bag_size_cap={self.bag_size_cap}"
