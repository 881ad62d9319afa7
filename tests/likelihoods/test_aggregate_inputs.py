"""Bad inputs to the aggregate models raise a clear ValueError that names the bag."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from milgp.data.bags import Bags
from milgp.estimators import VBAggRegressor
from milgp.likelihoods import ExponentialAggregateLikelihood, NormalAggregateLikelihood, PoissonAggregateLikelihood

BAGS = Bags(torch.tensor([0, 0, 1, 1, 1, 2]), 3)
W = np.ones(6)


@pytest.mark.parametrize(
    "y, message",
    [
        ([3, -1, 2], "bag 1 has count -1.0"),
        ([3, 2.5, 2], "bag 1 has count 2.5"),
        ([3, 1, np.nan], "bag 2 has count nan"),
    ],
)
def test_poisson_rejects_bad_counts(y, message):
    """Negative, non-integer or NaN counts are not Poisson data; silently accepting them would give
    a meaningless fit (lgamma of a negative number, or a NaN objective)."""
    with pytest.raises(ValueError, match=message):
        PoissonAggregateLikelihood("exp").check_data(np.array(y, dtype=float), W, BAGS)


@pytest.mark.parametrize("bad", [0.0, -2.0, np.nan, np.inf])
def test_rejects_non_positive_or_nan_populations(bad):
    """A population must be positive and finite (``log p_i`` enters the exp-link bound)."""
    w = W.copy()
    w[3] = bad
    for lik in (PoissonAggregateLikelihood("square"), NormalAggregateLikelihood(), ExponentialAggregateLikelihood()):
        with pytest.raises(ValueError, match="bag 1 has weight/population"):
            lik.check_data(np.array([1.0, 2.0, 3.0]), w, BAGS)


def test_exponential_rejects_negative_and_normal_rejects_nan():
    with pytest.raises(ValueError, match="bag 0 has target -1.0"):
        ExponentialAggregateLikelihood().check_data(np.array([-1.0, 2.0, 3.0]), W, BAGS)
    with pytest.raises(ValueError, match="bag 2 has target nan"):
        NormalAggregateLikelihood().check_data(np.array([1.0, 2.0, np.nan]), W, BAGS)


def test_estimator_reports_the_bag():
    """The estimator validates before fitting: counts, populations (per bag) and NaN features."""
    rng = np.random.default_rng(0)
    bags = [rng.normal(size=(n, 2)) for n in (3, 2, 4)]
    with pytest.raises(ValueError, match="bag 2 has count -3.0"):
        VBAggRegressor().fit(bags, [1, 2, -3])
    with pytest.raises(ValueError, match="bag 1 has weight/population 0.0"):
        VBAggRegressor().fit(bags, [1, 2, 3], weights=[np.ones(3), np.array([1.0, 0.0]), np.ones(4)])
    with pytest.raises(ValueError, match=r"weights\[2\] has 3 entries but bag 2 has 4"):
        VBAggRegressor().fit(bags, [1, 2, 3], weights=[np.ones(3), np.ones(2), np.ones(3)])
    bad = [b.copy() for b in bags]
    bad[1][0, 1] = np.nan
    with pytest.raises(ValueError, match=r"bags\[1\] has NaN"):
        VBAggRegressor().fit(bad, [1, 2, 3])
    with pytest.raises(ValueError, match="likelihood must be"):
        VBAggRegressor(likelihood="gamma").fit(bags, [1, 2, 3])
