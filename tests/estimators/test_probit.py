"""``ProbitMILClassifier`` (VI and Gibbs) through the scikit-learn interface."""
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.base import clone
from sklearn.exceptions import ConvergenceWarning
from sklearn.metrics import roc_auc_score

from milgp.data.bags import Bags
from milgp.estimators import ProbitMILClassifier
from milgp.estimators._mil_base import MILClassifierBase


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def make_bags(B, n=6, seed=0):
    rng = np.random.default_rng(seed)
    bags, y, inst = [], [], []
    for b in range(B):
        X = rng.normal(size=(n, 3))
        h = (X[:, 0] > 1.2).astype(int)
        bags.append(X * 3 + 5)  # unstandardised features
        inst.append(h)
        y.append(int(h.max()))
    return bags, np.array(y), inst


@pytest.fixture(scope="module")
def data():
    return make_bags(60, seed=0), make_bags(40, seed=1)


def test_vi_fit_predict(data):
    """If this fails, the VI estimator does not learn (bag/instance AUC on held-out bags), returns
    malformed outputs, or the (uncalibrated) orthant bag probabilities carry no error estimate."""
    (tr, ytr, _), (te, yte, inst) = data
    # one fixed kernel, so that the bag rules below differ in the rule alone
    clf = ProbitMILClassifier(
        num_inducing=30, max_iter=40, num_qmc_points=256, bag_rule="orthant", calibrate=False,
        kernel="rbf", lengthscale=2.0, outputscale=1.0,
    ).fit(tr, ytr)
    proba = clf.predict_proba(te)
    assert proba.shape == (len(te), 2) and np.allclose(proba.sum(1), 1)
    assert roc_auc_score(yte, proba[:, 1]) > 0.85
    p_inst, s_inst = clf.predict_instance_proba(te, return_std=True)
    assert [len(p) for p in p_inst] == [len(b) for b in te]
    assert roc_auc_score(np.concatenate(inst), np.concatenate(p_inst)) > 0.85
    assert all(((s >= 0) & (s <= 0.5)).all() for s in s_inst)
    p, err = clf.predict_bag_proba(te)
    assert (err >= 0).all() and (err < 0.01).all()
    assert set(clf.predict(te)) <= {0, 1}
    elbo = np.array(clf.fit_result_.elbo)
    assert np.isfinite(elbo).all()
    # the other bag rules
    ind = clone(clf).set_params(bag_rule="noisy_or").fit(tr, ytr).predict_proba(te)[:, 1]
    assert ((ind >= 0) & (ind <= 1)).all() and roc_auc_score(yte, ind) > 0.85
    mx = clone(clf).set_params(bag_rule="max").fit(tr, ytr).predict_proba(te)[:, 1]
    assert (mx <= ind + 1e-9).all()  # the most probable instance never beats the noisy-OR


def test_gibbs_fit_predict(data):
    """If this fails, the Gibbs estimator does not run end to end, gives no diagnostics, or its
    predictions disagree grossly with VI at the same hyperparameters."""
    (tr, ytr, _), (te, yte, inst) = data
    kw = dict(num_inducing=30, max_iter=40, num_qmc_points=256)
    vi = ProbitMILClassifier(**kw).fit(tr, ytr)
    gb = ProbitMILClassifier(inference="gibbs", num_samples=300, burn_in=100, num_chains=2, **kw).fit(tr, ytr)
    assert set(gb.gibbs_summary_) >= {"max_rhat", "min_ess"}
    assert gb.instance_calibrator_ is None  # the draws predict the instances; a map fitted to VI fits would sit unused
    p_vi = np.concatenate(vi.predict_instance_proba(te))
    p_gb, s_gb = gb.predict_instance_proba(te, return_std=True)
    p_gb = np.concatenate(p_gb)
    assert np.abs(p_vi - p_gb).mean() < 0.05
    assert roc_auc_score(np.concatenate(inst), p_gb) > 0.85
    pb, se = gb.predict_bag_proba(te)
    assert ((pb >= 0) & (pb <= 1)).all() and (se >= 0).all()
    assert roc_auc_score(yte, pb) > 0.85


def test_too_short_gibbs_chains_raise_a_convergence_warning_at_the_callers_line(data):
    """If this failed, a Gibbs "reference" of 15 draws per chain, far from mixed, would be used for
    predictions without a word (``gibbs_summary_`` alone is easy to never look at)."""
    (tr, ytr, _), _ = data
    with pytest.warns(ConvergenceWarning, match=r"^the Gibbs chains have not converged: .*min ESS \d+ < 100 .*raise num_samples and burn_in$") as record:
        ProbitMILClassifier(inference="gibbs", num_samples=15, burn_in=0, num_chains=2, num_inducing=10, max_iter=10).fit(tr, ytr)
    assert [Path(w.filename).name for w in record if w.category is ConvergenceWarning] == [Path(__file__).name]


