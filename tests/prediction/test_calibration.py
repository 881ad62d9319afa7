"""Bag calibration (Platt scaling on held-out bag scores)."""
import math

import pytest
import torch

from milgp.data.bags import Bags
from milgp.prediction import BagCalibrator

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _logit(p):
    return torch.log(p) - torch.log1p(-p)


def test_recovers_the_generating_map():
    """Scores s and labels y ~ Bern(σ(a·logit(s) + c)) with a = 2.5, c = −1: the fit must recover
    (a, c) within sampling error (20,000 bags), and the calibrated probability equals the map."""
    g = torch.Generator().manual_seed(0)
    s = torch.rand(20_000, generator=g, dtype=torch.float64).clamp(0.01, 0.99)
    y = (torch.rand(20_000, generator=g, dtype=torch.float64) < torch.sigmoid(2.5 * _logit(s) - 1.0)).double()
    cal = BagCalibrator().fit(s, y)
    assert float(cal.slope) == pytest.approx(2.5, abs=0.1)
    assert float(cal.intercept) == pytest.approx(-1.0, abs=0.1)
    p, _ = cal(torch.tensor([0.5], dtype=torch.float64))
    assert p.item() == pytest.approx(torch.sigmoid(cal.intercept).item(), abs=1e-12)


def test_separable_scores_give_a_finite_slope():
    """Perfectly separated held-out scores must not give an infinite slope (Platt's smoothed
    targets); calibrated probabilities stay inside (0, 1)."""
    s = torch.tensor([0.1, 0.2, 0.3, 0.7, 0.8, 0.9], dtype=torch.float64)
    y = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.float64)
    cal = BagCalibrator().fit(s, y)
    assert math.isfinite(float(cal.slope)) and float(cal.slope) > 0
    p, _ = cal(s)
    assert (p > 0).all() and (p < 1).all()
    assert (p[3:] > 0.5).all() and (p[:3] < 0.5).all()


def test_anti_ranked_scores_give_the_base_rate():
    """Held-out scores ranked worse than chance must not be turned upside down: slope 0 and every
    bag gets the (smoothed) base rate."""
    s = torch.tensor([0.9, 0.8, 0.7, 0.3, 0.2, 0.1, 0.6, 0.4], dtype=torch.float64)
    y = torch.tensor([0, 0, 0, 1, 1, 1, 0, 1], dtype=torch.float64)
    cal = BagCalibrator().fit(s, y)
    assert float(cal.slope) == 0.0
    p, _ = cal(s)
    torch.testing.assert_close(p, torch.full_like(p, 0.5))


def test_identity_until_fitted_and_delta_method_std():
    """Before fit the calibrator returns its input; after, the std is a·p_c(1−p_c)/(s(1−s))·σ."""
    cal = BagCalibrator()
    p, s = cal(torch.tensor([0.3]), torch.tensor([0.1]))
    assert p.item() == pytest.approx(0.3) and s.item() == pytest.approx(0.1)
    cal.slope.fill_(2.0)
    cal.intercept.fill_(0.5)
    cal.fitted.fill_(True)
    x = torch.tensor([0.3], dtype=torch.float64)
    p, s = cal(x, torch.tensor([0.1], dtype=torch.float64))
    pc = torch.sigmoid(2.0 * _logit(x) + 0.5)
    torch.testing.assert_close(p, pc)
    torch.testing.assert_close(s, 2.0 * pc * (1 - pc) / (0.3 * 0.7) * 0.1)


def test_calibrated_std_never_exceeds_that_of_a_probability_with_its_mean():
    """A wide score near 0 (a bag far from every training bag under a flexible kernel) makes the
    delta method's linear factor huge; a probability with mean p has std at most sqrt(p(1 − p)).
    If this failed, a bag could be reported as p = 0.8 ± 0.8 (seen for a flexible kernel's bag far
    from the training bags: stds up to 2.3)."""
    cal = BagCalibrator()
    cal.slope.fill_(1.5)
    cal.intercept.fill_(3.0)
    cal.fitted.fill_(True)
    x = torch.tensor([0.02, 0.3], dtype=torch.float64)
    p, s = cal(x, torch.tensor([0.1, 0.01], dtype=torch.float64))
    assert s[0].item() == pytest.approx(math.sqrt(p[0].item() * (1 - p[0].item())), rel=1e-12)
    torch.testing.assert_close(s[1], 1.5 * p[1] * (1 - p[1]) / (0.3 * 0.7) * 0.01)  # a narrow score keeps the delta method


