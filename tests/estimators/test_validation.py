"""Estimator input checks and feature standardisation."""
import warnings

import numpy as np
import pytest
import torch
from scipy.sparse import csr_matrix

from milgp.estimators import VGPMILClassifier, check_bags, check_binary_bag_labels
from milgp.estimators._validation import FeatureScaler


def test_check_helpers_directly():
    """check_bags converts to float64 arrays; check_binary_bag_labels accepts bools/ints."""
    out = check_bags([[[1, 2]], np.ones((2, 2))])
    assert [a.dtype for a in out] == [np.float64, np.float64]
    assert check_binary_bag_labels(np.array([True, False]), 2).tolist() == [1.0, 0.0]
    assert check_binary_bag_labels([1, 1], 2, require_both=False).tolist() == [1.0, 1.0]


def test_sparse_bags_are_the_same_fit_as_their_dense_arrays():
    """Bags given as SciPy sparse matrices (word counts, as web_recommendation_1) must fit and
    predict exactly as their dense arrays; before, check_bags failed with NumPy's 'setting an array
    element with a sequence'."""
    rng = np.random.default_rng(0)
    bags = [np.where(rng.random((5, 30)) < 0.1, rng.integers(1, 4, (5, 30)), 0).astype(float) for _ in range(12)]
    y = np.arange(12) % 2
    for b, label in zip(bags, y):
        b[0, 0] += 3 * label
    dense = VGPMILClassifier(num_inducing=10).fit(bags, y)
    sparse = VGPMILClassifier(num_inducing=10).fit([csr_matrix(b) for b in bags], y)
    np.testing.assert_array_equal(sparse.predict_proba([csr_matrix(b) for b in bags]), dense.predict_proba(bags))


def test_constant_features_warn_and_are_ignored():
    """Constant training features must be reported in one warning (naming the first) and
    standardise to 0 whatever value they take later; all-constant features say that only the base
    rate can be learned."""
    flat = np.c_[np.arange(6.0), np.full(6, 3.0), np.full(6, -2.0)]
    with pytest.warns(UserWarning, match=r"2 of 3 features are constant .*feature 1.*ignored"):
        sc = FeatureScaler().fit(flat)
    z = sc.transform(torch.as_tensor(flat))
    assert torch.isfinite(z).all() and (z[:, 1:] == 0).all()
    assert (sc.transform(torch.tensor([[2.5, 400.0, -1e9]], dtype=torch.float64))[0, 1:] == 0).all()
    with pytest.warns(UserWarning, match="only the base rate"):
        FeatureScaler().fit(np.ones((4, 2)))


def test_a_prediction_that_would_overflow_is_refused_naming_the_bag():
    """A value whose standardised square overflows (1e155 where training saw values near 0) must
    give a one-line error naming the bag and instance, as fit does for such features, not a NaN
    probability (the linear kernel's variance became inf − inf)."""
    from milgp.estimators import ProbitMILClassifier, VBAggRegressor

    rng = np.random.default_rng(0)
    bags = [rng.normal(size=(4, 3)) for _ in range(8)]
    y = np.array([0, 1] * 4)
    test = [b.copy() for b in bags[:3]]
    test[1][2, 0] = 1e155
    for clf in (VGPMILClassifier(num_inducing=4, max_iter=3, search_iter=2), ProbitMILClassifier(num_inducing=4, max_iter=3, search_iter=2)):
        clf.fit(bags, y)
        with pytest.raises(ValueError, match=r"bags\[1\] instance 2: .*overflow float64"):
            clf.predict_proba(test)
    reg = VBAggRegressor(num_inducing=4, max_iter=3).fit(bags, np.arange(8.0) + 1)
    with pytest.raises(ValueError, match=r"bags\[1\] instance 2: .*overflow"):
        reg.predict_bags(test)
    with pytest.raises(ValueError, match=r"instance 6: .*overflow"):
        reg.predict(np.concatenate(test))


def test_overflowing_features_are_refused_naming_the_feature():
    """Features of scale 1e154 overflow the variance: the fit must refuse them with a message
    naming the feature, not standardise them into zeros or NaN."""
    rng = np.random.default_rng(0)
    bags = [np.c_[rng.normal(size=(3, 1)), 1e154 * rng.normal(size=(3, 1))] for _ in range(6)]
    with pytest.raises(ValueError, match="feature 1 cannot be standardised"):
        VGPMILClassifier(num_inducing=4, max_iter=3, search_iter=2).fit(bags, np.array([0, 1] * 3))


