"""Algorithm 1 (fit_closed_form): monotone ELBO, fixed point, minibatch path."""
import math

import numpy as np
import pytest
import torch

from milgp.data.bags import BagBatch, bag_index_from_sizes
from milgp.likelihoods.mil_bernoulli import MILBernoulliLikelihood
from milgp.models.sparse_gp import SparseGP
from milgp.variational import closed_form_elbo, fit_closed_form, natural_statistics


def make_problem(seed=0, B=16, M=10):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 7, (B,), generator=g).tolist()
    bag_index = bag_index_from_sizes(sizes)
    N = len(bag_index)
    labels = (torch.arange(B) % 2).to(torch.float64)
    x = torch.randn(N, 3, generator=g, dtype=torch.float64)
    # one "witness" per positive bag, shifted away from the negatives
    first = torch.cumsum(torch.tensor(sizes), 0) - torch.tensor(sizes)
    x[first[labels.bool()]] += 2.5
    Z = x[torch.randperm(N, generator=g)[:M]].clone()
    return Z, BagBatch(x, bag_index, labels)


@pytest.mark.parametrize(
    "psi,rule,cap", [("pg", "exact", None), ("gamma", "exact", None), ("pg", "exact", 2.0), ("gamma", "exact", 2.0)],
    ids=["pg-exact", "gamma-exact", "pg-exact-capped", "gamma-exact-capped"],
)
def test_elbo_never_decreases_under_cavi(psi, rule, cap):
    """With fixed hyperparameters every CAVI sweep maximises the (surrogate) ELBO in one block,
    so the ELBO sequence must be non-decreasing; a decrease means an update is not the
    coordinate-wise optimum (wrong θ, wrong π rule, π updated in parallel) or the ELBO formula
    does not match the updates. With a bag-size cap the objective tempers the instance terms of
    long bags, and π must be updated for that objective (it was updated as without the cap: the
    ELBO fell in 10–95 of the sweeps of one fit)."""
    Z, batch = make_problem()
    model = SparseGP(Z, lengthscale=1.5, outputscale=2.0)
    lik = MILBernoulliLikelihood(psi, H=100.0, max_rule=rule, bag_size_cap=cap)
    res = fit_closed_form(model, lik, batch, max_iter=60, tol=0.0, learn_hyperparameters=False)
    elbo = np.asarray(res.elbo)
    assert len(elbo) >= 10
    diffs = np.diff(elbo)
    assert (diffs >= -1e-9 * np.abs(elbo[1:])).all(), diffs.min()
    assert elbo[-1] > elbo[0]
    # the reported ELBO equals closed_form_elbo of the final state
    assert closed_form_elbo(model, lik, batch, res.locals) == pytest.approx(elbo[-1], rel=1e-10)


@pytest.mark.parametrize("psi", ["pg", "gamma"])
@pytest.mark.parametrize("rule", ["exact", "max"])
def test_converged_state_is_a_fixed_point(psi, rule):
    """At convergence another full sweep must leave m, S and π unchanged (< 1e-6); otherwise
    the stopping rule stops too early or the updates cycle."""
    Z, batch = make_problem(seed=1)
    model = SparseGP(Z, lengthscale=1.5, outputscale=2.0)
    lik = MILBernoulliLikelihood(psi, H=100.0, max_rule=rule)
    res = fit_closed_form(model, lik, batch, max_iter=500, tol=1e-13, learn_hyperparameters=False)
    assert res.converged
    q0 = model.variational_strategy.whitened_posterior()
    pi0 = res.locals.clone()
    # one more sweep by hand: θ from q, natural step, then π from the converged π
    with torch.no_grad():
        proj = model.variational_strategy.projection(batch.x)
        mean, var = model.variational_strategy.marginals(proj, q0)
        b, lam = lik.quadratic_terms(mean, var, batch.bags, batch.bag_labels, pi0)
        q1 = q0.natural_step(natural_statistics(proj.A, b, lam, proj.prior_mean))
        mean1, var1 = model.variational_strategy.marginals(proj, q1)
        pi1 = lik.update_locals(mean1, var1, batch.bags, batch.bag_labels, pi0)
    assert (q1.m - q0.m).abs().max() < 1e-6
    assert (q1.S - q0.S).abs().max() < 1e-6
    assert (pi1 - pi0).abs().max() < 1e-6


