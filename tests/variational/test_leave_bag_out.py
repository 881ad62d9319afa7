"""Leave-one-bag-out cavities against a brute-force posterior built without each bag."""
import pytest
import torch

from milgp.data.bags import BagBatch, Bags, bag_index_from_sizes
from milgp.likelihoods.mil_bernoulli import MILBernoulliLikelihood
from milgp.likelihoods.mil_probit import MILProbitLikelihood
from milgp.models.closed_form_strategy import Projection, WhitenedPosterior
from milgp.models.sparse_gp import SparseGP
from milgp.variational.fit import fit_closed_form
from milgp.variational.leave_bag_out import leave_bag_out_posterior
from milgp.variational.natural_update import natural_statistics

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _fit(likelihood, constant_mean=False, num_inducing=6):
    g = torch.Generator().manual_seed(0)
    sizes = [3, 5, 2, 6, 4, 1, 3]
    bag_index = bag_index_from_sizes(sizes)
    x = torch.randn(int(sum(sizes)), 3, generator=g, dtype=torch.float64)
    labels = torch.tensor([1, 0, 1, 0, 1, 0, 1], dtype=torch.float64)
    model = SparseGP(torch.randn(num_inducing, 3, generator=g, dtype=torch.float64), lengthscale=1.5, outputscale=2.0, constant_mean=constant_mean)
    if constant_mean:
        model.mean_module.constant.data.fill_(-0.4)
    batch = BagBatch(x, bag_index, labels)
    result = fit_closed_form(model, likelihood, batch, max_iter=15, learn_hyperparameters=False)
    return model, batch, result.locals


@pytest.mark.parametrize(
    "likelihood, constant_mean, num_inducing",
    [
        (MILBernoulliLikelihood("pg", max_rule="max"), False, 6),
        (MILBernoulliLikelihood("gamma"), True, 6),
        (MILProbitLikelihood(), False, 6),
        (MILBernoulliLikelihood("pg", max_rule="max"), True, 3),
    ],
    ids=["vgpmil-max", "gvgpmil-mean", "probit", "bags-larger-than-M"],
)
def test_cavity_equals_posterior_without_the_bag(likelihood, constant_mean, num_inducing):
    """For every bag b: the marginals and the within-bag covariance block of q_{−b}(f_b) must equal
    those of the Gaussian built from every other bag's quadratic terms (same locals) to 1e-10, both
    in the bag's own space (n_b ≤ M, Woodbury) and in the inducing space (n_b > M). A cavity that
    forgot the mean function, used q(v) instead of the statistics, or dropped a bag's own
    precision fails here."""
    model, batch, locals_ = _fit(likelihood, constant_mean, num_inducing)
    post = leave_bag_out_posterior(model, likelihood, batch, locals_, block_budget=40)
    blocks = {}
    for blk in post.joint_blocks():
        for j, b in enumerate(blk.bags.tolist()):
            n = int(blk.mask[j].sum())
            blocks[b] = (blk.mean[j, :n], blk.cov[j, :n, :n])
    with torch.no_grad():
        proj = model.variational_strategy.projection(batch.x)
        mean, var = model.variational_strategy.marginals(proj, model.variational_strategy.whitened_posterior())
        b, lam = likelihood.quadratic_terms(mean, var, batch.bags, batch.bag_labels, locals_)
        for bag in range(batch.num_bags):
            keep, sel = batch.bag_index != bag, batch.bag_index == bag
            eta1, P = natural_statistics(proj.A[:, keep], b[keep], lam[keep], proj.prior_mean[keep]).targets()
            q_minus = WhitenedPosterior.from_natural(eta1, P)
            m_ref, v_ref = model.variational_strategy.marginals(Projection(proj.A[:, sel], proj.prior_var[sel], proj.prior_mean[sel]), q_minus)
            torch.testing.assert_close(post.mean[sel], m_ref, rtol=0, atol=1e-10)
            torch.testing.assert_close(post.var[sel], v_ref, rtol=0, atol=1e-10)
            mp, cp, _ = model.variational_strategy.bag_covariances(batch.x[sel], Bags(torch.zeros(int(sel.sum()), dtype=torch.long), 1), q_minus)
            torch.testing.assert_close(blocks[bag][0], mp[0], rtol=0, atol=1e-10)
            torch.testing.assert_close(blocks[bag][1], cp[0], rtol=0, atol=1e-10)


def test_cavity_is_not_the_full_posterior():
    """The cavity must differ from the in-sample posterior (the bag's own evidence is removed): a
    positive bag's instances are predicted lower out of bag than in sample on average."""
    likelihood = MILBernoulliLikelihood("pg", max_rule="max")
    model, batch, locals_ = _fit(likelihood)
    post = leave_bag_out_posterior(model, likelihood, batch, locals_)
    mean, _ = model.variational_strategy.predict_marginals(batch.x)
    pos = batch.bag_labels[batch.bag_index] > 0.5
    assert (mean[pos] - post.mean[pos]).mean() > 0.01
    assert (mean[~pos] - post.mean[~pos]).mean() < -0.01
