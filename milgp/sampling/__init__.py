"""Posterior sampling (exact inference) and MCMC diagnostics."""
from milgp.sampling.diagnostics import autocovariance, effective_sample_size, split_rhat
from milgp.sampling.probit_gibbs import ProbitGibbsResult, sample_probit_posterior

__all__ = ["ProbitGibbsResult", "autocovariance", "effective_sample_size", "sample_probit_posterior", "split_rhat"]
