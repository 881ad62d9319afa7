"""VBAggRegressor and the Appendix-B baselines end to end on a small aggregate problem."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.sparse import csr_matrix
from sklearn.base import clone

from milgp.baselines import BagPixelRegressor, ConstantRateRegressor
from milgp.estimators import VBAggRegressor


def _poisson_problem(seed=0, n_bags=24, mean_size=15):
    """1-D covariate, rate ``λ(x) = exp(1 + sin 2x)``, bags of consecutive x (covariate-dependent
    bagging as in Law et al., *Variational learning on aggregate outputs with Gaussian processes*,
    NeurIPS 2018, §4.1) with random populations."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(mean_size // 2, mean_size * 3 // 2, n_bags)
    x = np.sort(rng.uniform(-3, 3, sizes.sum()))
    # interleave neighbouring bags a little so each bag spans a range of rates
    x = x.reshape(-1, 1)
    lam = np.exp(1 + np.sin(2 * x[:, 0]))
    pops = rng.uniform(0.5, 2.0, len(x))
    counts = rng.poisson(pops * lam)
    edges = np.cumsum(sizes)[:-1]
    bags = np.split(x, edges)
    weights = np.split(pops, edges)
    y = np.array([c.sum() for c in np.split(counts, edges)])
    return bags, y, weights, x, lam


@pytest.fixture(scope="module")
def fitted():
    bags, y, weights, x, lam = _poisson_problem()
    models = {
        link: VBAggRegressor("poisson", link, num_inducing=12, max_iter=40, random_state=0).fit(bags, y, weights)
        for link in ("exp", "square")
    }
    return models, bags, y, weights, x, lam


def test_vbagg_recovers_individual_rates_better_than_constant(fitted):
    """Disaggregation must beat the constant-within-bag baseline on individual rates (Law et al.,
    *Variational learning on aggregate outputs with Gaussian processes*, NeurIPS 2018, Fig. 1); if
    the within-bag structure were ignored (e.g. wrong bag index or weights) it would not. Both links
    must give a finite, increasing objective."""
    models, bags, y, weights, x, lam = fitted
    const = ConstantRateRegressor().fit(bags, y, weights)
    mse_const = np.mean((np.concatenate(const.predict_in_bags(bags)) - lam) ** 2)
    for link, est in models.items():
        mse = np.mean((est.predict(x) - lam) ** 2)
        assert mse < 0.6 * mse_const, (link, mse, mse_const)
        assert np.isfinite(est.elbo_) and est.fit_result_.elbo[-1] > est.fit_result_.elbo[0]


def test_predictions_shapes_quantiles_and_bag_moments(fitted):
    """Quantiles are ordered and bracket the mean sensibly; bag predictions reproduce the observed
    aggregates (they are what the model was fitted to) and carry positive variances."""
    models, bags, y, weights, x, lam = fitted
    for est in models.values():
        qs = est.predict_quantiles(x, [0.1, 0.5, 0.9])
        assert qs.shape == (len(x), 3) and (np.diff(qs, axis=1) > 0).all()
        assert est.predict_quantiles(x, 0.5).shape == (len(x),)
        out = est.predict_bags(bags, weights)
        assert set(out) == {"rate_mean", "rate_var", "y_mean", "y_var"}
        assert (out["rate_var"] > 0).all() and (out["y_var"] >= out["rate_var"]).all()
        assert np.corrcoef(out["y_mean"], y)[0, 1] > 0.9
        assert est.score(bags, y, weights) > 0.7
        with pytest.raises(ValueError, match="individual covariates"):
            est.predict(x[:, 0])
        with pytest.raises(ValueError, match=r"individual covariates, got shape \(0, 1\)"):
            est.predict(x[:0])
        for bad in (np.nan, [[0.1, 0.9]], 1.0):  # NaN came back as NaN quantiles; 2-D as a 3-D array
            with pytest.raises(ValueError, match="quantile levels must be a number or a 1-D array in"):
                est.predict_quantiles(x, bad)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(lengthscale=-1.0), "lengthscale must be a positive number or None"),
        (dict(lengthscale=float("nan")), "lengthscale must be a positive number or None"),
        (dict(outputscale=0), "outputscale must be a positive number or None"),
        (dict(likelihood="normal", link="identity", noise=0.0), "noise must be a positive number or None"),
        (dict(bags_per_batch=0), "bags_per_batch must be a positive integer or None"),
        (dict(random_state=1.5), "random_state must be an integer >= 0, a NumPy RandomState or Generator, or None"),
    ],
)
def test_bad_settings_are_refused_in_one_line(settings, message):
    """Each of these gave a GPyTorch constraint error, a Cholesky failure or Python's
    ``range() arg 3 must not be zero`` instead of naming the setting (the classifiers already named them)."""
    bags, y, weights, *_ = _poisson_problem(n_bags=12)
    with pytest.raises(ValueError, match=message):
        VBAggRegressor(**{"num_inducing": 4, "max_iter": 2, **settings}).fit(bags, y, weights)


