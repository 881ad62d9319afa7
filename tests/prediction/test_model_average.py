"""Pseudo-BMA+ weights and the mixture of candidate fits."""
import math

import numpy as np
import pytest
import torch

from milgp.data.bags import Bags
from milgp.likelihoods.instance_link import LogisticLink
from milgp.likelihoods.mil_bernoulli import MILBernoulliLikelihood
from milgp.models.sparse_gp import SparseGP
from milgp.prediction import AveragedFit, BagCalibrator, BagDecision, BagPosterior, ModelAverage, make_bag_rule, pseudo_bma_plus_weights


def test_weights_equal_a_float64_bayesian_bootstrap_reference():
    """The weights must be E_α[softmax(B·αᵀℓ)] with α ~ Dirichlet(1): checked against an
    independent NumPy computation on the same Dirichlet draws (a wrong scale B, a missing
    bootstrap or a softmax over bags instead of candidates would all differ)."""
    rng = np.random.default_rng(0)
    ll = np.log(rng.uniform(0.2, 0.9, size=(30, 4)))
    w = pseudo_bma_plus_weights(torch.as_tensor(ll), num_bootstrap=500, seed=5).numpy()
    g = torch.Generator().manual_seed(5)
    e = torch.empty(500, 30, dtype=torch.float64).exponential_(generator=g).numpy()
    alpha = e / e.sum(1, keepdims=True)
    z = 30 * alpha @ ll
    ref = np.exp(z - z.max(1, keepdims=True))
    ref = (ref / ref.sum(1, keepdims=True)).mean(0)
    np.testing.assert_allclose(w, ref, rtol=1e-12)
    assert w.sum() == pytest.approx(1.0)


def test_weights_follow_the_heldout_likelihood_and_spread_over_near_ties():
    """A candidate much better on every bag takes (almost) all the weight; two candidates with the
    same held-out densities up to a permutation of the bags share it (the Bayesian bootstrap does
    not pick one of two exchangeable candidates), unlike plain pseudo-BMA's point estimate which
    would also give ½ here but 1.0 for a tiny total-likelihood gap."""
    ll = torch.log(torch.tensor([[0.9, 0.3], [0.8, 0.4], [0.95, 0.2]] * 10, dtype=torch.float64))
    assert float(pseudo_bma_plus_weights(ll)[0]) > 0.999
    a = torch.log(torch.linspace(0.3, 0.9, 40, dtype=torch.float64))
    tie = torch.stack([a, a.flip(0) + 1e-3], 1)  # total log density 0.04 higher for the second
    w = pseudo_bma_plus_weights(tie, seed=0)
    assert 0.2 < float(w[0]) < 0.5 and 0.5 < float(w[1]) < 0.8


def test_a_non_finite_density_names_the_candidate():
    ll = torch.zeros(5, 3, dtype=torch.float64)
    ll[2, 1] = float("-inf")
    with pytest.raises(ValueError, match="candidate 1"):
        pseudo_bma_plus_weights(ll)


def _fit(Z, kernel, mean):
    model = SparseGP(Z, kernel=kernel, lengthscale=1.0, outputscale=1.0).double()
    q = model.variational_strategy.whitened_posterior()
    M = Z.shape[0]
    model.variational_strategy.set_whitened_posterior(type(q)(torch.full((M,), mean, dtype=torch.float64), 0.5 * torch.eye(M, dtype=torch.float64), 2.0 * torch.eye(M, dtype=torch.float64)))
    return model