def test_float32_scores_are_calibrated_as_float64_ones():
    """Scores 0, 0.999999 and 1 in float32: the calibrated probabilities and stds are the float64
    ones rounded to float32, finite, in float32. If this fails, the clamp of a score to
    [1e-9, 1 − 1e-9] was a no-op in float32, so a score of 1 mapped to p = 1 (not the calibrated
    cap) with std 0/0 = NaN."""
    cal = BagCalibrator().fit(torch.tensor([0.1, 0.2, 0.8, 0.9, 0.3, 0.7], dtype=torch.float64),
                              torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 0.0], dtype=torch.float64))
    x, sd = torch.tensor([0.0, 0.999999, 1.0], dtype=torch.float64), torch.tensor([0.0, 1e-7, 0.0], dtype=torch.float64)
    p64, s64 = cal(x, sd)
    p32, s32 = cal(x.float(), sd.float())
    assert p32.dtype == s32.dtype == torch.float32
    assert torch.isfinite(s32).all() and p32[2].item() < 1.0
    torch.testing.assert_close(p32, p64.float())
    torch.testing.assert_close(s32, s64.float())


def test_state_dict_round_trip():
    """The fitted map travels in a state dict (a checkpoint) and is restored exactly."""
    cal = BagCalibrator().fit(torch.tensor([0.2, 0.4, 0.6, 0.8]), torch.tensor([0.0, 1.0, 0.0, 1.0]))
    other = BagCalibrator()
    other.load_state_dict(cal.state_dict())
    x = torch.tensor([0.1, 0.5, 0.95], dtype=torch.float64)
    torch.testing.assert_close(other(x)[0], cal(x)[0])


def test_bad_input():
    """Non-finite scores name the bag; one class only cannot be calibrated."""
    with pytest.raises(ValueError, match="bag 1"):
        BagCalibrator().fit(torch.tensor([0.2, float("nan")]), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="positive and negative"):
        BagCalibrator().fit(torch.tensor([0.2, 0.3]), torch.tensor([1.0, 1.0]))


def test_fit_bag_decision_picks_the_rule_that_predicts_held_out_bags():
    """Bags whose label is carried by their mean instance (diffuse evidence, one loud negative
    instance in negatives): the held-out NLL must choose the mean rule over the max rule, and the
    decision returns calibrated probabilities with every candidate's score recorded."""
    from milgp.likelihoods.instance_link import LogisticLink
    from milgp.prediction import BagPosterior, fit_bag_decision

    g = torch.Generator().manual_seed(0)
    B, n = 200, 10
    y = (torch.arange(B) % 2).double()
    mean = torch.randn(B, n, generator=g, dtype=torch.float64) + 0.8 * y.unsqueeze(1)
    mean[:, 0] = 3.0 + torch.randn(B, generator=g, dtype=torch.float64)  # a loud instance in every bag
    bag_index = torch.arange(B).repeat_interleave(n)
    post = BagPosterior(mean.reshape(-1), torch.full((B * n,), 0.1, dtype=torch.float64), Bags(bag_index, B))
    decision = fit_bag_decision(post, LogisticLink(), y)
    assert decision.rule.name == "top_k_mean" and decision.rule.fraction == 1.0
    assert set(decision.candidates) == {"MaxRule()", "TopKMeanRule(fraction=0.25)", "TopKMeanRule(fraction=1.0)"}
    assert decision.heldout_nll == min(decision.candidates.values())
    p, s = decision(post, LogisticLink())
    assert ((p > 0) & (p < 1)).all() and (s >= 0).all()
    with pytest.raises(ValueError, match="at least one"):
        fit_bag_decision(post, LogisticLink(), y, candidates=())