def test_predict_latent_is_the_posterior_of_f_behind_the_rate(fitted):
    """``predict_latent`` returns q(f) at the instances: the rate ``predict`` reports must be its
    closed-form mean, E[exp f] = exp(m + v/2) for the exp link and E[f²] = m² + v for the square
    link; the median of ``predict_quantiles`` is exp m for the exp link and below the mean for the
    square link (a scaled non-central χ², skewed right). A latent taken from elsewhere (other
    inputs, the unstandardised features, the prior) would break these identities."""
    models, bags, y, weights, x, lam = fitted
    for link, est in models.items():
        mean, var = est.predict_latent(x)
        assert mean.shape == var.shape == (len(x),) and (var > 0).all()
        expected = np.exp(mean + var / 2) if link == "exp" else mean**2 + var
        np.testing.assert_allclose(est.predict(x), expected, rtol=1e-10)
        median = est.predict_quantiles(x, 0.5)
        if link == "exp":
            np.testing.assert_allclose(median, np.exp(mean), rtol=1e-8)
        else:
            assert (median <= mean**2 + var + 1e-9).all()
    with pytest.raises(ValueError, match="individual covariates"):
        models["exp"].predict_latent(x[:, 0])


def test_bags_given_to_the_instance_predictions_get_a_one_line_error_pointing_to_predict_bags(fitted):
    """The classifiers' ``predict`` takes bags, this regressor's takes instances. Bags of unequal
    length used to fail inside NumPy ("setting an array element with a sequence") and bags of equal
    length as a 3-D shape; both must name the mistake and the method meant for bags."""
    models, bags, y, weights, x, lam = fitted
    est = models["exp"]
    equal = [b[:3] for b in bags]
    for given in (bags, equal):
        with pytest.raises(ValueError, match="got a sequence of bags; bag aggregates: predict_bags"):
            est.predict(given)
    np.testing.assert_array_equal(est.predict(csr_matrix(x)), est.predict(x))


def test_bag_predictions_of_a_fit_on_populations_need_the_populations(fitted):
    """A fit on populations predicts a bag's count from its populations: called without them,
    ``predict_bags`` and ``score`` must refuse instead of counting every instance as a population of
    1 (the counts came out tens of times too small, silently)."""
    models, bags, y, weights, x, lam = fitted
    est = models["exp"]
    assert est.fitted_with_weights_
    for call in (lambda: est.predict_bags(bags), lambda: est.score(bags, y)):
        with pytest.raises(ValueError, match="fitted with populations"):
            call()
    unit = VBAggRegressor("poisson", "exp", num_inducing=6, max_iter=5, random_state=0).fit(bags, y, [np.ones(len(b)) for b in bags])
    assert not unit.fitted_with_weights_ and unit.predict_bags(bags)["y_mean"].shape == (len(bags),)
    # populations, like bags, may come as any iterable (a generator raised "no len()")
    np.testing.assert_array_equal(est.predict_bags(bags, (w for w in weights))["y_mean"], est.predict_bags(bags, weights)["y_mean"])


def test_scaling_every_population_by_one_factor_changes_no_prediction():
    """Populations of 1e9 (a country) or 1e12 must predict the same bag counts as the same bags at
    scale 1: the constant mean absorbs the factor. Its start had a rate floor of 1e-8, so at 1e9
    and 1e12 the fit began far from the pooled rate, did not converge, and predicted other counts
    (e.g. 5.7 / 20.3 where they were 12.7 / 3.3), and all-zero counts must still start finite."""
    rng = np.random.default_rng(0)
    bags = [rng.normal(size=(4, 2)) for _ in range(8)]
    w = [rng.uniform(50, 200, size=4) for _ in bags]
    y = np.array([rng.poisson((wi * np.exp(b[:, 0]) * 0.01).sum()) for b, wi in zip(bags, w)])
    predict = lambda scale: VBAggRegressor("poisson", "exp", num_inducing=5, random_state=0).fit(  # noqa: E731
        bags, y, [wi * scale for wi in w]).predict_bags(bags, [wi * scale for wi in w])["y_mean"]
    base = predict(1.0)
    for scale in (1e9, 1e12):
        np.testing.assert_allclose(predict(scale), base, rtol=1e-6)
    zero = VBAggRegressor("poisson", "exp", num_inducing=5, max_iter=5, random_state=0).fit(bags, np.zeros(8), w)
    assert np.isfinite(zero.predict_bags(bags, w)["y_mean"]).all()


