"""Bag likelihoods for GPyTorch with closed-form local updates."""
from milgp.likelihoods.base import AugmentedBagLikelihood
from milgp.likelihoods.mil_bernoulli import MILBernoulliLikelihood
from milgp.likelihoods.psi import GammaPsi, GSMDensity, HyperbolicSecantPsi

__all__ = ["AugmentedBagLikelihood", "GammaPsi", "GSMDensity", "HyperbolicSecantPsi", "MILBernoulliLikelihood"]