def test_a_pickled_gibbs_classifier_predicts_exactly_as_before(data):
    """A fitted model saved with pickle must predict the same after loading. The Gibbs estimator
    keeps its posterior draws and the orthant rule its quasi-Monte-Carlo points: state that lived
    outside the estimator, or a random stream not re-seeded from ``random_state``, would change
    the loaded model's bag probabilities."""
    (tr, ytr, _), (te, _, _) = data
    gb = ProbitMILClassifier(inference="gibbs", num_samples=60, burn_in=20, num_chains=1, num_inducing=10, max_iter=10).fit(tr, ytr)
    loaded = pickle.loads(pickle.dumps(gb))
    for a, b in zip(gb.predict_bag_proba(te), loaded.predict_bag_proba(te)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.concatenate(gb.predict_instance_proba(te)), np.concatenate(loaded.predict_instance_proba(te)))


def test_sklearn_contract_and_errors(data):
    """If this fails, the estimator breaks the scikit-learn contract (get_params/clone) or accepts
    invalid options/labels silently."""
    (tr, ytr, _), _ = data
    clf = ProbitMILClassifier(inference="gibbs", num_inducing=7)
    c2 = clone(clf)
    assert c2.get_params()["inference"] == "gibbs" and c2.get_params()["num_inducing"] == 7
    assert isinstance(clf, MILClassifierBase)  # shares its data handling with VGPMILClassifier
    with pytest.raises(ValueError, match="inference"):
        ProbitMILClassifier(inference="mcmc").fit(tr, ytr)
    with pytest.raises(ValueError, match="^bag_rule must be 'auto', one of .*'orthant'.* got 'median'$"):
        ProbitMILClassifier(bag_rule="median").fit(tr, ytr)
    with pytest.raises(ValueError):
        ProbitMILClassifier().fit(tr, np.full(len(tr), 2))


