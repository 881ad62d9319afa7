"""VGPMILClassifier: scikit-learn compatibility, saving, input validation, dtype, minibatch path, kernel search."""
import pickle

import numpy as np
import pytest
import torch
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV, cross_val_score

from milgp.estimators import VGPMILClassifier
from milgp.linalg import CholeskyError
from milgp.prediction import BagPosterior

FAST = dict(num_inducing=6, max_iter=8, search_iter=3)


def toy_bags(B=24, seed=0, d=2):
    """Positive bags hold at least one instance from a shifted cluster."""
    rng = np.random.default_rng(seed)
    bags, y = [], []
    for b in range(B):
        n = int(rng.integers(2, 6))
        x = rng.normal(size=(n, d))
        label = b % 2
        if label:
            x[rng.integers(n)] += 3.0
        bags.append(x)
        y.append(label)
    return bags, np.asarray(y)


def test_fit_predict_shapes_and_quality():
    """A separable toy problem must be learned (bag AUC-like ordering) and every prediction
    method must return the documented shapes."""
    bags, y = toy_bags()
    clf = VGPMILClassifier(num_inducing=8, max_iter=15).fit(bags, y)
    proba = clf.predict_proba(bags)
    assert proba.shape == (24, 2) and np.allclose(proba.sum(1), 1)
    assert (clf.predict(bags) == y).mean() >= 0.85
    p, s = clf.predict_bag_proba(bags)
    assert p.shape == s.shape == (24,) and (s >= 0).all()
    inst = clf.predict_instance_proba(bags)
    assert [len(a) for a in inst] == [len(b) for b in bags]
    inst_p, inst_s = clf.predict_instance_proba(bags, return_std=True)
    assert [a.shape for a in inst_s] == [(len(b),) for b in bags]
    assert all(((a >= 0) & (a <= 1)).all() for a in inst_p)
    assert np.isfinite(clf.elbo_)


def test_auto_scores_the_max_at_the_longest_training_bags_resolution():
    """``bag_rule="auto"`` scores the max with the longest training bag as reference length (the
    training bags hold 2–5 instances): the same max on bags of those lengths, the mean of the top
    n_b/5 on longer ones, so a bag re-drawn longer is not called positive for its length. An
    explicit ``"max"`` stays the plain max (the rule of the 2017 reference code)."""
    from milgp.prediction import MaxRule

    bags, y = toy_bags()
    auto = VGPMILClassifier(**FAST).fit(bags, y)
    maxes = [m.decision.rule for m in auto.ensemble_.members if isinstance(m.decision.rule, MaxRule)]
    assert all(r.reference_length == max(len(b) for b in bags) for r in maxes)
    assert any("MaxRule(reference_length=5)" in m.decision.candidates for m in auto.ensemble_.members)
    plain = VGPMILClassifier(bag_rule="max", **FAST).fit(bags, y)
    assert plain.decision_.rule.reference_length is None


@pytest.mark.parametrize("bag_rule", ["max", "joint", "noisy_or", "joint_max", "top_k_mean"])
def test_other_bag_rules(bag_rule):
    """Every named bag rule fits, calibrates and returns probabilities in [0, 1]."""
    bags, y = toy_bags(B=12)
    clf = VGPMILClassifier(bag_rule=bag_rule, **FAST).fit(bags, y)
    p = clf.predict_proba(bags)[:, 1]
    assert p.shape == (12,) and ((p >= 0) & (p <= 1)).all()


def test_sklearn_clone_gridsearch_cross_val_score():
    """clone, GridSearchCV over num_inducing and cross_val_score must work (get_params/
    set_params round trip, no state in __init__, classes_ set)."""
    bags, y = toy_bags(B=16)
    clf = VGPMILClassifier(**FAST)
    c2 = clone(clf)
    assert c2.get_params() == clf.get_params()
    grid = GridSearchCV(VGPMILClassifier(**FAST), {"num_inducing": [3, 6]}, cv=2)
    grid.fit(bags, y)
    assert grid.best_params_["num_inducing"] in (3, 6)
    scores = cross_val_score(VGPMILClassifier(**FAST), bags, y, cv=2)
    assert scores.shape == (2,) and np.isfinite(scores).all()