def test_hyperparameter_learning_increases_elbo():
    """Alternating CAVI with Adam on the kernel hyperparameters must not end below the fixed-
    hyperparameter optimum it started from (the hyperparameter objective is the ELBO)."""
    Z, batch = make_problem(seed=2)
    model = SparseGP(Z, lengthscale=3.0, outputscale=0.5)
    lik = MILBernoulliLikelihood("pg")
    fixed = fit_closed_form(model, lik, batch, max_iter=100, tol=1e-10, learn_hyperparameters=False)
    learned = fit_closed_form(model, lik, batch, max_iter=15, tol=0.0, learn_hyperparameters=True, lr=0.05, hyper_steps=3)
    assert learned.elbo[-1] > fixed.elbo[-1]


def test_minibatch_path_reaches_full_batch_elbo():
    """Stochastic natural steps on minibatches of whole bags (scaled by B/B_batch, Robbins–Monro)
    must approach the full-batch optimum; a wrong scale s or step mixing gives a clearly worse
    ELBO."""
    Z, batch = make_problem(seed=3, B=24)
    lik = MILBernoulliLikelihood("pg")
    full_model = SparseGP(Z, lengthscale=1.5, outputscale=2.0)
    full = fit_closed_form(full_model, lik, batch, max_iter=200, tol=1e-10, learn_hyperparameters=False)
    mb_model = SparseGP(Z, lengthscale=1.5, outputscale=2.0)
    mb = fit_closed_form(mb_model, lik, batch, max_iter=60, tol=0.0, bags_per_batch=6, learn_hyperparameters=False)
    assert mb.iterations == 60
    gap = full.elbo[-1] - mb.elbo[-1]
    assert gap >= -1e-6  # the full-batch CAVI optimum is the best
    assert gap < 0.02 * abs(full.elbo[-1])


def test_minibatch_with_hyperparameters_runs_and_is_finite():
    """The minibatch path with hyperparameter steps must run end to end with a finite ELBO."""
    Z, batch = make_problem(seed=4)
    model = SparseGP(Z, lengthscale=1.5, outputscale=2.0)
    res = fit_closed_form(model, MILBernoulliLikelihood("gamma"), batch, max_iter=5, bags_per_batch=5, hyper_steps=2)
    assert np.isfinite(res.elbo).all() and res.iterations == 5


def test_continuing_from_earlier_locals_does_not_reset_q_y():
    """A second fit started from the first fit's locals continues CAVI: its first ELBO is at least
    the first fit's last one. Re-initialising π from the bag labels instead (the old behaviour of
    the estimator's warm-up → main hand-over) throws away q(y) and the ELBO drops."""
    Z, batch = make_problem(seed=3)
    model = SparseGP(Z, lengthscale=1.5, outputscale=2.0)
    lik = MILBernoulliLikelihood("pg", H=100.0)
    first = fit_closed_form(model, lik, batch, max_iter=15, tol=0.0, min_iter=15, learn_hyperparameters=False)
    before = first.locals.clone()
    second = fit_closed_form(
        model, lik, batch, max_iter=3, tol=0.0, min_iter=3, learn_hyperparameters=False, initial_locals=first.locals
    )
    assert second.elbo[0] >= first.elbo[-1] - 1e-9 * abs(first.elbo[-1])
    assert torch.equal(first.locals, before)  # the caller's locals are not modified in place


@pytest.mark.parametrize("learn", [False, True])
def test_objective_is_the_tighter_unaugmented_elbo(learn):
    """For ψ = φ the reported objective replaces the tangent bound log φ(c) by the exact E_q[log φ(f)]
    (Jensen: E log φ(f) ≥ log φ(sqrt(E f²)) since log φ(√t) is convex), so it must never lie below
    the augmented ELBO of the same state; with hyperparameter learning it is recorded every
    iteration and is what Adam ascends, so it must end above where the hyperparameter phase
    started. Without learning only its final value is recorded."""
    Z, batch = make_problem(seed=4)
    model = SparseGP(Z, lengthscale=1.5, outputscale=2.0)
    lik = MILBernoulliLikelihood("pg", H=100.0)
    warm = fit_closed_form(model, lik, batch, max_iter=10, tol=0.0, min_iter=10, learn_hyperparameters=False)
    assert len(warm.objective) == 1 and warm.objective[0] > warm.elbo[-1] + 1e-6
    res = fit_closed_form(
        model, lik, batch, max_iter=20, tol=0.0, min_iter=20, learn_hyperparameters=learn, lr=0.05,
        initial_locals=warm.locals,
    )
    obj, elbo = np.asarray(res.objective), np.asarray(res.elbo)
    if learn:
        assert len(obj) == len(elbo)
        assert (obj >= elbo - 1e-9 * np.abs(elbo)).all()
        assert res.objective[-1] > warm.objective[-1]
    else:
        assert len(obj) == 1 and obj[0] >= elbo[-1]


