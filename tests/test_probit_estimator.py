"""``ProbitMILClassifier`` (VI and Gibbs) through the scikit-learn interface."""
import numpy as np
import pytest
import torch
from sklearn.base import clone
from sklearn.metrics import roc_auc_score

from milgp.estimators import ProbitMILClassifier, VGPMILClassifier


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny tensors: one intra-op thread avoids oversubscription on shared CI machines."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
    malformed outputs, or the orthant bag probabilities carry no error estimate."""
    (tr, ytr, _), (te, yte, inst) = data
    clf = ProbitMILClassifier(num_inducing=30, max_iter=40, warmup_iter=10, num_qmc_points=256).fit(tr, ytr)
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
    kw = dict(num_inducing=30, max_iter=40, warmup_iter=10, num_qmc_points=256)
    vi = ProbitMILClassifier(**kw).fit(tr, ytr)
    gb = ProbitMILClassifier(inference="gibbs", num_samples=300, burn_in=100, num_chains=2, **kw).fit(tr, ytr)
    assert set(gb.gibbs_summary_) >= {"max_rhat", "min_ess"}
    p_vi = np.concatenate(vi.predict_instance_proba(te))
    p_gb, s_gb = gb.predict_instance_proba(te, return_std=True)
    p_gb = np.concatenate(p_gb)
    assert np.abs(p_vi - p_gb).mean() < 0.05
    assert roc_auc_score(np.concatenate(inst), p_gb) > 0.85
    pb, se = gb.predict_bag_proba(te)
    assert ((pb >= 0) & (pb <= 1)).all() and (se >= 0).all()
    assert roc_auc_score(yte, pb) > 0.85


def test_sklearn_contract_and_errors(data):
    """If this fails, the estimator breaks the scikit-learn contract (get_params/clone) or accepts
    invalid options/labels silently."""
    (tr, ytr, _), _ = data
    clf = ProbitMILClassifier(inference="gibbs", num_inducing=7)
    c2 = clone(clf)
    assert c2.get_params()["inference"] == "gibbs" and c2.get_params()["num_inducing"] == 7
    assert isinstance(clf, VGPMILClassifier)  # shares its data handling
    with pytest.raises(ValueError, match="inference"):
        ProbitMILClassifier(inference="mcmc").fit(tr, ytr)
    with pytest.raises(ValueError, match="bag_rule"):
        ProbitMILClassifier(bag_rule="orthant").fit(tr, ytr)
    with pytest.raises(ValueError):
        ProbitMILClassifier().fit(tr, np.full(len(tr), 2))
