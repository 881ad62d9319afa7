"""Bag rules: each against an independent reference, their invariances, and their error paths."""
import math

import pytest
import torch

from milgp.data.bags import Bags
from milgp.likelihoods.instance_link import LogisticLink, ProbitLink
from milgp.likelihoods.orthant import orthant_probability
from milgp.prediction import (
    BagPosterior,
    JointMaxRule,
    JointNoisyOrRule,
    MaxRule,
    NoisyOrRule,
    OrthantRule,
    TopKMeanRule,
    make_bag_rule,
)

pytestmark = pytest.mark.usefixtures("single_torch_thread")

BAG_INDEX = torch.tensor([0, 0, 0, 1, 1, 2])
MEAN = torch.tensor([-2.0, -1.0, 0.5, -3.0, -2.5, 1.0], dtype=torch.float64)
VAR = torch.tensor([1.0, 0.5, 2.0, 0.2, 3.0, 1.0], dtype=torch.float64)


def _diag_posterior(mean=MEAN, var=VAR, bag_index=BAG_INDEX, num_bags=3):
    """Marginals plus diagonal joint blocks: the factorised posterior of the noisy-OR model."""

    def blocks(group):
        from milgp.data.bags import to_padded

        m, mask = to_padded(mean[group.inst], group.local_bags)
        v, _ = to_padded(var[group.inst], group.local_bags, fill=1.0)
        return m, torch.diag_embed(v), mask

    return BagPosterior(mean, var, Bags(bag_index, num_bags), blocks)


def test_noisy_or_matches_monte_carlo():
    """E[1 − Π(1 − σ(f_n))] and its std with independent instances (Castro-Macías et al. 2024,
    Eqs. 34–36) against 1e6 Monte-Carlo draws."""
    g = torch.Generator().manual_seed(1)
    p, s = NoisyOrRule()(_diag_posterior(), LogisticLink())
    f = MEAN + VAR.sqrt() * torch.randn(1_000_000, 6, generator=g, dtype=torch.float64)
    keep = torch.sigmoid(-f)
    pb = 1 - torch.stack([keep[:, BAG_INDEX == b].prod(1) for b in range(3)], 1)
    assert ((p - pb.mean(0)).abs() <= 5 * pb.std(0) / 1000.0).all()
    se_s = ((pb - pb.mean(0)) ** 2).std(0) / (2 * pb.std(0) * 1000.0)
    assert ((s - pb.std(0)).abs() <= 5 * se_s).all()


def test_noisy_or_std_of_long_bag_is_accurate_in_float32():
    """A 1,000-instance bag: the float32 std must match the float64 one to 1e-3 relative. The
    difference of two nearly equal products (E[Π(1−p)²] − E[Π(1−p)]²) loses every digit in float32."""
    g = torch.Generator().manual_seed(2)
    mean = -5.0 + 0.3 * torch.randn(1000, generator=g, dtype=torch.float64)
    var = torch.full((1000,), 0.001, dtype=torch.float64)
    idx = torch.zeros(1000, dtype=torch.long)
    p64, s64 = NoisyOrRule()(BagPosterior(mean, var, Bags(idx, 1)), LogisticLink())
    p32, s32 = NoisyOrRule()(BagPosterior(mean.float(), var.float(), Bags(idx, 1)), LogisticLink())
    assert s64.item() > 0
    assert s32.item() == pytest.approx(s64.item(), rel=1e-3)
    assert p32.item() == pytest.approx(p64.item(), rel=1e-4)


@pytest.mark.parametrize(
    "dtype, link, mu",
    [(torch.float64, ProbitLink(), 40.0), (torch.float64, LogisticLink(), 1000.0),
     (torch.float32, LogisticLink(), 45.0), (torch.float32, ProbitLink(), 15.0)],
)
def test_noisy_or_std_of_a_bag_with_a_sure_positive_is_zero_not_nan(dtype, link, mu):
    """A bag with an almost surely positive instance: p = 1 and its std ~0. If this fails, the
    variance multiplied a zero instance std by ``1/g² = ∞`` (g = E[1 − p] underflows) and returned
    NaN, which the bag calibrator and every metric then passed on or refused."""
    mean, var = torch.tensor([mu, -2.0], dtype=dtype), torch.tensor([1.0, 1.0], dtype=dtype)
    p, s = NoisyOrRule()(BagPosterior(mean, var, Bags(torch.tensor([0, 0]), 1)), link)
    assert p.item() == 1.0
    assert math.isfinite(s.item()) and 0.0 <= s.item() < 1e-6