def test_a_pickled_fitted_classifier_predicts_exactly_as_before():
    """Users save fitted models (pickle, joblib). The fitted state — every averaged candidate, its
    bag rule and calibration, the instance map, the scaler — must survive the round trip: a
    generator, lambda or scripted function kept on the estimator would make ``dumps`` fail, and
    state kept outside it would change the loaded model's predictions."""
    bags, y = toy_bags(B=16)
    clf = VGPMILClassifier(**FAST).fit(bags, y)
    loaded = pickle.loads(pickle.dumps(clf))
    for a, b in zip(clf.predict_bag_proba(bags), loaded.predict_bag_proba(bags)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(clf.predict_instance_proba(bags), loaded.predict_instance_proba(bags)):
        np.testing.assert_array_equal(a, b)

BAD_INPUTS = [
    (lambda b, y: ([*b[:3], np.zeros((0, 2))], np.r_[y[:3], 1]), r"bags\[3\] is empty"),
    (lambda b, y: (b, np.r_[y[:-1], 2]), r"bag 23 has label 2"),
    (lambda b, y: ([b[0], np.array([[np.nan, 1.0]]), *b[2:]], y), r"bags\[1\] has NaN or inf"),
    (lambda b, y: ([b[0], b[1], np.array([[np.inf, 1.0], [0, 0]]), *b[3:]], y), r"bags\[2\] has NaN or inf .*instance 0"),
    (lambda b, y: (b, y[:-1]), r"24 bags but 23 labels"),
    (lambda b, y: (b, np.zeros(24)), r"only bags of class 0"),
    (lambda b, y: ([b[0], np.ones(2), *b[2:]], y), r"bags\[1\] is 1-D"),
    (lambda b, y: ([b[0], np.ones((2, 3)), *b[2:]], y), r"bags\[1\] has 3 features, but bags\[0\] has 2"),
    (lambda b, y: ([], []), r"bags is empty"),
    (lambda b, y: (np.ones((5, 2)), np.ones(5)), r"sequence of \(n_b, d\) arrays"),
    (lambda b, y: (b, y.reshape(-1, 1)), r"1-D array of bag labels"),
]


@pytest.mark.parametrize("make,match", BAD_INPUTS)
def test_bad_input_raises_value_error_naming_the_field(make, match):
    """Bad training input must raise ValueError whose message names the bag / field."""
    bags, y = toy_bags()
    bad_bags, bad_y = make(bags, y)
    with pytest.raises(ValueError, match=match):
        VGPMILClassifier(**FAST).fit(bad_bags, bad_y)


def test_predict_validates_width_and_fitted_state():
    """Predicting with the wrong number of features must name both widths; predicting before
    fit must raise sklearn's NotFittedError."""
    from sklearn.exceptions import NotFittedError

    bags, y = toy_bags(B=10)
    with pytest.raises(NotFittedError):
        VGPMILClassifier().predict(bags)
    clf = VGPMILClassifier(**FAST).fit(bags, y)
    with pytest.raises(ValueError, match="3 features, the model was fitted on 2"):
        clf.predict([np.ones((2, 3))])


def test_bad_options_raise():
    """Unknown bag_rule / dtype / psi must raise ValueError naming the option (bag_rule's with
    every accepted value, the default ``'auto'`` among them)."""
    bags, y = toy_bags(B=10)
    with pytest.raises(ValueError, match=r"^bag_rule must be 'auto', one of \[.*'top_k_mean'\] or a BagRule instance, got 'median'$"):
        VGPMILClassifier(bag_rule="median", **FAST).fit(bags, y)
    with pytest.raises(ValueError, match="dtype"):
        VGPMILClassifier(dtype="float16", **FAST).fit(bags, y)
    with pytest.raises(ValueError, match="psi"):
        VGPMILClassifier(psi="t", **FAST).fit(bags, y)
    with pytest.raises(ValueError, match="bag_mean_inducing"):
        VGPMILClassifier(bag_mean_inducing=1.0, **FAST).fit(bags, y)


def test_on_wide_features_a_quarter_of_the_inducing_points_sit_at_the_bags_means():
    """With more features than inducing points, by default M/4 of them are standardised
    training-bag means and the rest instances; ``bag_mean_inducing=0`` places every point at an
    instance (the reference code), as does the default on features narrower than M."""
    bags, y = toy_bags(B=30, seed=3, d=24)
    for share, at_means, d in ((0.25, 5, 24), (0.0, 0, 24), (0.25, 0, 20)):
        bags = [b[:, :d] for b in bags]
        clf = VGPMILClassifier(num_inducing=20, bag_mean_inducing=share, max_iter=8, search_iter=3).fit(bags, y)
        Z = clf.model_.variational_strategy.inducing_points.detach().numpy()
        x = [clf.scaler_.transform(torch.as_tensor(b)).numpy() for b in bags]
        means = np.stack([b.mean(0) for b in x])
        instances = np.concatenate(x)
        is_mean = [np.isclose(means, z, rtol=0, atol=1e-12).all(1).any() for z in Z]
        is_instance = [np.isclose(instances, z, rtol=0, atol=1e-12).all(1).any() for z in Z]
        assert Z.shape == (20, d) and sum(is_mean) == at_means and sum(is_instance) == 20 - at_means


def test_a_linear_kernel_on_narrow_features_sits_on_its_span_and_fits_the_same_model():
    """With fewer features than inducing points the linear candidate's inducing points are the
    basis that spans its function space (``D`` points instead of ``M``): the model is the exact
    linear model either way, so its bag probabilities must equal those of a fit whose ``M = D``
    instance points span the same space (to their jitter). A basis that missed a direction, or a
    fit that read the other candidates' projections, would change them."""
    bags, y = toy_bags(B=24, seed=5, d=3)
    settings = dict(kernel="linear", max_rule="max", max_iter=40, tol=0.0)
    on_basis = VGPMILClassifier(num_inducing=12, **settings).fit(bags, y)
    on_instances = VGPMILClassifier(num_inducing=3, **settings).fit(bags, y)
    Z = on_basis.model_.variational_strategy.inducing_points
    torch.testing.assert_close(Z, 3**0.5 * torch.eye(3, dtype=Z.dtype))
    assert on_instances.model_.variational_strategy.inducing_points.shape == (3, 3)
    # 4e-6 apart: the jitter on the three instance points' ill-conditioned K_zz (a missing direction: ~0.1)
    np.testing.assert_allclose(on_basis.predict_proba(bags), on_instances.predict_proba(bags), rtol=0, atol=5e-5)


def test_nan_kernel_raises_cholesky_error_at_predict():
    """A corrupted (NaN) kernel must raise CholeskyError with a message naming K_zz."""
    bags, y = toy_bags(B=10)
    clf = VGPMILClassifier(**FAST).fit(bags, y)
    clf.model_.covar_module.raw_outputscale.data.fill_(float("nan"))
    with pytest.raises(CholeskyError, match="K_zz"):
        clf.predict_proba(bags)


def test_float32_works():
    """dtype='float32' must fit and predict with float32 tensors and finite outputs."""
    bags, y = toy_bags()
    clf = VGPMILClassifier(dtype="float32", num_inducing=8, max_iter=15).fit(bags, y)
    assert clf.model_.variational_strategy.inducing_points.dtype == torch.float32
    p = clf.predict_proba(bags)[:, 1]
    assert np.isfinite(p).all() and (clf.predict(bags) == y).mean() >= 0.8


def test_minibatch_path_gets_a_reasonable_elbo():
    """bags_per_batch (stochastic natural steps) must reach an ELBO close to full batch and
    classify the toy problem (exact rule: full-batch CAVI is then coordinate ascent of that ELBO)."""
    bags, y = toy_bags(B=32, seed=3)
    kw = dict(num_inducing=8, kernel="rbf", lengthscale=1.5, outputscale=3.0, max_iter=60, max_rule="exact", bag_size_cap=None)
    full = VGPMILClassifier(**kw).fit(bags, y)
    mb = VGPMILClassifier(bags_per_batch=8, **kw).fit(bags, y)
    assert mb.elbo_ <= full.elbo_ + 1e-6 * abs(full.elbo_)
    assert mb.elbo_ > full.elbo_ - 0.05 * abs(full.elbo_)
    assert (mb.predict(bags) == y).mean() >= 0.85


def test_a_fixed_kernel_runs_cavi_to_convergence():
    """With the kernel fixed (one candidate) the fit must run CAVI until its tolerance is met and
    keep the given kernel values."""
    bags, y = toy_bags(B=16, seed=1)
    clf = VGPMILClassifier(num_inducing=6, kernel="rbf", lengthscale=1.2, outputscale=2.0, max_rule="max", max_iter=300, tol=1e-8).fit(bags, y)
    assert clf.fit_result_.converged and clf.fit_result_.iterations > 2
    assert len(clf.search_) == 1
    assert float(clf.model_.covar_module.outputscale) == pytest.approx(2.0)
    assert float(clf.model_.covar_module.base_kernel.lengthscale) == pytest.approx(1.2)


def test_auto_max_rule_fits_both_pi_rules_and_averages_them():
    """``max_rule="auto"`` (the default) must fit the largest-other-π rule at every candidate
    kernel and single-instance learning at the most flexible ones (variance 10: RBF at √D and
    linear, the linear one with an intercept), the largest-other-π fit at the smoothest kernel first; the predicted bag probability
    is the weighted mean of the kept candidates' calibrated probabilities (weights summing to 1,
    heaviest first, the fitted ``model_`` the heaviest's), and ``average=False`` keeps the single
    candidate with the smallest out-of-bag NLL."""
    bags, y = toy_bags(B=20, seed=2)
    clf = VGPMILClassifier(**FAST).fit(bags, y)
    fits = [(s["likelihood"], s["kernel"], s["lengthscale"], s["outputscale"]) for s in clf.search_]
    root = np.sqrt(bags[0].shape[1])
    grid = [("rbf", root, 1.0), ("rbf", root, 10.0), ("rbf", 2 * root, 10.0), ("linear", None, 10.0)]
    expected = [("max", *k) for k in grid] + [("single", *grid[1]), ("single", "affine", None, 10.0)]
    assert [(v, k, ls if ls is None else pytest.approx(ls), s) for v, k, ls, s in expected] == fits
    weights = [m.weight for m in clf.ensemble_.members]
    assert sum(weights) == pytest.approx(1.0) and weights == sorted(weights, reverse=True)
    assert clf.model_ is clf.ensemble_.members[0].model
    test, _ = toy_bags(B=8, seed=9)
    manual = sum(
        m.weight * m.decision(BagPosterior.from_model(m.model, *clf._features(test)), m.likelihood.instance_link)[0]
        for m in clf.ensemble_.members
    )
    np.testing.assert_allclose(clf.predict_proba(test)[:, 1], manual.numpy(), rtol=1e-12)
    single = VGPMILClassifier(average=False, **FAST).fit(bags, y)
    assert len(single.ensemble_.members) == 1
    best = min(single.search_, key=lambda s: s["heldout_nll"])
    assert single.likelihood_.max_rule == best["likelihood"] and repr(single.decision_.rule) == best["rule"]


def test_instance_probabilities_are_calibrated_to_the_mil_fits_instance_labels():
    """``predict_instance_proba`` must map the averaged score to the MIL fits' posterior instance
    labels: single-instance learning calls the negative instances of positive bags positive, so
    without the map the instance ECE on bags with 30 % witnesses is 0.15 (with it 0.06); the map is
    monotone, so the instance ranking must not change. With the largest-other-π rule alone the map
    is fitted too: the fit's own ``E_q[σ(f)]`` ignores the bag labels (ECE 0.15 here, 0.07 mapped).
    G-VGPMIL's latent is not on the logistic scale (its raw instance ECE is 0.38); mapped to its
    ``q(y)`` it must be calibrated as well (0.35 when mapped to ``E_q[σ(f)]`` instead)."""
    from milgp.data.synthetic_mil import synthetic_mil
    from milgp.metrics import auroc, expected_calibration_error

    x, bag_index, bag_labels, inst = synthetic_mil(num_instances=1200, dim=4, bag_sizes=(5, 15), witness_rate=0.3, seed=0)
    bags = [x[bag_index == b] for b in range(len(bag_labels))]
    labels = [inst[bag_index == b] for b in range(len(bag_labels))]
    half = len(bags) // 2
    clf = VGPMILClassifier(random_state=0).fit(bags[:half], bag_labels[:half])
    assert clf.instance_calibrator_ is not None
    truth = np.concatenate(labels[half:])
    p = np.concatenate(clf.predict_instance_proba(bags[half:]))
    calibrator, clf.instance_calibrator_ = clf.instance_calibrator_, None
    raw = np.concatenate(clf.predict_instance_proba(bags[half:]))
    assert expected_calibration_error(p, truth) < 0.08 < 0.12 < expected_calibration_error(raw, truth)
    assert auroc(p, truth) == pytest.approx(auroc(raw, truth), abs=0.005)
    clf.instance_calibrator_ = calibrator
    p2, s2 = clf.predict_instance_proba(bags[half:], return_std=True)
    assert all(((a >= 0) & (a <= 1)).all() and (b >= 0).all() for a, b in zip(p2, s2))
    mil_only = VGPMILClassifier(max_rule="max", **FAST).fit(bags[:half], bag_labels[:half])
    p_mil = np.concatenate(mil_only.predict_instance_proba(bags[half:]))
    mil_only.instance_calibrator_ = None
    assert expected_calibration_error(p_mil, truth) < 0.10 < 0.13 < expected_calibration_error(np.concatenate(mil_only.predict_instance_proba(bags[half:])), truth)
    gamma = VGPMILClassifier(psi="gamma", random_state=0).fit(bags[:half], bag_labels[:half])
    assert expected_calibration_error(np.concatenate(gamma.predict_instance_proba(bags[half:])), truth) < 0.15
