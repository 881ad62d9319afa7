"""MIL-GP-Probit bag classifier with variational or Gibbs inference."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning

from milgp.data.bags import BagBatch, Bags
from milgp.estimators._mil_base import KERNEL_GRID, CandidateFit, MILClassifierBase
from milgp.estimators._validation import user_stacklevel
from milgp.likelihoods.mil_probit import MILProbitLikelihood
from milgp.prediction import BagRule, InstanceCalibrator, MarginalBagRule, OrthantRule, make_bag_rule
from milgp.sampling.probit_gibbs import sample_probit_posterior

__all__ = ["PROBIT_KERNEL_GRID", "ProbitMILClassifier"]

PROBIT_LOGISTIC_SCALE = 1.702
"""``Φ(x) ≈ σ(1.702 x)``: a probit latent is this much steeper than a logistic one."""
PROBIT_KERNEL_GRID = tuple((kind, factor, scale / PROBIT_LOGISTIC_SCALE**2) for kind, factor, scale in KERNEL_GRID)
"""The logistic models' candidate kernels on the probit scale (variances divided by 1.702²;
docs/probit.md)."""


@dataclass(eq=False, repr=False, kw_only=True)  # a scikit-learn __init__ (stores the settings as given); BaseEstimator's repr
class ProbitMILClassifier(MILClassifierBase):
    """MIL-GP-Probit bag classifier (Wang & Pinar, *The Multiple Instance Learning Gaussian Process
    Probit Model*, AISTATS 2021), with VI or Gibbs inference.

    Fitting, kernel search (on the probit scale: :data:`PROBIT_KERNEL_GRID`) and the calibrated bag
    decision as :class:`VGPMILClassifier` (:mod:`milgp.estimators._mil_base`) with
    :class:`~milgp.likelihoods.MILProbitLikelihood`: the probit locals are exact (truncated-normal
    expectations), so there is no ``H`` or max rule. Bag rules: ``"auto"`` (length-invariant,
    calibrated; the default), any :mod:`milgp.prediction.bag_rules` name, or ``"orthant"`` — the
    model's own bag predictive (:class:`~milgp.prediction.OrthantRule`; like every noisy-OR-type
    rule it rises with the bag's length).

    With ``inference="vi"`` the (model, kernel, bag rule) candidates are averaged (``average``) as
    :class:`VGPMILClassifier`'s, single-instance learning at the most flexible kernels only
    (docs/probit.md, "Single-instance candidates"); ``inference="gibbs"`` keeps the best one and
    then runs the collapsed Gibbs sampler (§3.5 of the paper) at the chosen kernel, started from
    over-dispersed draws around the VI posterior; instance probabilities come from its draws, bag
    probabilities from the chosen rule applied to them (``"orthant"``/``"joint"``: the exact
    per-draw product under the FITC conditional, with its Monte-Carlo standard error), calibrated
    by the calibration fitted on the VI out-of-bag predictions. :attr:`gibbs_` holds the draws,
    :attr:`gibbs_summary_` split-R̂ and ESS; chains short of
    :data:`~milgp.sampling.probit_gibbs.RHAT_LIMIT` or :data:`~milgp.sampling.probit_gibbs.ESS_LIMIT`
    raise a ``ConvergenceWarning`` naming both.

    Args:
        inference: ``"vi"`` or ``"gibbs"``.
        single_instance: ``"auto"`` (default: the MIL probit model and, with ``inference="vi"``,
            single-instance learning with the probit link, as above), ``False`` (the MIL probit
            model alone, Wang & Pinar's) or ``True`` (single-instance learning alone: every
            instance of a positive bag is a positive instance; VI only, the Gibbs sampler samples
            the MIL model).
        num_qmc_points, qmc_replicates: orthant integration (standard error from the replicates).
        num_samples, burn_in, thin, num_chains, init_dispersion: Gibbs settings (kept draws per
            chain; chains start from ``N(m, init_dispersion·S)`` so that split-R̂ can flag chains
            that have not converged).
        Other arguments as :class:`VGPMILClassifier`.
    """

    inference: str = "vi"
    single_instance: bool | str = "auto"
    lr: float = 0.01
    num_qmc_points: int = 1024
    qmc_replicates: int = 8
    num_samples: int = 1000
    burn_in: int = 500
    thin: int = 1
    num_chains: int = 4
    init_dispersion: float = 4.0

    kernel_grid = PROBIT_KERNEL_GRID

    def _likelihood_variants(self) -> tuple[str, ...]:
        """``"mil"`` (the MIL probit model) and ``"single"`` (single-instance learning), as
        ``single_instance`` asks; the Gibbs sampler's fit keeps to the MIL model."""
        if self.inference not in ("vi", "gibbs"):
            raise ValueError(f"inference must be 'vi' or 'gibbs', got {self.inference!r}")
        # True and False as booleans only (NumPy's too): 1 or 0 are refused, not read as a third choice
        flag = bool(self.single_instance) if isinstance(self.single_instance, (bool, np.bool_)) else self.single_instance
        if not (isinstance(flag, bool) or (isinstance(flag, str) and flag == "auto")):
            raise ValueError(f"single_instance must be 'auto', True or False, got {self.single_instance!r}")
        if flag is True:
            if self.inference == "gibbs":
                raise ValueError("single_instance=True has no Gibbs sampler (it samples the MIL probit model): use inference='vi'")
            return ("single",)
        return ("mil", "single") if flag == "auto" and self.inference == "vi" else ("mil",)

    def _make_likelihood(self, variant: str | None = None) -> MILProbitLikelihood:
        return MILProbitLikelihood(single_instance=variant == "single")

    def _bag_rule_object(self) -> BagRule:
        if self.bag_rule in ("orthant", "joint"):
            return OrthantRule(num_points=self.num_qmc_points, replicates=self.qmc_replicates, seed=self.seed_)
        return make_bag_rule(self.bag_rule)

    def _after_fit(self, batch: BagBatch) -> None:
        self.gibbs_ = self.gibbs_summary_ = None
        if self.inference == "gibbs":
            self.gibbs_ = sample_probit_posterior(
                self.model_, batch, num_samples=self.num_samples, burn_in=self.burn_in, thin=self.thin,
                num_chains=self.num_chains, init=self.model_.variational_strategy.whitened_posterior(), init_dispersion=self.init_dispersion,
                seed=self.seed_, progress=self.verbose,
            )
            self.gibbs_summary_ = self.gibbs_.summary()
            problem = self.gibbs_.convergence_problem()
            if problem is not None:
                warnings.warn(f"the Gibbs chains have not converged: {problem}; raise num_samples and burn_in", ConvergenceWarning, stacklevel=user_stacklevel())

    def _averages(self) -> bool:
        """The Gibbs sampler runs at one kernel: ``inference="gibbs"`` keeps the best candidate."""
        return bool(self.average) and self.inference == "vi"

    def _bag_probability(self, x: torch.Tensor, bags: Bags) -> tuple[torch.Tensor, torch.Tensor]:
        if self.gibbs_ is None:
            return super()._bag_probability(x, bags)
        rule = self.decision_.rule
        if isinstance(rule, MarginalBagRule):  # the Gibbs draws' instance probabilities (_instance_moments)
            p, s = rule.combine(*self._instance_moments(x), bags)
        else:  # joint rules: the exact per-draw product over the Gibbs draws
            p, s = self.gibbs_.bag_probability(self.model_, x, bags)
        return self.decision_.calibrator(p, s)

    def _instance_calibration(self, fits: list[CandidateFit], batch: BagBatch) -> InstanceCalibrator | None:
        """No map with ``inference="gibbs"``: the draws predict the instances (:meth:`_instance_moments`)."""
        return None if self.inference == "gibbs" else super()._instance_calibration(fits, batch)

    def _instance_moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.gibbs_ is None:
            return super()._instance_moments(x)
        return self.gibbs_.instance_probability(self.model_, x)