def test_clone_and_params():
    """sklearn contract: clone gives an unfitted copy with the same parameters."""
    est = VBAggRegressor("normal", num_inducing=7, lr=0.1)
    c = clone(est)
    assert c.get_params() == est.get_params() and not hasattr(c, "model_")


def test_normal_model_learns_noise_and_function():
    """Normal aggregates (Law et al., *Variational learning on aggregate outputs with Gaussian
    processes*, NeurIPS 2018, Appendix A.3/H.2): the learned τ must be of the right order and the
    individual means recovered; the Gaussian quantiles must be calibrated-ish."""
    rng = np.random.default_rng(1)
    x = np.sort(rng.uniform(-2, 2, 400)).reshape(-1, 1)
    mu = np.sin(2 * x[:, 0])
    tau = 0.1
    sizes = rng.integers(5, 15, 60)
    sizes = sizes[np.cumsum(sizes) <= len(x)]
    x, mu = x[: sizes.sum()], mu[: sizes.sum()]
    edges = np.cumsum(sizes)[:-1]
    y = np.array([m.sum() + rng.normal(0, np.sqrt(tau * len(m))) for m in np.split(mu, edges)])
    est = VBAggRegressor("normal", num_inducing=15, max_iter=40, noise=1.0).fit(np.split(x, edges), y)
    assert 0.01 < est.likelihood_.noise.item() < 0.5
    assert np.mean((est.predict(x) - mu) ** 2) < 0.05
    q = est.predict_quantiles(x, [0.05, 0.95])
    assert np.mean((mu >= q[:, 0]) & (mu <= q[:, 1])) > 0.6


def _normal_problem(seed=1):
    """Normal aggregates of ``μ(x) = 2 + sin 2x`` over bags of consecutive x, with populations."""
    rng = np.random.default_rng(seed)
    x = np.sort(rng.uniform(-2, 2, 300)).reshape(-1, 1)
    sizes = rng.integers(4, 12, 40)
    sizes = sizes[np.cumsum(sizes) <= len(x)]
    x = x[: sizes.sum()]
    w = rng.uniform(0.5, 2.0, len(x))
    edges = np.cumsum(sizes)[:-1]
    mu = 2 + np.sin(2 * x[:, 0])
    y = np.array([(wi * m).sum() + rng.normal(0, np.sqrt(0.05 * (wi**2).sum())) for wi, m in zip(np.split(w, edges), np.split(mu, edges))])
    return np.split(x, edges), y, np.split(w, edges), x


@pytest.mark.parametrize("c", [1e-3, 1e3])
def test_normal_model_predicts_in_the_targets_units(c):
    """Multiplying the Normal model's targets by ``c`` must multiply every prediction by ``c`` (and
    variances, the kernel variance and τ by ``c²``): the unit of ``y`` is the user's choice. With a
    fixed initial noise of 1 and kernel variances 0.3–10, targets in thousandths of their unit
    fitted a bag R² far below the same data in its unit (digits counts of 9s: 0.47 against −5.5
    for hundredths), and in thousands chose the largest variance offered."""
    bags, y, w, x = _normal_problem()
    kw = dict(likelihood="normal", num_inducing=10, max_iter=15, random_state=0)
    a = VBAggRegressor(**kw).fit(bags, y, w)
    b = VBAggRegressor(**kw).fit(bags, c * y, w)
    np.testing.assert_allclose(b.predict(x), c * a.predict(x), rtol=1e-6)
    assert b.target_scale_ == pytest.approx(c * a.target_scale_, rel=1e-12)
    pa, pb = a.predict_bags(bags, w), b.predict_bags(bags, w)
    np.testing.assert_allclose(pb["y_mean"], c * pa["y_mean"], rtol=1e-6)
    np.testing.assert_allclose(pb["y_var"], c**2 * pa["y_var"], rtol=1e-5)
    assert b.likelihood_.noise.item() == pytest.approx(c**2 * a.likelihood_.noise.item(), rel=1e-5)
    assert float(b.model_.covar_module.outputscale) == pytest.approx(c**2 * float(a.model_.covar_module.outputscale), rel=1e-9)
    assert b.elbo_ == pytest.approx(a.elbo_ - len(bags) * np.log(c), rel=1e-6)
    assert b.score(bags, c * y, w) == pytest.approx(a.score(bags, y, w), abs=1e-6) and a.score(bags, y, w) > 0.9
    # the same candidates in the new units, each bag's density lower by log c
    np.testing.assert_allclose(np.array(sorted(b.search_)), c**2 * np.array(sorted(a.search_)), rtol=1e-9)
    np.testing.assert_allclose([b.search_[k] for k in sorted(b.search_)], [a.search_[k] + np.log(c) for k in sorted(a.search_)], rtol=1e-6)


