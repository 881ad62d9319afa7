"""Bag likelihoods for GPyTorch with closed-form local updates."""
from milgp.likelihoods.base import AugmentedBagLikelihood
from milgp.likelihoods.mil_bernoulli import MILBernoulliLikelihood
from milgp.likelihoods.mil_probit import MILProbitLikelihood
from milgp.likelihoods.psi import GammaPsi, GSMDensity, HyperbolicSecantPsi

__all__ = ["AugmentedBagLikelihood", "GammaPsi", "GSMDensity", "HyperbolicSecantPsi", "MILBernoulliLikelihood", "MILProbitLikelihood"]
from milgp.likelihoods.vbagg import AggregateLikelihood, ExponentialAggregateLikelihood, NormalAggregateLikelihood, PoissonAggregateLikelihood, VBAGG_EXPORTS; __all__ = __all__ + VBAGG_EXPORTS  # noqa: E402,E702  aggregate outputs (VBAgg)