def test_noisy_or_combine_takes_a_probability_of_one_in_float32():
    """Instance probabilities from another source (no ``log E[p(y=0|f)]``), one of them 1.0 in
    float32: p = 1 and std 0. If this fails, the cap of p below 1 (1 − 1e-16) was a no-op in float32,
    log(1 − p) = −∞ and the std came out NaN."""
    p, s = NoisyOrRule().combine(torch.tensor([1.0, 0.3]), torch.tensor([0.0, 0.1]), Bags(torch.tensor([0, 0]), 1))
    assert p.item() == 1.0
    assert math.isfinite(s.item()) and s.item() < 1e-3


def test_joint_noisy_or_with_diagonal_covariance_equals_noisy_or():
    """Sampling a diagonal joint q(f*_b) is the factorised model: the sampling rule must agree with
    the exact noisy-OR within Monte-Carlo error, and padded entries must not count."""
    p, s = NoisyOrRule()(_diag_posterior(), LogisticLink())
    n = 200_000
    pj, sj = JointNoisyOrRule(num_samples=n)(_diag_posterior(), LogisticLink(), torch.Generator().manual_seed(7))
    assert ((pj - p).abs() <= 5 * s / math.sqrt(n)).all()
    torch.testing.assert_close(sj, s, rtol=0.02, atol=1e-3)


def test_max_rule_is_the_most_probable_instance():
    """Max rule: the bag probability and std are those of its most probable instance."""
    link = LogisticLink()
    p_inst, s_inst = link.moments(MEAN, VAR)
    p, s = MaxRule()(_diag_posterior(), link)
    for b in range(3):
        j = torch.nonzero(BAG_INDEX == b).flatten()
        top = j[p_inst[j].argmax()]
        assert p[b].item() == p_inst[top].item() and s[b].item() == s_inst[top].item()


def test_top_k_mean_by_count_and_by_fraction():
    """Top-k mean: the mean of the k largest instance probabilities (all of a shorter bag); with a
    fraction, of the c = fraction·n_b largest (at least one), the last weighted c − ⌊c⌋: a bag of
    3 at fraction ½ averages its largest and half of its second largest over 1.5."""
    link = LogisticLink()
    p_inst, _ = link.moments(MEAN, VAR)
    ref = []
    for b in range(3):
        v = torch.sort(p_inst[BAG_INDEX == b], descending=True).values
        ref.append(v[:2].mean())
    p, _ = TopKMeanRule(k=2)(_diag_posterior(), link)
    torch.testing.assert_close(p, torch.stack(ref))
    half, _ = TopKMeanRule(fraction=0.5)(_diag_posterior(), link)  # c = 1.5, 1, max(0.5, 1) = 1
    top = [torch.sort(p_inst[BAG_INDEX == b], descending=True).values for b in range(3)]
    expect = [(top[0][0] + 0.5 * top[0][1]) / 1.5, top[1][0], top[2][0]]
    torch.testing.assert_close(half, torch.stack(expect))
    mean_rule, _ = TopKMeanRule(fraction=1.0)(_diag_posterior(), link)
    torch.testing.assert_close(mean_rule, torch.stack([p_inst[BAG_INDEX == b].mean() for b in range(3)]))


