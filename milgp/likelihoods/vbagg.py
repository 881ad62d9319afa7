"""Re-exports of the aggregate-output (VBAgg, seed 001) likelihoods."""
from milgp.likelihoods.aggregate import AggregateLikelihood, ExpLink, IdentityLink, Link, SquareLink, make_link
from milgp.likelihoods.aggregate_exponential import ExponentialAggregateLikelihood
from milgp.likelihoods.aggregate_normal import NormalAggregateLikelihood
from milgp.likelihoods.aggregate_poisson import PoissonAggregateLikelihood

VBAGG_EXPORTS = [
    "AggregateLikelihood",
    "ExponentialAggregateLikelihood",
    "NormalAggregateLikelihood",
    "PoissonAggregateLikelihood",
]
__all__ = VBAGG_EXPORTS + ["ExpLink", "IdentityLink", "Link", "SquareLink", "make_link"]
