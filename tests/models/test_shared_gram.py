"""Projections of several kernels from one Gram pass against each model's own projection, the
ensembles' shared predictive marginals against each model's own, and the affine kernel against
its formula."""
import pytest
import torch

from milgp.models.closed_form_strategy import WhitenedPosterior
from milgp.models.shared_gram import SharedGram
from milgp.models.sparse_gp import KERNELS, SparseGP


def _data():
    g = torch.Generator().manual_seed(3)
    Z = torch.randn(7, 4, generator=g, dtype=torch.float64)
    x = torch.randn(30, 4, generator=g, dtype=torch.float64)
    return Z, x


@pytest.mark.parametrize("kernel", KERNELS)
def test_shared_projection_equals_the_models_own(kernel: str):
    """If this failed, a kernel search would fit every candidate on another kernel's projection
    than the one its model predicts with (a linear or affine candidate scored as something else)."""
    Z, x = _data()
    model = SparseGP(Z, kernel=kernel, lengthscale=1.7, outputscale=3.0)
    L, proj = SharedGram(Z, x).projection(model)
    strategy = model.variational_strategy
    with torch.no_grad():
        L_ref = strategy.inducing_cholesky()
        ref = strategy.projection(x, L_ref)
    torch.testing.assert_close(L, L_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(proj.A, ref.A, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(proj.prior_var, ref.prior_var, rtol=1e-10, atol=1e-10)


def test_affine_kernel_is_the_linear_kernel_plus_an_intercept_of_the_same_scale():
    """``"affine"`` must be ``s² (xᵀx'/D + 1)``: a linear latent with an intercept of prior variance
    s², its scale learned (if at all) through the outputscale alone."""
    _, x = _data()
    model = SparseGP(x[:5], kernel="affine", outputscale=2.5)
    with torch.no_grad():
        K = model.covar_module(x).to_dense()
    torch.testing.assert_close(K, 2.5 * (x @ x.T / x.shape[1] + 1.0), rtol=1e-12, atol=1e-12)
    trainable = {n for n, p in model.covar_module.named_parameters() if p.requires_grad}
    assert trainable == {"raw_outputscale"}


def test_predict_marginals_shares_one_gram_per_chunk_and_equals_each_models_own(monkeypatch):
    """The estimators' ensembles predict through :func:`predict_marginals`. If it disagreed with a
    model's own predictive, the averaged bag probabilities would not be the fitted models'; if the
    models on the shared inducing points did not share one ``Z xᵀ`` per chunk, a prediction on wide
    features would cost one kernel pass per candidate (23× slower on web_recommendation_1). Models
    on other inducing points share theirs among themselves, in whatever order the models come (the
    estimators' linear candidates sit on a basis of their own); a model it cannot serve (a constant
    mean) takes its own path."""
    import milgp.models.shared_gram as shared_gram

    Z, x = _data()
    models = [SparseGP(Z + 0.5, kernel="rbf")]
    models += [SparseGP(Z, kernel=k, lengthscale=1.3, outputscale=2.0) for k in KERNELS]
    models.append(SparseGP(Z, kernel="rbf", constant_mean=True))
    models.append(SparseGP(Z + 0.5, kernel="linear", outputscale=3.0))
    g = torch.Generator().manual_seed(4)
    for m in models:  # a posterior other than the prior
        M = m.variational_strategy.num_inducing
        R = torch.randn(M, M, generator=g, dtype=torch.float64) / M
        q = WhitenedPosterior.from_natural(torch.randn(M, generator=g, dtype=torch.float64), torch.eye(M, dtype=torch.float64) + R @ R.T)
        m.variational_strategy.set_whitened_posterior(q)
    grams = []

    class CountingGram(SharedGram):
        def __init__(self, Z_: torch.Tensor, x_: torch.Tensor):
            grams.append(len(x_))
            super().__init__(Z_, x_)

    monkeypatch.setattr(shared_gram, "SharedGram", CountingGram)
    out = shared_gram.predict_marginals(models, x, chunk_size=12)
    assert grams == [12, 12, 6] * 2  # one pass per chunk for each of the two sets of points
    for m, (mean, var) in zip(models, out):
        ref_mean, ref_var = m.variational_strategy.predict_marginals(x)
        torch.testing.assert_close(mean, ref_mean, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(var, ref_var, rtol=1e-10, atol=1e-10)