def test_max_rule_with_reference_length_against_sorted_reference():
    """MaxRule(reference_length=n₀): bags of at most n₀ instances keep the plain max (probability
    and std); a bag of n_b > n₀ scores the mean of its c = n_b/n₀ largest probabilities with the
    last one weighted c − ⌊c⌋, std sqrt(Σ w² v)/c — checked against a sort in float64 per bag."""
    g = torch.Generator().manual_seed(4)
    sizes = [1, 3, 4, 5, 9, 10]
    idx = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    mean = torch.randn(len(idx), generator=g, dtype=torch.float64)
    var = torch.rand(len(idx), generator=g, dtype=torch.float64)
    post = BagPosterior(mean, var, Bags(idx, len(sizes)))
    link = LogisticLink()
    p_inst, s_inst = link.moments(mean, var)
    n0 = 4
    p, s = MaxRule(reference_length=n0)(post, link)
    p_max, s_max = MaxRule()(post, link)
    for b, n in enumerate(sizes):
        if n <= n0:
            assert p[b].item() == p_max[b].item() and s[b].item() == s_max[b].item()
            continue
        order = torch.argsort(p_inst[idx == b], descending=True)
        c = n / n0
        w = torch.tensor([min(max(c - r, 0.0), 1.0) for r in range(n)], dtype=torch.float64)
        ref_p = (w * p_inst[idx == b][order]).sum() / c
        ref_s = ((w * s_inst[idx == b][order]) ** 2).sum().sqrt() / c
        assert p[b].item() == pytest.approx(ref_p.item(), rel=1e-12)
        assert s[b].item() == pytest.approx(ref_s.item(), rel=1e-12)


class _IdentityLink(LogisticLink):
    """Instance probability = the posterior mean itself, std 0 (to feed rules chosen probabilities)."""

    def moments(self, mean, var):
        return mean, torch.zeros_like(mean)


def test_max_rule_with_reference_length_does_not_grow_with_new_instances():
    """Negative bags re-drawn longer (new instances, not copies: a scan re-sliced more finely): the
    plain max of n uniform probabilities tends to 1 (E = n/(n+1)), so a long negative bag looks
    positive because it is long; the max at reference length n₀ is the mean of the top 1/n₀ of the
    bag and tends to 1 − 1/(2n₀) (0.95 for n₀ = 10). Were it to grow like the max, thin-slice
    scans would be called positive for their length."""
    g = torch.Generator().manual_seed(5)
    link = _IdentityLink()
    n0, num_bags = 10, 2000
    means = {}
    for n in (10, 40, 640):
        p = torch.rand(num_bags * n, generator=g, dtype=torch.float64)
        bags = Bags(torch.arange(num_bags).repeat_interleave(n), num_bags)
        post = BagPosterior(p, torch.zeros_like(p), bags)
        means[n] = (MaxRule(reference_length=n0)(post, link)[0].mean().item(), MaxRule()(post, link)[0].mean().item())
    assert means[10][0] == pytest.approx(10 / 11, abs=0.005)  # bags of n₀: the max itself
    assert means[640][0] == pytest.approx(1 - 1 / (2 * n0), abs=0.005)
    assert means[640][1] > 0.998 and means[40][1] > means[40][0] + 0.03


def test_max_rule_refuses_reference_length_below_one():
    with pytest.raises(ValueError, match="reference_length"):
        MaxRule(reference_length=0.5)


@pytest.mark.parametrize(
    "rule", [MaxRule(), MaxRule(reference_length=3), TopKMeanRule(fraction=0.25), TopKMeanRule(fraction=1.0)], ids=repr
)
def test_duplication_invariant_rules(rule):
    """Repeating every instance of every bag 10 times (a scan re-sliced 10× finer) must not change
    these rules' bag probabilities; the noisy-OR, for contrast, rises towards 1."""
    link = LogisticLink()
    rep = 10
    dup = BagPosterior(MEAN.repeat_interleave(rep), VAR.repeat_interleave(rep), Bags(BAG_INDEX.repeat_interleave(rep), 3))
    p, _ = rule(_diag_posterior(), link)
    p_dup, _ = rule(dup, link)
    torch.testing.assert_close(p_dup, p, rtol=0, atol=1e-12)
    n, _ = NoisyOrRule()(_diag_posterior(), link)
    n_dup, _ = NoisyOrRule()(dup, link)
    assert (n_dup > n + 0.05).all()