def test_vi_bag_predictions_group_bags_by_size(data, monkeypatch):
    """If this fails, VI orthant bag predictions pad every bag to the largest one (memory
    B·n_max², n_max integration steps per bag — one bag of 300 among 599 bags of 5 reached 2.6 GB)
    or the grouped computation changes the answer: each bag must get exactly what it gets when
    predicted alone, and agree with the one-shot padded computation within the QMC error."""
    from milgp.likelihoods.instance_link import ProbitLink
    from milgp.models.closed_form_strategy import ClosedFormStrategy
    from milgp.prediction import BagPosterior, OrthantRule, bag_posterior

    (tr, ytr, _), _ = data
    # one fixed kernel, so that the bag rules below differ in the rule alone
    clf = ProbitMILClassifier(
        num_inducing=30, max_iter=40, num_qmc_points=256, bag_rule="orthant", calibrate=False,
        kernel="rbf", lengthscale=2.0, outputscale=1.0,
    ).fit(tr, ytr)
    rng = np.random.default_rng(7)
    sizes = [1, 3, 5, 5, 40, 2, 12, 5, 90, 4, 1, 7]
    bags = [rng.normal(size=(k, 3)) * 3 + 5 + (rng.random() < 0.5) * np.array([3.6, 0, 0]) for k in sizes]

    shapes = []
    orig = ClosedFormStrategy.bag_covariances

    def spy(self, x, bags, q=None):
        out = orig(self, x, bags, q)
        shapes.append(tuple(out[1].shape))
        return out

    monkeypatch.setattr(ClosedFormStrategy, "bag_covariances", spy)
    p_all, se_all = clf.predict_bag_proba(bags)
    assert max(b * n * n for b, n, _ in shapes) <= max(bag_posterior.BLOCK_BUDGET, 90 * 90)
    # a tight budget: several groups, the small bags together and not padded to the bag of 90;
    # the answers do not move
    monkeypatch.setattr(bag_posterior, "BLOCK_BUDGET", 2000)
    shapes.clear()
    p_small, se_small = clf.predict_bag_proba(bags)
    assert len(shapes) > 2 and all(b * n * n <= 2000 or b == 1 for b, n, _ in shapes)
    assert any(b > 1 and n < 90 for b, n, _ in shapes) and sum(b for b, _, _ in shapes) == len(bags)
    np.testing.assert_allclose(p_small, p_all, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(se_small, se_all, rtol=1e-8, atol=1e-13)
    # per-bag computation
    for b, bag in enumerate(bags):
        p_b, se_b = clf.predict_bag_proba([bag])
        np.testing.assert_allclose(p_b[0], p_all[b], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(se_b[0], se_all[b], rtol=1e-8, atol=1e-13)
    # the one-shot padded computation (every bag padded to 90): same probabilities within QMC error
    monkeypatch.setattr(ClosedFormStrategy, "bag_covariances", orig)
    x, bag_index = clf._to_tensor(bags)
    with torch.no_grad():
        mp_, cp, mk = clf.model_.variational_strategy.bag_covariances(x, Bags(bag_index, len(bags)))
        p_pad, se_pad = OrthantRule(num_points=256, seed=1)(BagPosterior.from_blocks(mp_, cp, mk), ProbitLink())
    tol = 4 * np.sqrt(se_pad.numpy() ** 2 + se_all**2) + 1e-9
    assert (np.abs(p_pad.numpy() - p_all) <= tol).all()
    assert ((p_all > 0.05) & (p_all < 0.95)).any()  # not only trivial bags


def test_a_ten_thousand_instance_bag_is_predicted_without_joint_blocks(data, monkeypatch):
    """If this fails, predicting one 10,000-instance bag builds its 10⁴×10⁴ within-bag covariance
    again (7 GB and minutes before): the default bag rule reads marginals only, and the orthant
    rule refuses such a bag with a message naming it instead of factorising it."""
    from milgp.models.closed_form_strategy import ClosedFormStrategy

    (tr, ytr, _), _ = data
    clf = ProbitMILClassifier(num_inducing=20, max_iter=15, search_iter=5).fit(tr, ytr)
    rng = np.random.default_rng(3)
    huge = rng.normal(size=(10_000, 3)) * 3 + 5

    def no_blocks(*args, **kwargs):
        raise AssertionError("a joint block was built")

    monkeypatch.setattr(ClosedFormStrategy, "bag_covariances", no_blocks)
    p, s = clf.predict_bag_proba([huge, tr[0]])
    assert p.shape == (2,) and np.isfinite(p).all() and (s >= 0).all()
    monkeypatch.undo()
    orthant = ProbitMILClassifier(num_inducing=20, max_iter=15, bag_rule="orthant", calibrate=False, kernel="rbf", lengthscale=2.0, outputscale=1.0).fit(tr, ytr)
    with pytest.raises(ValueError, match="bag 0 has 10000 instances"):
        orthant.predict_proba([huge])


def test_single_instance_candidates_beside_the_mil_model(data):
    """``single_instance="auto"`` (the default) must fit the MIL probit model at every candidate
    kernel and single-instance learning at the most flexible ones (the largest variance: RBF at √D
    and the linear kernel, the linear one with an intercept), as VGPMILClassifier's plan does;
    ``False`` and the Gibbs sampler keep to the MIL model, ``True`` fits single-instance learning
    alone, and ``True`` with the Gibbs sampler or an unknown value are refused. If this fails, the
    probit estimator's search is not the one documented."""
    from milgp.estimators.probit import PROBIT_KERNEL_GRID

    (tr, ytr, _), _ = data
    kw = dict(num_inducing=10, max_iter=4, search_iter=2)
    fits = [(s["likelihood"], s["kernel"], s["outputscale"]) for s in ProbitMILClassifier(**kw).fit(tr, ytr).search_]
    grid = [(kind, scale) for kind, _, scale in PROBIT_KERNEL_GRID]
    largest = max(scale for _, scale in grid)
    assert fits == [("mil", *k) for k in grid] + [("single", "rbf", largest), ("single", "affine", largest)]
    only_mil = ProbitMILClassifier(single_instance=False, **kw).fit(tr, ytr)
    assert [s["likelihood"] for s in only_mil.search_] == ["mil"] * len(grid)
    only_single = ProbitMILClassifier(single_instance=True, **kw).fit(tr, ytr)
    assert [(s["likelihood"], s["kernel"]) for s in only_single.search_] == [("single", "rbf"), ("single", "affine")]
    assert only_single.likelihood_.single_instance
    with pytest.raises(ValueError, match="no Gibbs sampler"):
        ProbitMILClassifier(single_instance=True, inference="gibbs", **kw).fit(tr, ytr)
    with pytest.raises(ValueError, match="single_instance must be"):
        ProbitMILClassifier(single_instance="yes", **kw).fit(tr, ytr)
