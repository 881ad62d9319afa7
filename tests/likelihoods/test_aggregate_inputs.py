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


def _elbo_inputs(likelihood):
    """A user's VariationalELBO call on SparseGP with 4 bags of 2-4 instances (whole-batch bag ids)."""
    import gpytorch
    from _aggregate_helpers import random_bags, random_model

    model = random_model(natural=False)
    x, bag_index = random_bags([2, 3, 4, 2])
    y = torch.tensor([2.0, 3.0, 5.0, 1.0], dtype=torch.float64)
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=len(x))
    return model, mll, x, bag_index, y


@pytest.mark.parametrize("likelihood", [NormalAggregateLikelihood(), PoissonAggregateLikelihood("square")], ids=["normal", "square"])
def test_a_minibatch_that_kept_global_bag_ids_is_refused(likelihood):
    """Bags 2 and 3 alone with their global ids leave bags 0 and 1 empty: the loss was finite and
    equal to the renumbered batch's, but the gradients NaN (``log`` of an empty bag's zero weight
    sum), and one Adam step wrote NaN into the noise or q(v)."""
    model, mll, x, bag_index, y = _elbo_inputs(likelihood.double())
    keep = bag_index >= 2
    with pytest.raises(ValueError, match=r"bag 0 has no instances \(2 such bag\(s\)\): number the bags of a minibatch 0\.\.B-1"):
        mll(model(x[keep]), y[bag_index][keep], bag_index=bag_index[keep], model=model, x=x[keep])
    renumbered = torch.unique(bag_index[keep], return_inverse=True)[1]
    loss = -mll(model(x[keep]), y[bag_index][keep], bag_index=renumbered, model=model, x=x[keep])
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_individual_observations_are_not_taken_for_bag_targets():
    """Targets that differ within a bag were replaced by one instance's value without a word."""
    model, mll, x, bag_index, y = _elbo_inputs(PoissonAggregateLikelihood("exp").double())
    individual = y[bag_index].clone()
    individual[1] += 1.0
    with pytest.raises(ValueError, match="bag 0 has different targets on its instances"):
        mll(model(x), individual, bag_index=bag_index)
    with pytest.raises(ValueError, match=r"target has shape \(4,\); it must be \(11,\)"):
        mll(model(x), y, bag_index=bag_index)


def test_weights_of_another_length_are_one_line_errors():
    """One population per bag instead of per instance was an IndexError or a size mismatch deep in
    the likelihood (and in fit_aggregate's BagBatch)."""
    from milgp.data.bags import BagBatch

    model, mll, x, bag_index, y = _elbo_inputs(PoissonAggregateLikelihood("exp").double())
    with pytest.raises(ValueError, match=r"weights has shape \(4,\); it must be \(11,\)"):
        mll(model(x), y[bag_index], bag_index=bag_index, weights=torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"instance_weights has shape \(4,\); it must be \(11,\)"):
        BagBatch(x, bag_index, y, instance_weights=torch.ones(4, dtype=torch.float64)).check()


def test_model_and_x_need_milgps_strategy():
    """``model=, x=`` with a plain GPyTorch VariationalStrategy was an AttributeError ('projection')."""
    import gpytorch

    class Plain(gpytorch.models.ApproximateGP):
        def __init__(self):
            Z = torch.randn(4, 2, dtype=torch.float64)
            dist = gpytorch.variational.CholeskyVariationalDistribution(4).double()
            super().__init__(gpytorch.variational.VariationalStrategy(self, Z, dist).double())
            self.mean_module, self.covar_module = gpytorch.means.ZeroMean(), gpytorch.kernels.RBFKernel().double()

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    _, _, x, bag_index, y = _elbo_inputs(NormalAggregateLikelihood().double())
    model = Plain()
    mll = gpytorch.mlls.VariationalELBO(NormalAggregateLikelihood().double(), model, num_data=len(x))
    with pytest.raises(TypeError, match="need a model whose variational_strategy is milgp's ClosedFormStrategy, got VariationalStrategy"):
        mll(model(x), y[bag_index], bag_index=bag_index, model=model, x=x)
