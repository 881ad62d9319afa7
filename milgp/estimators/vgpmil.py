"""ψ-VGPMIL bag classifier: VGPMIL and G-VGPMIL with closed-form natural updates."""
from __future__ import annotations

from dataclasses import dataclass

from milgp.estimators._mil_base import MILClassifierBase
from milgp.likelihoods.mil_bernoulli import MILBernoulliLikelihood
from milgp.likelihoods.psi import GSMDensity

__all__ = ["VGPMILClassifier"]


@dataclass(eq=False, repr=False, kw_only=True)  # a scikit-learn __init__ (stores the settings as given); BaseEstimator's repr
class VGPMILClassifier(MILClassifierBase):
    """ψ-VGPMIL bag classifier: VGPMIL (``psi="pg"``, Haußmann et al., *Variational Bayesian
    Multiple Instance Learning with Gaussian Processes*, CVPR 2017) or G-VGPMIL (``psi="gamma"``,
    Castro-Macías et al., *Hyperbolic secant representation of the logistic function: application
    to probabilistic multiple instance learning for CT intracranial hemorrhage detection*,
    Artificial Intelligence 2024, Eq. 37).

    Fitting, kernel search and the calibrated bag decision: :mod:`milgp.estimators._mil_base`; why
    the defaults are what they are: docs/core.md, "Real MIL data: what went wrong and the defaults now".

    Args:
        psi: ``"pg"``, ``"gamma"`` or a :class:`milgp.likelihoods.psi.GSMDensity`.
        num_inducing: M.
        bag_mean_inducing: where the features outnumber the ``M`` inducing points, the share of them
            at the training bags' mean instances (:func:`~milgp.inducing.mil_inducing`); ``0``:
            instances only, as the reference code.
        H: bag-label noise (Eq. 4 of Castro-Macías et al.; ``H = 10¹²`` as the reference code).
        max_rule: how ``E[max y_{b∖n}]`` enters the π update: ``"auto"`` (default: ``"max"`` at
            every candidate kernel and ``"single"`` at the most flexible ones, averaged, or the
            best one kept with ``average=False``), ``"max"`` (the largest other π, the reference
            code's), ``"single"`` (0: every instance of a positive bag is pushed up,
            single-instance learning; at the linear kernel with an intercept: :meth:`_plan`) or
            ``"exact"`` (the mean-field noisy-OR).
        damping: step of the ``"max"`` rule's parallel π update; 1 is the reference code's undamped
            update, which falls into 2-cycles and never converges on real data.
        bag_size_cap: ``"median"`` (default): instances of a bag longer than the median training bag
            are tempered so that the bag carries the evidence of a median bag, in the likelihood,
            the standardisation and the inducing points; a number; ``None``: every instance counts
            fully (the paper).
        bag_rule: ``"auto"`` (chosen among the max at the resolution of the longest training bag,
            top-quarter mean and mean by out-of-bag NLL; :func:`~milgp.prediction.auto_bag_rules`),
            a :mod:`milgp.prediction.bag_rules` name (``"max"``: the plain max) or a
            :class:`~milgp.prediction.BagRule`.
        calibrate: map the rule's score to a calibrated probability (Platt scaling fitted on
            leave-one-bag-out predictions of the training bags); ``False``: the raw rule output.
        average: average the calibrated bag probabilities of every (π rule, kernel, bag rule)
            candidate with pseudo-BMA+ weights from their out-of-bag likelihoods
            (:class:`~milgp.prediction.ModelAverage`); ``False``: keep the best candidate.
        kernel: ``"auto"`` (linear and RBF candidates), ``"rbf"`` or ``"linear"``.
        lengthscale, outputscale: fix these (standardised units); ``None`` searches
            ``{1, 2}·√D`` and ``{1, 10}``.
        max_iter: sweeps of the first candidate (and of hyperparameter learning).
        search_iter: sweeps of every other candidate, warm-started from the first (the caps stop
            the largest-other-π fits before ``tol``: docs/core.md, "Candidate fits run to convergence").
        tol: relative change of the objective below which sweeps stop (twice in a row).
        learn_hyperparameters, lr, hyper_steps: afterwards, Adam on the chosen kernel's
            hyperparameters alternating with the natural steps (Algorithm 1; off by default).
        random_state: the seed of every random choice (an integer; ``None``: a fresh one from the
            operating system; a NumPy ``RandomState``/``Generator``: one drawn from it; kept in
            ``seed_``); the global random states are never used.
        ard, learn_inducing_locations, standardize, bags_per_batch, dtype, device, verbose.

    Fitted attributes: ``ensemble_`` (the weighted candidates, :class:`~milgp.prediction.ModelAverage`);
    ``model_``, ``likelihood_``, ``fit_result_``, ``decision_`` (rule and calibration) of its
    heaviest candidate; ``search_`` (every fit's out-of-bag NLL); ``elbo_`` (the un-augmented ELBO
    of the heaviest fit, a lower bound of ``log p(T)`` for the logistic MIL model), ``scaler_``, ``seed_``,
    ``dtype_`` and ``device_`` (of the fit, used by every prediction);
    ``instance_calibrator_`` (the map of instance scores to the MIL fits' posterior instance labels,
    or ``None`` without a MIL fit).
    """

    psi: str | GSMDensity = "pg"
    H: float = 1e12
    max_rule: str = "auto"
    damping: float = 0.5

    def _likelihood_variants(self) -> tuple[str, ...]:
        """The π rules fitted at every kernel: ``"max"`` and ``"single"`` for ``max_rule="auto"``."""
        if self.max_rule == "auto":
            return ("max", "single")
        if self.max_rule not in ("exact", "max", "single"):
            raise ValueError(f"max_rule must be 'auto', 'exact', 'max' or 'single', got {self.max_rule!r}")
        return (self.max_rule,)

    def _make_likelihood(self, variant: str | None = None) -> MILBernoulliLikelihood:
        return MILBernoulliLikelihood(psi=self.psi, H=self.H, max_rule=variant or self.max_rule, damping=self.damping)
