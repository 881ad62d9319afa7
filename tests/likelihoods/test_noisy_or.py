"""Mean-field instance-label updates (Castro-Macías et al., *Hyperbolic secant representation of the
logistic function*, 2024, Eq. 25) and the bag term of the ELBO."""
import math

import pytest
import torch

from milgp.data.bags import Bags, bag_index_from_sizes
from milgp.likelihoods.mil_bernoulli import MILBernoulliLikelihood
from milgp.likelihoods.noisy_or import PI_CLAMP, log_prob_bag_all_negative, positions_in_bag, update_instance_labels


def test_positions_in_bag_groups_by_position():
    """Element k must hold the k-th instance of every bag with > k instances (interleaved bags
    included); the exact rule's sequential order depends on it."""
    bag_index = torch.tensor([1, 0, 1, 2, 0, 1])
    pos = positions_in_bag(bag_index, 3)
    assert [p.tolist() for p in pos] == [[0, 1, 3], [2, 4], [5]]


def test_log_prob_bag_all_negative_is_stable_near_one():
    """log Π(1 − π) must stay finite when π → 1 (clamped at 1 − PI_CLAMP) and equal the direct
    product otherwise."""
    bag_index = torch.tensor([0, 0, 1])
    pi = torch.tensor([0.3, 0.6, 1.0], dtype=torch.float64)
    out = log_prob_bag_all_negative(pi, bag_index, 2)
    assert torch.isfinite(out).all()
    assert out[0].item() == pytest.approx(math.log(0.7 * 0.4))
    assert out[1].item() == pytest.approx(math.log(PI_CLAMP), rel=1e-6)


def test_exact_update_is_the_coordinatewise_optimum():
    """Each exact-rule π_n maximises the π_n-dependent ELBO terms with its bag-mates fixed:
    π_n μ_n + H[Bern(π_n)] + log H·E[G_b]. Perturbing any π_n of the result (with the others
    as they were when it was updated: the last one of each bag) must not increase it."""
    g = torch.Generator().manual_seed(0)
    sizes = [3, 4, 1]
    bag_index = bag_index_from_sizes(sizes)
    labels = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    mean = torch.randn(8, generator=g, dtype=torch.float64)
    lik = MILBernoulliLikelihood(H=50.0)
    pi = update_instance_labels(mean, torch.full((8,), 0.5, dtype=torch.float64), Bags(bag_index, 3), labels, math.log(50.0))
    var = torch.ones(8, dtype=torch.float64)

    def objective(p):
        return lik.elbo_terms(mean, var, Bags(bag_index, 3), labels, p).sum()

    base = objective(pi)
    for n in (2, 6, 7):  # last instance of each bag: its update saw the final values of the others
        for delta in (-1e-4, 1e-4):
            p2 = pi.clone()
            p2[n] = (p2[n] + delta).clamp(1e-6, 1 - 1e-6)
            assert objective(p2) <= base + 1e-12


def test_bag_log_likelihood_limits():
    """E[log p(T|y)] = log H·E[G] − log(H+1): a confident positive bag with T=1 gives
    log(H/(H+1)); with T=0 it gives −log(H+1)."""
    lik = MILBernoulliLikelihood(H=100.0)
    bag_index = torch.tensor([0, 0])
    pi = torch.tensor([1 - 1e-9, 0.2], dtype=torch.float64)
    pos = lik.bag_log_likelihood(pi, Bags(bag_index, 1), torch.tensor([1.0], dtype=torch.float64))
    neg = lik.bag_log_likelihood(pi, Bags(bag_index, 1), torch.tensor([0.0], dtype=torch.float64))
    assert pos.item() == pytest.approx(math.log(100 / 101), abs=1e-5)
    assert neg.item() == pytest.approx(-math.log(101), abs=1e-4)


def test_hyperparameter_objective_is_exact_logistic_and_above_the_bound():
    """The hyperparameter objective uses E_q[log φ(f)] by quadrature plus the q(y) entropy and the
    bag term shared over the bag's instances: it must equal the exact logistic expectation
    (independent MC check) plus those terms, and dominate the PG tangent bound log φ(c)."""
    g = torch.Generator().manual_seed(1)
    lik = MILBernoulliLikelihood("gamma")
    mean = torch.tensor([-2.0, 0.3, 1.5], dtype=torch.float64)
    var = torch.tensor([0.5, 2.0, 0.1], dtype=torch.float64)
    pi = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    bag_index = torch.tensor([0, 0, 1])
    labels = torch.tensor([1.0, 1.0], dtype=torch.float64)
    terms = lik.hyperparameter_terms(mean, var, Bags(bag_index, 2), labels, pi)
    f = mean + var.sqrt() * torch.randn(400_000, 3, generator=g, dtype=torch.float64)
    log_phi = -math.log(2 * math.pi) - torch.log(torch.cosh(f / 2))
    entropy = -(pi * torch.log(pi) + (1 - pi) * torch.log(1 - pi))
    # positive bags: E[log p(T|y)] = log H · P(any y = 1) − log(H + 1), shared evenly over the bag
    p_any = torch.tensor([1 - 0.9 * 0.5, 0.9], dtype=torch.float64)
    bag_share = (math.log(100.0) * p_any - math.log(101.0))[bag_index] / torch.tensor([2.0, 2.0, 1.0], dtype=torch.float64)
    mc = (pi - 0.5) * mean + log_phi.mean(0) + math.log(math.pi) + entropy + bag_share
    torch.testing.assert_close(terms, mc, atol=5 * (log_phi.std(0) / 632).max().item(), rtol=0)
    c = torch.sqrt(mean**2 + var)
    bound = (pi - 0.5) * mean - torch.log(2 * torch.cosh(c / 2)) + entropy + bag_share
    assert (terms >= bound - 1e-12).all()