def test_normal_model_is_a_gpytorch_model_in_the_targets_units():
    """The fitted ``model_`` is rescaled to the targets' units (kernel variance, jitter and mean):
    GPyTorch's own predictive mean of it must equal :meth:`VBAggRegressor.predict`, and its noise
    the τ it reports, or a user evaluating ``model_`` directly gets the internal scale."""
    import torch

    bags, y, w, x = _normal_problem(seed=2)
    est = VBAggRegressor(likelihood="normal", num_inducing=10, max_iter=10, random_state=0).fit(bags, 250.0 * y, w)
    assert est.target_scale_ > 10
    est.model_.eval()
    with torch.no_grad():
        mean = est.model_(est._transform(x)).mean.numpy()
    np.testing.assert_allclose(mean, est.predict(x), rtol=1e-9)
    # GPyTorch's float64 jitter (1e-6) relative to the fit's scale
    assert est.model_.variational_strategy.jitter_val == pytest.approx(1e-6 * est.target_scale_**2, rel=1e-12)


def test_target_scale():
    """``target_scale`` is the spread per unit weight ``sqrt(Σ(y_a − W_a ȳ)² / Σ W2_a)`` (against a
    direct loop), scales with ``|c|``, ignores a common factor of ``y`` and the weights' pooled rate,
    and falls back to ``|ȳ|`` then 1 without spread."""
    from milgp.estimators.vbagg import target_scale

    rng = np.random.default_rng(0)
    w = [rng.uniform(0.5, 2, n) for n in (3, 5, 2, 7)]
    y = rng.normal(5, 2, 4)
    rate = y.sum() / sum(wi.sum() for wi in w)
    expected = np.sqrt(sum((ya - wi.sum() * rate) ** 2 for ya, wi in zip(y, w)) / sum((wi**2).sum() for wi in w))
    assert target_scale(y, w) == pytest.approx(expected, rel=1e-12)
    assert target_scale(-3 * y, w) == pytest.approx(3 * expected, rel=1e-12)
    proportional = np.array([2.5 * wi.sum() for wi in w])
    assert target_scale(proportional, w) == pytest.approx(2.5)
    assert target_scale(np.zeros(4), w) == 1.0


def test_baselines_bag_pixel_and_constant():
    """bag-pixel (Appendix B) is a VBAgg model on one weighted-mean pseudo-individual per bag; the
    constant baseline returns y_a/p_a inside bags and the pooled rate elsewhere."""
    bags, y, weights, x, lam = _poisson_problem(seed=2, n_bags=16)
    xbar, pops = BagPixelRegressor.pseudo_individuals(bags, weights)
    np.testing.assert_allclose(pops, [w.sum() for w in weights])
    np.testing.assert_allclose(xbar[0], (weights[0][:, None] * bags[0]).sum(0) / weights[0].sum())
    bp = BagPixelRegressor(num_inducing=8, max_iter=15).fit(bags, y, weights)
    assert bp.predict(x).shape == (len(x),) and np.isfinite(bp.predict(x)).all()
    const = ConstantRateRegressor().fit(bags, y, weights)
    np.testing.assert_allclose(const.predict_in_bags(bags)[3], y[3] / weights[3].sum())
    np.testing.assert_allclose(const.predict(x[:5]), y.sum() / sum(w.sum() for w in weights))


def test_constant_mean_is_optional_and_helps_far_from_zero():
    """``constant_mean=False`` must give a zero-mean GP (the zero-mean model of Law et al. 2018)
    that still fits; with the learned constant mean the log-rate offset of 1 is absorbed by the
    mean, so the objective must be at least as good. If the flag were ignored both fits would be
    identical."""
    import gpytorch

    bags, y, weights, x, lam = _poisson_problem(seed=2)
    kw = dict(num_inducing=10, max_iter=25, warmup_iter=5, random_state=0)
    zero = VBAggRegressor("poisson", "exp", constant_mean=False, **kw).fit(bags, y, weights)
    const = VBAggRegressor("poisson", "exp", **kw).fit(bags, y, weights)
    assert isinstance(zero.model_.mean_module, gpytorch.means.ZeroMean)
    assert isinstance(const.model_.mean_module, gpytorch.means.ConstantMean)
    assert np.isfinite(zero.predict(x)).all()
    assert const.elbo_ >= zero.elbo_ - 1e-6 * abs(zero.elbo_)