def test_a_users_own_model_on_the_closed_form_strategy_reaches_the_estimators_elbo():
    """A user's ``ApproximateGP`` (their own class, kernel and mean) with milgp's ClosedFormStrategy,
    trained by ``fit_closed_form``, must reach the same ELBO as ``VGPMILClassifier`` fitted on the
    same bags with the same kernel, inducing points and π rule, to 1e-8: one fit loop serves both,
    and the strategy computes the prior from the user's ``forward`` exactly as the estimator's model."""
    import gpytorch

    from milgp.data.synthetic_mil import synthetic_mil
    from milgp.estimators import VGPMILClassifier
    from milgp.models import ClosedFormStrategy

    x, bag_index, y, _ = synthetic_mil(num_instances=600, dim=4, bag_sizes=(5, 15), seed=3)
    bags = [x[bag_index == b] for b in range(len(y))]
    clf = VGPMILClassifier(
        kernel="rbf", lengthscale=2.0, outputscale=1.0, max_rule="max", bag_rule="max", calibrate=False,
        average=False, bag_size_cap=None, standardize=False, num_inducing=20, max_iter=40,
    ).fit(bags, y)

    class MyGP(gpytorch.models.ApproximateGP):
        def __init__(self, Z):
            super().__init__(ClosedFormStrategy(self, Z, gpytorch.variational.NaturalVariationalDistribution(len(Z))))
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    model = MyGP(clf.model_.variational_strategy.inducing_points).double()
    model.covar_module.base_kernel.lengthscale, model.covar_module.outputscale = 2.0, 1.0
    batch = BagBatch(torch.as_tensor(np.concatenate(bags)), bag_index_from_sizes([len(b) for b in bags]), torch.as_tensor(y))
    likelihood = MILBernoulliLikelihood(psi="pg", H=1e12, max_rule="max", damping=0.5)
    result = fit_closed_form(model, likelihood, batch, max_iter=40, tol=clf.tol, learn_hyperparameters=False)

    assert result.iterations == clf.fit_result_.iterations
    assert result.objective[-1] == pytest.approx(clf.elbo_, rel=1e-8, abs=1e-8)
    assert result.elbo[-1] == pytest.approx(clf.fit_result_.elbo[-1], rel=1e-8, abs=1e-8)


def test_a_batch_with_one_based_bag_ids_is_refused_before_fitting():
    """If this failed, a hand-built batch whose bag ids start at 1 would stop deep inside a sweep
    with an index error, or (with a label per id) fit a bag without instances."""
    Z, batch = make_problem()
    shifted = BagBatch(batch.x, batch.bag_index + 1, batch.bag_labels)
    with pytest.raises(ValueError, match=rf"^bag_index holds bag {batch.num_bags}, but the {batch.num_bags} bag labels"):
        fit_closed_form(SparseGP(Z), MILBernoulliLikelihood("pg"), shifted, max_iter=2, learn_hyperparameters=False)


def test_bag_labels_other_than_zero_one_are_refused_by_the_fit_and_by_gpytorchs_elbo():
    """−1/+1 or 0/2 bag labels entered the updates linearly: the fit returned an "ELBO" of −13.9
    where −78.9 was right, and VariationalELBO a value above 0. Both must refuse them naming the bag."""
    import gpytorch

    Z, batch = make_problem()
    for labels in (2 * batch.bag_labels - 1, 2 * batch.bag_labels):
        bad = BagBatch(batch.x, batch.bag_index, labels)
        with pytest.raises(ValueError, match=r"bag 0 has label -1|bag 1 has label 2"):
            fit_closed_form(SparseGP(Z), MILBernoulliLikelihood("pg"), bad, max_iter=2)
        model, lik = SparseGP(Z), MILBernoulliLikelihood("pg")
        mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=batch.num_instances)
        with pytest.raises(ValueError, match="the MIL likelihoods take bag labels 0 or 1"):
            mll(model(batch.x), labels[batch.bag_index], bag_index=batch.bag_index, bag_labels=labels)