def test_joint_max_is_unchanged_by_exact_duplicates():
    """JointMaxRule: E[p(max f)] over joint samples. Exact copies of an instance share its latent
    value, so duplicating instances (perfectly correlated) must leave it unchanged within Monte
    Carlo error, while the joint noisy-OR compounds."""
    mean = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    cov = torch.tensor([[[1.0, 0.3], [0.3, 0.5]]], dtype=torch.float64)
    rep = torch.tensor([0, 0, 0, 1, 1, 1])
    mean_d, cov_d = mean[:, rep], cov[:, rep][:, :, rep]

    def post(m, c):
        n = m.shape[1]
        return BagPosterior(m[0], torch.diagonal(c[0]), Bags(torch.zeros(n, dtype=torch.long), 1), lambda group: (m, c, torch.ones_like(m, dtype=torch.bool)))

    n = 100_000
    p, s = JointMaxRule(num_samples=n)(post(mean, cov), LogisticLink(), torch.Generator().manual_seed(3))
    p_d, _ = JointMaxRule(num_samples=n)(post(mean_d, cov_d), LogisticLink(), torch.Generator().manual_seed(3))
    assert abs(p_d.item() - p.item()) <= 5 * s.item() / math.sqrt(n) + 1e-4
    # reference: E[σ(max(f1, f2))] by brute-force sampling
    g = torch.Generator().manual_seed(11)
    f = mean[0] + torch.randn(400_000, 2, generator=g, dtype=torch.float64) @ torch.linalg.cholesky(cov[0]).mT
    ref = torch.sigmoid(f.max(1).values).mean()
    assert abs(p.item() - ref.item()) <= 5 * s.item() / math.sqrt(n) + 1e-3
    jn, _ = JointNoisyOrRule(num_samples=20_000)(post(mean, cov), LogisticLink(), torch.Generator().manual_seed(3))
    jn_d, _ = JointNoisyOrRule(num_samples=20_000)(post(mean_d, cov_d), LogisticLink(), torch.Generator().manual_seed(3))
    assert jn_d.item() > jn.item() + 0.1


def test_orthant_rule_matches_the_orthant_integral():
    """OrthantRule = 1 − P(all m < 0), m ~ N(μ, Σ + I) (Wang & Pinar 2021), computed through
    milgp.likelihoods.orthant with the augmentation noise added on the diagonal."""
    mean = torch.tensor([[-1.0, 0.5, -0.2]], dtype=torch.float64)
    A = torch.tensor([[1.0, 0.2, 0.0], [0.2, 0.8, 0.3], [0.0, 0.3, 1.5]], dtype=torch.float64)
    cov = (A @ A.mT).unsqueeze(0)
    mask = torch.ones(1, 3, dtype=torch.bool)
    post = BagPosterior(mean[0], torch.diagonal(cov[0]), Bags(torch.zeros(3, dtype=torch.long), 1), lambda group: (mean, cov, mask))
    p, se = OrthantRule(num_points=4096, replicates=8)(post, ProbitLink())
    p_neg, _ = orthant_probability(mean, cov + torch.eye(3, dtype=torch.float64), mask, num_points=4096, replicates=8, seed=0)
    assert p.item() == pytest.approx(1 - p_neg.item(), abs=5 * se.item() + 1e-6)
    # brute force
    g = torch.Generator().manual_seed(4)
    L = torch.linalg.cholesky(cov[0] + torch.eye(3, dtype=torch.float64))
    m = mean[0] + torch.randn(1_000_000, 3, generator=g, dtype=torch.float64) @ L.mT
    ref = 1 - (m < 0).all(1).double().mean()
    assert p.item() == pytest.approx(ref.item(), abs=5e-3)