def test_score_bag_rules_keeps_each_rules_heldout_probabilities():
    """Every scored decision must carry the calibrated held-out probabilities behind its NLL (what
    the model average weighs), equal to applying that decision to the same posterior; with
    ``calibrate=False`` the calibration is the identity and the probabilities are the raw rule's."""
    from milgp.likelihoods.instance_link import LogisticLink
    from milgp.metrics import log_loss
    from milgp.prediction import BagPosterior, score_bag_rules

    g = torch.Generator().manual_seed(1)
    B, n = 60, 6
    y = (torch.arange(B) % 2).double()
    mean = torch.randn(B, n, generator=g, dtype=torch.float64) + 1.5 * y.unsqueeze(1) - 0.5
    post = BagPosterior(mean.reshape(-1), torch.full((B * n,), 0.3, dtype=torch.float64), Bags(torch.arange(B).repeat_interleave(n), B))
    link = LogisticLink()
    for calibrate in (True, False):
        scored = score_bag_rules(post, link, y, ("max", "top_k_mean", "mean", "noisy_or"), calibrate=calibrate)
        assert [d.rule.name for d in scored] == ["max", "top_k_mean", "top_k_mean", "noisy_or"]
        for d in scored:
            torch.testing.assert_close(d.heldout_proba, d(post, link)[0], rtol=1e-12, atol=1e-14)
            assert d.heldout_nll == pytest.approx(log_loss(d.heldout_proba, y), rel=1e-12)
            if not calibrate:
                torch.testing.assert_close(d.heldout_proba, d.rule(post, link)[0], rtol=1e-12, atol=1e-14)


def test_cross_fitted_calibration_scores_each_fold_with_the_other_folds_calibration():
    """Out-of-fold probabilities: each bag is calibrated by a Platt map fitted without it (the
    folds dealt in turn within each class), so the NLL of a calibration fitted on the same bags is
    not optimistic; every fold holds both classes; too few bags of a class gives None."""
    from milgp.prediction import cross_fitted_calibration, stratified_folds

    g = torch.Generator().manual_seed(3)
    y = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 1, 0, 0, 1], dtype=torch.float64)
    s = torch.sigmoid(1.5 * (2 * y - 1) + torch.randn(12, generator=g, dtype=torch.float64))
    fold = stratified_folds(y, 2)
    for k in range(2):
        assert set(y[fold == k].tolist()) == {0.0, 1.0}
    out = cross_fitted_calibration(s, y, folds=2)
    for k in range(2):
        held = fold == k
        expected = BagCalibrator().fit(s[~held], y[~held])(s[held])[0]
        torch.testing.assert_close(out[held], expected)
    in_sample = BagCalibrator().fit(s, y)(s)[0]
    assert not torch.allclose(out, in_sample)
    assert cross_fitted_calibration(s[:3], torch.tensor([0.0, 1.0, 1.0]), folds=2) is None



def test_auto_bag_rules_refuses_no_bags():
    """No held-out bag sizes: one line. If this fails, the max of an empty tensor raised a bare
    RuntimeError from inside torch."""
    from milgp.prediction.bag_decision import auto_bag_rules

    with pytest.raises(ValueError, match=r"^auto_bag_rules needs the sizes of at least one held-out bag"):
        auto_bag_rules(torch.tensor([], dtype=torch.long))


@pytest.mark.parametrize("bad", [float("nan"), 0.5, -1.0])
def test_fit_refuses_a_label_other_than_zero_or_one_by_bag(bad):
    """Labels 0, 1 and a NaN, 0.5 or −1 for bag 2: one line naming bag 2. If this fails, a NaN label
    made the slope, the intercept and every calibrated probability NaN, and 0.5 or −1 entered the
    fit as a target of its own."""
    with pytest.raises(ValueError, match=r"^bag 2 has label .*; bag calibration takes labels 0 or 1"):
        BagCalibrator().fit(torch.tensor([0.2, 0.8, 0.4, 0.6]), torch.tensor([0.0, 1.0, bad, 1.0]))


@pytest.mark.parametrize("folds", [0, 1])
def test_cross_fitted_calibration_refuses_fewer_than_two_folds(folds):
    """folds = 0 or 1: one line naming ``folds``. If this fails, folds = 0 raised a bare
    ZeroDivisionError-like RuntimeError and folds = 1 a misleading 'needs positive and negative bags'
    (the one fold was calibrated on no bags)."""
    from milgp.prediction import cross_fitted_calibration

    with pytest.raises(ValueError, match=rf"^folds must be at least 2 .*got {folds}$"):
        cross_fitted_calibration(torch.tensor([0.2, 0.8, 0.3, 0.7]), torch.tensor([0.0, 1.0, 0.0, 1.0]), folds=folds)