def test_float64_locals_continue_a_float32_fit():
    """BagLocals keeps π in float64 and a float64 fit's locals may start a float32 one: the step
    failed with `addmv ... Double, Float` on a bag's second visit; the locals take the batch's dtype."""
    Z, batch = make_problem()
    first = fit_closed_form(SparseGP(Z), MILBernoulliLikelihood("pg"), batch, max_iter=3, learn_hyperparameters=False)
    batch32 = BagBatch(batch.x.float(), batch.bag_index, batch.bag_labels.float())
    model32 = SparseGP(Z.float())
    res = fit_closed_form(model32, MILBernoulliLikelihood("pg"), batch32, max_iter=3, learn_hyperparameters=False,
                          initial_locals=first.locals)
    assert res.locals.dtype == torch.float32 and np.isfinite(res.elbo).all()


def test_a_batch_the_model_cannot_take_is_a_one_line_error():
    """A float32 model on float64 features (or features of another width) was torch's "addmv input
    tensors must have the same dtype" from inside the first step, in both fits."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "likelihoods"))
    from _aggregate_helpers import random_bags, random_model

    from milgp.likelihoods import PoissonAggregateLikelihood
    from milgp.variational.aggregate_fit import fit_aggregate

    x, bag_index = random_bags([3, 4, 2, 5])
    counts, labels = torch.tensor([2.0, 3.0, 1.0, 4.0], dtype=torch.float64), torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    for fit, likelihood, y in ((fit_aggregate, PoissonAggregateLikelihood("exp"), counts), (fit_closed_form, MILBernoulliLikelihood(), labels)):
        with pytest.raises(ValueError, match="batch.x is torch.float64 but the model is torch.float32: cast one to the other"):
            fit(random_model().float(), likelihood, BagBatch(x, bag_index, y), max_iter=2, learn_hyperparameters=False)
        with pytest.raises(ValueError, match=r"batch.x has shape \(14, 3\); the model's inducing points have 2 features"):
            fit(random_model(), likelihood, BagBatch(torch.cat([x, x[:, :1]], 1), bag_index, y), max_iter=2, learn_hyperparameters=False)


def test_initial_locals_of_the_wrong_length_or_out_of_range_are_refused_in_one_line():
    """Locals given to start from must be one finite value per instance, VGPMIL's π in [0, 1]
    (the probit model's ν any finite real). If this fails, π = 2 is fitted as if it were a
    probability, NaN locals end in advice to lower the learning rate, and a wrong length in a
    raw RuntimeError from inside the first step."""
    from milgp.likelihoods.mil_probit import MILProbitLikelihood

    Z, batch = make_problem()
    N = batch.num_instances
    half = torch.full((N,), 0.5, dtype=torch.float64)
    cases = [
        (half[:5], r"^initial_locals has shape \(5,\); MILBernoulliLikelihood needs one local per instance"),
        (torch.full((N,), 2.0, dtype=torch.float64), r"^initial_locals\[0\] is 2\.0; .* must be finite and in \[0, 1\]$"),
        (torch.cat([half[:-1], torch.tensor([float("nan")], dtype=torch.float64)]), rf"^initial_locals\[{N - 1}\] is nan"),
    ]
    for locals_, message in cases:
        with pytest.raises(ValueError, match=message):
            fit_closed_form(SparseGP(Z), MILBernoulliLikelihood("pg"), batch, max_iter=2, initial_locals=locals_)
    with pytest.raises(ValueError, match=r"^locals_\[0\] is 2\.0"):
        closed_form_elbo(SparseGP(Z), MILBernoulliLikelihood("pg"), batch, torch.full((N,), 2.0, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^initial_locals\[0\] is inf; MILProbitLikelihood's locals must be finite$"):
        fit_closed_form(SparseGP(Z), MILProbitLikelihood(), batch, max_iter=2, initial_locals=torch.full((N,), math.inf, dtype=torch.float64))
    result = fit_closed_form(SparseGP(Z), MILProbitLikelihood(), batch, max_iter=2, learn_hyperparameters=False,
                             initial_locals=torch.full((N,), 3.0, dtype=torch.float64))
    assert np.isfinite(result.elbo).all()