def test_error_paths():
    """Unknown names, a wrong link for the orthant rule, marginal-only posteriors for joint rules,
    and bags too long to factorise must each raise a clear ValueError."""
    with pytest.raises(ValueError, match="unknown bag rule"):
        make_bag_rule("median")
    with pytest.raises(ValueError, match="probit"):
        OrthantRule()(_diag_posterior(), LogisticLink())
    with pytest.raises(ValueError, match="marginals only"):
        JointMaxRule()(BagPosterior(MEAN, VAR, Bags(BAG_INDEX, 3)), LogisticLink())
    with pytest.raises(ValueError, match="bag 0 has 3 instances"):
        JointMaxRule(max_instances=2)(_diag_posterior(), LogisticLink())
    with pytest.raises(ValueError, match="exactly one"):
        TopKMeanRule(k=2, fraction=0.5)
    assert make_bag_rule("top_k_mean").fraction == 0.25 and make_bag_rule("mean").fraction == 1.0
    assert isinstance(make_bag_rule("joint"), JointNoisyOrRule)
    assert isinstance(make_bag_rule("max"), MaxRule)


@pytest.mark.parametrize("rule", [JointNoisyOrRule(num_samples=64), JointMaxRule(num_samples=64)], ids=repr)
def test_sampling_rule_std_never_exceeds_that_of_a_probability_with_its_mean(rule):
    """Instances of huge variance: every sample's bag value is 0 or 1, and the std must be at most
    sqrt(p(1 − p)) with p the sample mean. If this fails, the std divided by S − 1 (the unbiased
    variance) while p is the plain mean, and the std overshot the largest std in [0, 1]."""
    mean = torch.tensor([0.3, -1.0], dtype=torch.float64)
    var = torch.tensor([1e12, 1e12], dtype=torch.float64)
    p, s = rule(_diag_posterior(mean, var, torch.tensor([0, 0]), 1), LogisticLink())
    assert 0.0 < p.item() < 1.0
    assert s.item() <= math.sqrt(p.item() * (1 - p.item())) * (1 + 1e-12)


def test_from_blocks_keeps_each_bag_its_own_block():
    """BagPosterior.from_blocks with bags of different sizes (processed smallest first): each bag
    must get the probability of its own block — a larger bag listed first once came back swapped."""
    mean = torch.tensor([[-1.0, 0.5, 0.0], [0.2, 0.0, 0.0]], dtype=torch.float64)
    cov = torch.eye(3, dtype=torch.float64).repeat(2, 1, 1)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    p, _ = OrthantRule()(BagPosterior.from_blocks(mean, cov, mask), ProbitLink())
    s2 = math.sqrt(2.0)

    def Phi(v):
        return torch.special.ndtr(torch.tensor(v, dtype=torch.float64))

    expect = torch.stack([1 - Phi(1 / s2) * Phi(-0.5 / s2) * 0.5, 1 - Phi(-0.2 / s2)])
    torch.testing.assert_close(p, expect, rtol=0, atol=1e-12)


@pytest.mark.parametrize("rule", [JointNoisyOrRule(num_samples=256), JointMaxRule(num_samples=256), OrthantRule(num_points=256)])
def test_joint_rules_give_a_bag_its_value_whatever_is_predicted_with_it(rule):
    """A bag's probability must depend on the bag alone: predicted alone, among other bags of other
    lengths (other padding) or in the reverse order, from the same generator seed, it is the same.
    If this fails, the Monte-Carlo noise of a bag depends on its neighbours (the sampling rules drew
    one stream for the whole block: 0.011 apart between alone and together)."""
    g = torch.Generator().manual_seed(2)
    B, n = 5, 6
    X = torch.randn(B, n, n, generator=g, dtype=torch.float64)
    cov = X @ X.mT / n + 0.1 * torch.eye(n, dtype=torch.float64)
    mean = torch.randn(B, n, generator=g, dtype=torch.float64)
    mask = torch.arange(n) < torch.tensor([6, 2, 4, 3, 5])[:, None]
    link = ProbitLink()

    def predict(order):
        order = torch.tensor(order)
        return rule(BagPosterior.from_blocks(mean[order], cov[order], mask[order]), link, torch.Generator().manual_seed(7))[0]

    together = predict([0, 1, 2, 3, 4])
    torch.testing.assert_close(predict([4, 3, 2, 1, 0]).flip(0), together, rtol=0, atol=1e-12)
    for b in range(B):
        torch.testing.assert_close(predict([b]), together[b : b + 1], rtol=0, atol=1e-12)
