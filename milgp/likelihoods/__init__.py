"""Bag likelihoods for GPyTorch: MIL likelihoods with closed-form local updates (ψ-VGPMIL, probit)
and aggregate-output likelihoods (VBAgg)."""
from milgp.likelihoods.aggregate import AggregateLikelihood
from milgp.likelihoods.aggregate_exponential import ExponentialAggregateLikelihood
from milgp.likelihoods.aggregate_normal import NormalAggregateLikelihood
from milgp.likelihoods.aggregate_poisson import PoissonAggregateLikelihood
from milgp.likelihoods.base import AugmentedBagLikelihood
from milgp.likelihoods.mil_bernoulli import MILBernoulliLikelihood
from milgp.likelihoods.mil_probit import MILProbitLikelihood
from milgp.likelihoods.natural_statistics import NaturalStatistics
from milgp.likelihoods.psi import GammaPsi, GSMDensity, HyperbolicSecantPsi

__all__ = [
    "AggregateLikelihood",
    "AugmentedBagLikelihood",
    "ExponentialAggregateLikelihood",
    "GammaPsi",
    "GSMDensity",
    "HyperbolicSecantPsi",
    "MILBernoulliLikelihood",
    "MILProbitLikelihood",
    "NaturalStatistics",
    "NormalAggregateLikelihood",
    "PoissonAggregateLikelihood",
]