def test_mixture_is_the_weighted_mean_with_the_law_of_total_variance():
    """bag_probability and instance_moments must equal Σ w_k p_k with variance
    Σ w_k (σ_k² + p_k²) − p² over the kept candidates; candidates under MIN_WEIGHT are dropped
    and the rest renormalised."""
    torch.manual_seed(0)
    Z = torch.randn(5, 2, dtype=torch.float64)
    x = torch.randn(9, 2, dtype=torch.float64)
    bag_index = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    labels = torch.tensor([1.0, 0.0, 1.0, 0.0])
    cands = []
    for k, (kernel, mean, heldout) in enumerate(
        [("rbf", 0.5, [0.8, 0.3, 0.7, 0.2]), ("linear", -0.3, [0.7, 0.4, 0.6, 0.3]), ("rbf", 0.0, [1e-6, 1 - 1e-6, 1e-6, 1 - 1e-6])]
    ):
        rule = make_bag_rule(["max", "mean", "max"][k])
        cands.append((_fit(Z, kernel, mean), MILBernoulliLikelihood("pg"), BagDecision(rule, BagCalibrator(), 0.0, {}, torch.tensor(heldout, dtype=torch.float64))))
    avg = ModelAverage.from_candidates(cands, labels, seed=0)
    assert len(avg.members) == 2 and all(m.model is not cands[2][0] for m in avg.members)  # the wrong one is dropped
    assert math.isclose(sum(m.weight for m in avg.members), 1.0)
    p, s = avg.bag_probability(x, Bags(bag_index, 3))
    parts = [m.decision(BagPosterior.from_model(m.model, x, Bags(bag_index, 3)), m.likelihood.instance_link) for m in avg.members]
    w = [m.weight for m in avg.members]
    ref_p = w[0] * parts[0][0] + w[1] * parts[1][0]
    ref_var = w[0] * (parts[0][1] ** 2 + parts[0][0] ** 2) + w[1] * (parts[1][1] ** 2 + parts[1][0] ** 2) - ref_p**2
    torch.testing.assert_close(p, ref_p, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(s, ref_var.clamp_min(0).sqrt(), rtol=1e-10, atol=1e-12)
    pi, si = avg.instance_moments(x)
    inst = [m.likelihood.instance_link.moments(*m.model.variational_strategy.predict_marginals(x)) for m in avg.members]
    torch.testing.assert_close(pi, w[0] * inst[0][0] + w[1] * inst[1][0], rtol=1e-12, atol=1e-14)
    assert (si >= 0).all() and (si > torch.minimum(inst[0][1], inst[1][1]) - 1e-12).all()


def test_bag_rules_of_one_fit_share_its_instance_moments(monkeypatch):
    """Two bag rules of one fit are two members with one model: if this failed, instance_moments
    and bag_probability would mix other values than each member's own, or compute the quadrature
    of every fit once per rule (three of the default's 18 members share each fit)."""
    torch.manual_seed(1)
    Z = torch.randn(5, 2, dtype=torch.float64)
    x = torch.randn(9, 2, dtype=torch.float64)
    shared, other = (_fit(Z, "rbf", 0.4), MILBernoulliLikelihood("pg")), (_fit(Z, "linear", -0.2), MILBernoulliLikelihood("pg"))
    members = [
        AveragedFit(*shared, BagDecision(make_bag_rule("max"), BagCalibrator(), 0.0, {}), 0.5),
        AveragedFit(*shared, BagDecision(make_bag_rule("mean"), BagCalibrator(), 0.0, {}), 0.3),
        AveragedFit(*other, BagDecision(make_bag_rule("max"), BagCalibrator(), 0.0, {}), 0.2),
    ]
    expected = [lik.instance_link.moments(*model.variational_strategy.predict_marginals(x)) for model, lik in (shared, shared, other)]
    calls = []
    moments = LogisticLink.moments
    monkeypatch.setattr(LogisticLink, "moments", lambda link, mean, var: calls.append(mean) or moments(link, mean, var))
    p, s = ModelAverage(members).instance_moments(x)
    assert len(calls) == 2
    ref_p = 0.5 * expected[0][0] + 0.3 * expected[1][0] + 0.2 * expected[2][0]
    ref_second = sum(w * (sd**2 + pk**2) for w, (pk, sd) in zip((0.5, 0.3, 0.2), expected))
    torch.testing.assert_close(p, ref_p, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(s, (ref_second - ref_p**2).clamp_min(0).sqrt(), rtol=1e-10, atol=1e-12)
    bags = Bags(torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2]), 3)
    reference = [m.decision(BagPosterior.from_model(m.model, x, bags), m.likelihood.instance_link) for m in members]
    calls.clear()
    p_bag, _ = ModelAverage(members).bag_probability(x, bags)
    assert len(calls) == 2
    torch.testing.assert_close(p_bag, sum(m.weight * ref[0] for m, ref in zip(members, reference)), rtol=1e-12, atol=1e-14)


def test_rounding_in_the_weights_keeps_probabilities_in_the_unit_interval():
    """Weights that sum to 1 up to rounding must not mix probabilities of 1 into 1 + 2e-16 (or 0
    into a negative number): uncalibrated ``predict_proba`` returned 1.0000000000000002 and −2e-16."""
    decision = BagDecision(make_bag_rule("max"), BagCalibrator(), 0.0, {})
    avg = ModelAverage([AveragedFit(None, None, decision, w) for w in (0.1, 0.2, 0.7000000000000002)])
    ones, zeros = torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    assert sum(m.weight for m in avg.members) > 1.0  # the rounding this is about
    p, s = avg._mix([(ones, zeros)] * 3)
    assert (p == 1.0).all() and (s == 0.0).all()