def test_all_constant_features_do_not_call_every_bag_positive():
    """All-constant features: the estimator warns, and its calibrated bag probabilities sit at the
    training base rate instead of near 1 for every bag (the old noisy-OR gave 0.95–1)."""
    bags = [np.ones((int(n), 3)) for n in (3, 5, 2, 6, 4, 3, 5, 2)]
    y = np.array([0, 0, 0, 0, 0, 0, 1, 1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clf = VGPMILClassifier(num_inducing=4, max_iter=5, search_iter=2).fit(bags, y)
    assert any("constant" in str(w.message) for w in caught)
    p = clf.predict_proba(bags)[:, 1]
    assert (p < 0.5).all() and np.allclose(p, p[0], atol=0.05)


def test_fitting_and_predicting_leave_the_global_rng_alone():
    """``random_state`` seeds the estimators' own generators only. If this fails, fitting a model
    reseeds (or draws from) the user's global torch RNG, so code around it that relies on its own
    seeding silently changes its random numbers."""
    from milgp.estimators import ProbitMILClassifier, VBAggRegressor

    rng = np.random.default_rng(0)
    bags = [rng.normal(size=(k, 2)) for k in (2, 3, 4, 2, 3, 4)]
    y_bin, y_count = np.array([0, 1] * 3), np.array([1.0, 2.0, 0.0, 3.0, 1.0, 2.0])
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    for est, y in (
        (VGPMILClassifier(num_inducing=4, max_iter=3, search_iter=2, random_state=7), y_bin),
        (ProbitMILClassifier(num_inducing=4, max_iter=3, search_iter=2, random_state=7), y_bin),
        (VBAggRegressor(num_inducing=4, max_iter=3, random_state=7), y_count),
    ):
        est.fit(bags, y)
        est.predict_bags(bags) if isinstance(est, VBAggRegressor) else est.predict(bags)
        assert torch.equal(torch.get_rng_state(), before), type(est).__name__


def test_bag_labels_minus_one_one_and_booleans_are_the_same_fit():
    """Bag labels −1/+1 (as many MIL files write them) or booleans must fit the same model as 0/1
    and predict in the caller's labels; strings or a mix of 0 and −1 must be refused in one line
    naming the problem (not a numpy conversion error, not a silent relabelling)."""
    rng = np.random.default_rng(0)
    bags = [rng.normal(size=(4, 2)) + (2.0 if b % 2 else 0.0) * np.eye(4, 2)[0] for b in range(12)]
    y01 = np.array([b % 2 for b in range(12)])
    kw = dict(num_inducing=6, max_iter=4, search_iter=2)
    p01 = VGPMILClassifier(**kw).fit(bags, y01).predict_proba(bags)
    for y in (2 * y01 - 1, y01.astype(bool)):
        est = VGPMILClassifier(**kw).fit(bags, y)
        np.testing.assert_array_equal(est.predict_proba(bags), p01)
        assert est.classes_.tolist() == sorted(set(y.tolist()))
        assert set(est.predict(bags).tolist()) <= set(y.tolist())
    with pytest.raises(ValueError, match="must be 0/1, -1/1 or booleans.*'neg'"):
        check_binary_bag_labels(np.array(["neg", "pos"]), 2)
    with pytest.raises(ValueError, match="bag 1 has label 0 and bag 0 label -1"):
        check_binary_bag_labels([-1, 0, 1], 3)
    with pytest.raises(ValueError, match="bag 2 has label 2"):
        check_binary_bag_labels([0, 1, 2], 3)
    with pytest.raises(ValueError, match="only bags of class -1"):
        check_binary_bag_labels([-1, -1], 2)


def test_settings_are_keyword_only():
    """The classifiers' settings are keyword-only: their order is not part of the interface (the shared ones
    are declared once, in the base), so a positional value must be refused, not given to another setting."""
    from milgp.estimators import ProbitMILClassifier

    for cls in (VGPMILClassifier, ProbitMILClassifier):
        with pytest.raises(TypeError):
            cls("gamma")
    assert VGPMILClassifier(psi="gamma").get_params()["psi"] == "gamma"


def _small_problem(seed: int = 0, offset: float = 0.0):
    rng = np.random.default_rng(seed)
    bags = [rng.normal(size=(4, 3)) + offset for _ in range(12)]
    y = np.arange(12) % 2
    for b, label in zip(bags, y):
        b[0, 0] += 2.5 * label
    return bags, y


FAST = dict(num_inducing=6, max_iter=4, search_iter=2)


def test_numpy_scalars_and_none_are_settings_like_python_numbers():
    """Settings from NumPy grids (``np.arange``, ``np.array([True, False])``) must mean what the
    Python values mean: ``random_state=np.int64(1)`` raised a torch TypeError, ``outputscale=np.int64(2)``
    was refused as not a number, and ``ProbitMILClassifier(single_instance=np.True_)`` silently fitted
    the MIL model alone (the choice of ``False``). ``random_state=None`` draws a fresh seed (kept in
    ``seed_``) without touching the global random states; ``1`` for ``single_instance`` and a negative
    seed are refused in one line."""
    from milgp.estimators import ProbitMILClassifier

    bags, y = _small_problem()

    def proba(est):
        return est.fit(bags, y).predict_proba(bags)

    np.testing.assert_array_equal(proba(VGPMILClassifier(**FAST, random_state=np.int64(1))), proba(VGPMILClassifier(**FAST, random_state=1)))
    np.testing.assert_array_equal(proba(VGPMILClassifier(**FAST, outputscale=np.int64(2), lengthscale=np.float32(1.5))),
                                  proba(VGPMILClassifier(**FAST, outputscale=2.0, lengthscale=float(np.float32(1.5)))))
    single = ProbitMILClassifier(**FAST, single_instance=np.True_).fit(bags, y)
    assert [s["likelihood"] for s in single.search_] == [s["likelihood"] for s in ProbitMILClassifier(**FAST, single_instance=True).fit(bags, y).search_]
    assert {s["likelihood"] for s in single.search_} == {"single"}
    with pytest.raises(ValueError, match="single_instance must be 'auto', True or False, got 1"):
        ProbitMILClassifier(**FAST, single_instance=1).fit(bags, y)
    state = torch.get_rng_state(), np.random.get_state()[1].copy()
    fresh = VGPMILClassifier(**FAST, random_state=None).fit(bags, y)
    assert isinstance(fresh.seed_, int) and torch.equal(torch.get_rng_state(), state[0]) and (np.random.get_state()[1] == state[1]).all()
    with pytest.raises(ValueError, match="random_state must be an integer >= 0, a NumPy RandomState or Generator, or None, got -1"):
        VGPMILClassifier(**FAST, random_state=-1).fit(bags, y)
    # a NumPy RandomState / Generator (scikit-learn's convention) gives the seed drawn from it: the
    # same object state gives the same fit, the object advances, the global states do not move
    for make in (np.random.RandomState, np.random.default_rng):
        first = VGPMILClassifier(**FAST, random_state=make(3)).fit(bags, y)
        assert first.seed_ == VGPMILClassifier(**FAST, random_state=make(3)).fit(bags, y).seed_
        rng = make(3)
        seeds = [VGPMILClassifier(**FAST, random_state=rng).fit(bags, y).seed_ for _ in range(2)]
        assert seeds[0] == first.seed_ != seeds[1]
    assert torch.equal(torch.get_rng_state(), state[0]) and (np.random.get_state()[1] == state[1]).all()
    with pytest.raises(ValueError, match="outputscale must be a positive number or None"):
        VGPMILClassifier(**FAST, outputscale=np.float64("nan")).fit(bags, y)


def test_float32_models_standardise_in_float64():
    """A common offset (positions, timestamps: 1e5 on features of spread 1, where float32 resolves
    0.008) must cancel before the features are rounded to float32; cast first, the float32 model's
    probabilities moved by up to 0.04 (0.001 here)."""
    bags, y = _small_problem()
    shifted, _ = _small_problem(offset=1e5)
    plain = VGPMILClassifier(**FAST, dtype="float32").fit(bags, y).predict_proba(bags)
    moved = VGPMILClassifier(**FAST, dtype="float32").fit(shifted, y).predict_proba(shifted)
    np.testing.assert_allclose(moved, plain, rtol=0, atol=1e-5)


def test_bags_that_are_not_numbers_get_a_one_line_error_naming_the_bag():
    """Strings in a bag, a bag without features and tensors that require gradients: a one-line error
    naming the bag, or (for the tensors and a generator of bags) the same fit as the arrays; before,
    NumPy's and torch's own errors without the bag."""
    bags, y = _small_problem()
    with pytest.raises(ValueError, match=r"bags\[1\] is not an array of numbers"):
        check_bags([bags[0], [["a", "b", "c"]]])
    with pytest.raises(ValueError, match=r"bags\[0\] has no features"):
        check_bags([np.ones((3, 0))])
    tensors = [torch.as_tensor(b).requires_grad_(True) for b in bags]
    np.testing.assert_array_equal(check_bags(tensors)[3], bags[3])
    np.testing.assert_array_equal(check_bags(b for b in bags)[5], bags[5])


@pytest.mark.parametrize(
    "setting, message",
    [
        (dict(calibrate="no"), "calibrate must be True or False, got 'no'"),
        (dict(average="false"), "average must be True or False, got 'false'"),
        (dict(standardize=0), "standardize must be True or False, got 0"),
        (dict(num_inducing=20.0), r"num_inducing must be an integer >= 1, got 20\.0"),
        (dict(max_iter=-1), "max_iter must be an integer >= 1, got -1"),
        (dict(max_iter=2.5), r"max_iter must be an integer >= 1, got 2\.5"),
        (dict(search_iter=0), "search_iter must be an integer >= 1, got 0"),
        (dict(tol=-1.0), r"tol must be a finite number >= 0, got -1\.0"),
        (dict(device="tpu"), "device must be a torch device such as 'cpu' or 'cuda', got 'tpu'"),
        (dict(H=float("inf")), "H must be a finite number > 1"),
    ],
)
def test_settings_out_of_range_are_one_line_errors_naming_them(setting, message):
    """``calibrate="no"`` and ``average="false"`` were taken as True (the defaults' predictions, no
    word), ``max_iter=-1`` ran one sweep, ``max_iter=2.5`` and ``device="tpu"`` were tracebacks from
    deep in the fit, and ``H=inf`` failed with a FloatingPointError advising a lower learning rate."""
    bags, y = _small_problem()
    with pytest.raises(ValueError, match=message):
        VGPMILClassifier(**{**FAST, **setting}).fit(bags, y)


def test_one_inducing_point_is_a_fit():
    """``num_inducing=1`` gave the negative bags' group 0 points, which k-means++ refused."""
    bags, y = _small_problem()
    proba = VGPMILClassifier(**{**FAST, "num_inducing": 1}).fit(bags, y).predict_proba(bags)
    assert proba.shape == (len(bags), 2) and np.isfinite(proba).all()


def test_vbagg_settings_are_checked_like_the_classifiers():
    from milgp.estimators import VBAggRegressor

    bags, y = _small_problem()
    with pytest.raises(ValueError, match="constant_mean must be True or False, got 'no'"):
        VBAggRegressor(constant_mean="no").fit(bags, y.astype(float))
    with pytest.raises(ValueError, match="warmup_iter must be an integer >= 0, got -2"):
        VBAggRegressor(warmup_iter=-2).fit(bags, y.astype(float))


def test_bags_with_negative_strides_are_ordinary_input():
    """``b[::-1]`` and ``np.flip`` are NumPy views with a negative stride, which torch refuses: they
    must fit and predict exactly as their copies (before: "bag 0 is not an array of instances:
    At least one stride ... is negative", and a raw torch error from ``VBAggRegressor.predict``)."""
    from milgp.estimators import VBAggRegressor

    bags, y = _small_problem()
    flipped = [b[::-1] for b in bags]
    clf = VGPMILClassifier(num_inducing=8).fit(flipped, y)
    copy = VGPMILClassifier(num_inducing=8).fit([b.copy() for b in flipped], y)
    np.testing.assert_array_equal(clf.predict_proba(flipped), copy.predict_proba([b.copy() for b in flipped]))
    reg = VBAggRegressor(num_inducing=8, max_iter=3).fit(flipped, np.full(12, 3.0))
    X = np.concatenate(bags)
    np.testing.assert_array_equal(reg.predict(X[::-1]), reg.predict(X[::-1].copy()))
    np.testing.assert_array_equal(reg.predict_bags([np.flip(b, 0) for b in bags])["y_mean"], reg.predict_bags(flipped)["y_mean"])


@pytest.mark.parametrize("as_matrix", [csr_matrix, torch.as_tensor])
def test_a_single_matrix_of_instances_is_not_taken_for_bags(as_matrix):
    """A 2-D sparse matrix (or tensor) of all instances is one matrix, not a sequence of bags: it must
    be refused like a 2-D NumPy array. Before, iterating a ``csr_matrix`` gave its rows, so it was
    fitted silently as one bag per instance."""
    bags, y = _small_problem()
    X = np.concatenate(bags)
    with pytest.raises(ValueError, match="not a single 2-D array"):
        VGPMILClassifier(num_inducing=8).fit(as_matrix(X), np.repeat(y, 4))


def test_fits_work_inside_torch_no_grad():
    """A fit called inside ``torch.no_grad()`` (e.g. from an evaluation loop) must equal the same fit
    outside it: the aggregate natural step and the hyperparameter steps take gradients (before:
    "element 0 of tensors does not require grad")."""
    from milgp.estimators import VBAggRegressor

    bags, y = _small_problem()
    counts = np.arange(12) % 4 + 1.0
    fits = []
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            reg = VBAggRegressor(num_inducing=8, max_iter=3).fit(bags, counts)
            clf = VGPMILClassifier(num_inducing=8, learn_hyperparameters=True, max_iter=5).fit(bags, y)
        fits.append((reg.predict(np.concatenate(bags)), clf.predict_proba(bags)))
    np.testing.assert_array_equal(fits[0][0], fits[1][0])
    np.testing.assert_array_equal(fits[0][1], fits[1][1])


def test_predictions_use_the_fitted_dtype_after_set_params():
    """``set_params(dtype=...)`` after a fit takes effect at the next fit (scikit-learn): predictions
    must stay those of the fitted model (before: torch's "expected m1 and m2 to have the same dtype")."""
    from milgp.estimators import VBAggRegressor

    bags, y = _small_problem()
    clf = VGPMILClassifier(num_inducing=8).fit(bags, y)
    reg = VBAggRegressor(num_inducing=8, max_iter=3).fit(bags, np.full(12, 3.0))
    before = clf.predict_proba(bags), reg.predict_bags(bags)["y_mean"]
    clf.set_params(dtype="float32")
    reg.set_params(dtype="float32")
    np.testing.assert_array_equal(clf.predict_proba(bags), before[0])
    np.testing.assert_array_equal(reg.predict_bags(bags)["y_mean"], before[1])


def test_complex_features_are_refused():
    """Complex features have no meaning for the kernels: refused naming the bag, as scikit-learn
    does. Before, NumPy dropped the imaginary part with only a ``ComplexWarning``."""
    with pytest.raises(ValueError, match=r"bags\[1\] has complex values"):
        check_bags([np.ones((2, 2)), np.ones((2, 2)) + 1j])
    with pytest.raises(ValueError, match=r"bags\[0\] has complex values"):
        check_bags([torch.ones(2, 2, dtype=torch.complex64)])


def test_a_refused_refit_leaves_the_earlier_fit_whole():
    """A re-fit refused for bad input (a NaN bag; populations of the wrong length) after
    ``set_params(dtype="float32")`` must leave the fitted estimator as it was. Before, ``fit`` set
    ``dtype_`` (and VBAgg's ``fitted_with_weights_``) before checking the input: the classifier's
    next ``predict_proba`` failed with torch's dtype mismatch, the regressor's predictions changed."""
    from milgp.estimators import VBAggRegressor, ProbitMILClassifier

    bags, y = _small_problem()
    bad = [b.copy() for b in bags]
    bad[3][0, 0] = np.nan
    for est in (VGPMILClassifier(num_inducing=8), ProbitMILClassifier(num_inducing=8)):
        before = est.fit(bags, y).predict_proba(bags)
        state = set(vars(est))
        est.set_params(dtype="float32")
        with pytest.raises(ValueError, match=r"bags\[3\] has NaN or inf"):
            est.fit(bad, y)
        assert est.dtype_ == torch.float64 and set(vars(est)) == state
        np.testing.assert_array_equal(est.predict_proba(bags), before)
    reg = VBAggRegressor(num_inducing=8, max_iter=3).fit(bags, np.full(12, 3.0))
    before = reg.predict_bags(bags)["y_mean"]
    reg.set_params(dtype="float32")
    with pytest.raises(ValueError, match="weights"):
        reg.fit(bags, np.full(12, 3.0), weights=[np.ones(len(b) + 1) for b in bags])
    assert reg.dtype_ == torch.float64 and not reg.fitted_with_weights_
    np.testing.assert_array_equal(reg.predict_bags(bags)["y_mean"], before)


def test_the_constant_feature_warning_points_at_the_callers_line():
    """The warning of constant features is about the user's data: it must name the line that called
    ``fit`` for every estimator. Before, a fixed stacklevel named milgp's own _mil_base.py for the
    classifiers (one frame deeper than VBAgg's)."""
    from pathlib import Path

    from milgp.estimators import VBAggRegressor

    bags, y = _small_problem()
    bags = [np.c_[b, np.full(len(b), 3.0)] for b in bags]
    for est, target in ((VGPMILClassifier(num_inducing=8), y), (VBAggRegressor(num_inducing=8, max_iter=2), np.full(12, 3.0))):
        with pytest.warns(UserWarning, match="constant in the training bags") as record:
            est.fit(bags, target)
        assert {Path(w.filename).name for w in record if "constant" in str(w.message)} == {Path(__file__).name}, type(est)
