"""ClosedFormStrategy (in SparseGP and in a user's own ApproximateGP): the fast-path quantities equal GPyTorch's own
predictive distribution and an independent computation; q(v) is read and written faithfully."""
import gpytorch
import pytest
import torch

from milgp.data.bags import Bags, bag_index_from_sizes
from milgp.linalg import CholeskyError
from milgp.models.closed_form_strategy import ClosedFormStrategy, WhitenedPosterior
from milgp.models.sparse_gp import SparseGP


def fitted_like_model(natural=True, constant_mean=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    Z = torch.randn(7, 3, generator=g, dtype=torch.float64)
    model = SparseGP(Z, lengthscale=1.1, outputscale=1.8, natural=natural, constant_mean=constant_mean)
    if constant_mean:
        model.mean_module.constant.data.fill_(0.3)
    R = torch.randn(7, 7, generator=g, dtype=torch.float64)
    S = 0.3 * R @ R.mT + 0.2 * torch.eye(7, dtype=torch.float64)
    m = torch.randn(7, generator=g, dtype=torch.float64)
    model.variational_strategy.set_whitened_posterior(WhitenedPosterior(m=m, S=S, precision=torch.linalg.inv(S)))
    return model, g


@pytest.mark.parametrize("natural", [True, False])
@pytest.mark.parametrize("constant_mean", [False, True])
def test_marginals_equal_gpytorch_predictive(natural, constant_mean):
    """predict_marginals must equal GPyTorch's q(f) mean and variance (same jitter, whitening,
    mean function) in eval and train mode; otherwise the fast path optimises another model."""
    model, g = fitted_like_model(natural, constant_mean)
    x = torch.randn(15, 3, generator=g, dtype=torch.float64)
    mu, var = model.variational_strategy.predict_marginals(x)
    for mode in (model.eval, model.train):
        mode()
        with torch.no_grad():
            out = model(x)
        torch.testing.assert_close(mu, out.mean, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(var, out.variance, rtol=1e-9, atol=1e-10)


def test_whitened_posterior_round_trip_both_parameterisations():
    """Writing q(v) and reading it back must be the identity for natural and Cholesky storage."""
    for natural in (True, False):
        model, _ = fitted_like_model(natural)
        q = model.variational_strategy.whitened_posterior()
        model.variational_strategy.set_whitened_posterior(q)
        q2 = model.variational_strategy.whitened_posterior()
        torch.testing.assert_close(q2.m, q.m)
        torch.testing.assert_close(q2.S, q.S)
        torch.testing.assert_close(q.precision @ q.S, torch.eye(7, dtype=torch.float64), atol=1e-9, rtol=0)


def test_kl_divergence_matches_torch_distributions():
    """KL(N(m,S) ‖ N(0,I)) must match torch.distributions and GPyTorch's strategy KL."""
    model, _ = fitted_like_model()
    q = model.variational_strategy.whitened_posterior()
    ref = torch.distributions.kl_divergence(
        torch.distributions.MultivariateNormal(q.m, q.S),
        torch.distributions.MultivariateNormal(torch.zeros(7, dtype=torch.float64), torch.eye(7, dtype=torch.float64)),
    )
    assert q.kl_divergence().item() == pytest.approx(ref.item(), rel=1e-10)
    assert model.variational_strategy.kl_divergence().item() == pytest.approx(ref.item(), rel=1e-8)


def test_bag_covariances_equal_gpytorch_full_covariance_blocks():
    """Per-bag blocks must equal the corresponding blocks of GPyTorch's full predictive
    covariance (eval mode); padded rows/columns are the identity, padded means 0, mask right."""
    model, g = fitted_like_model(constant_mean=True)
    sizes = [3, 1, 4, 2]
    bag_index = bag_index_from_sizes(sizes)[torch.randperm(10, generator=g)]  # interleaved bags
    x = torch.randn(10, 3, generator=g, dtype=torch.float64)
    mean_pad, cov_pad, mask = model.variational_strategy.bag_covariances(x, Bags(bag_index, 4))
    model.eval()
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        out = model(x)
        full_mean, full_cov = out.mean, out.covariance_matrix
    assert mask.shape == (4, 4) and mask.sum(1).tolist() == sizes
    for b in range(4):
        idx = torch.nonzero(bag_index == b, as_tuple=True)[0]  # instances keep their order
        k = len(idx)
        torch.testing.assert_close(mean_pad[b, :k], full_mean[idx], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(cov_pad[b, :k, :k], full_cov[idx][:, idx], rtol=1e-8, atol=1e-9)
        assert (mean_pad[b, k:] == 0).all()
        pad = cov_pad[b, k:, k:]
        torch.testing.assert_close(pad, torch.eye(4 - k, dtype=torch.float64))
        assert (cov_pad[b, :k, k:] == 0).all() and (cov_pad[b, k:, :k] == 0).all()
        assert mask[b, :k].all() and not mask[b, k:].any()


def test_nan_kernel_raises_cholesky_error():
    """A NaN kernel hyperparameter must surface as CholeskyError naming K_zz, not as a silent NaN
    posterior or a bare torch error."""
    model, g = fitted_like_model()
    model.covar_module.raw_outputscale.data.fill_(float("nan"))
    with pytest.raises(CholeskyError, match="K_zz"):
        model.variational_strategy.inducing_cholesky()


def test_duplicated_inducing_points_need_only_jitter():
    """Duplicated inducing points make K_zz singular; robust_cholesky must escalate the jitter
    and still factorise it (a finite L)."""
    Z = torch.zeros(4, 2, dtype=torch.float64)
    model = SparseGP(Z)
    L = model.variational_strategy.inducing_cholesky()
    assert torch.isfinite(L).all()


def test_hyperparameters_exclude_variational_parameters():
    """hyperparameters() is what Adam trains in Algorithm 1: it must not contain q(v)."""
    model, _ = fitted_like_model()
    var_ids = {id(p) for p in model.variational_parameters()}
    hyp = model.variational_strategy.hyperparameters()
    assert hyp and not any(id(p) in var_ids for p in hyp)


def test_marginals_triangular_solve_and_matrix_product_paths_agree():
    """The variance ``k − ‖A‖² + AᵀSA`` by triangular solves with the precision's Cholesky factor
    over blocks of instances (no gradient; a partial last block; either memory layout of ``A``;
    the factor given or computed) and by the general matrix product (with gradients) must equal
    an independent formula to 1e-12 in float64 and to 1e-5 in float32."""
    from milgp.models.closed_form_strategy import _MARGINAL_BLOCK, Projection, WhitenedPosterior

    g = torch.Generator().manual_seed(0)
    M, N = 7, 2 * _MARGINAL_BLOCK + 37
    AT = torch.randn(N, M, generator=g, dtype=torch.float64)
    X = torch.randn(M, M, generator=g, dtype=torch.float64)
    S = X @ X.mT / M + 0.1 * torch.eye(M, dtype=torch.float64)
    m = torch.randn(M, generator=g, dtype=torch.float64)
    prior_var = 1.0 + (AT * AT).sum(1)
    expected_var, expected_mean = 1.0 + (AT * (AT @ S)).sum(1), AT @ m
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        P = torch.linalg.inv(S).to(dtype)
        posteriors = (
            WhitenedPosterior(m=m.to(dtype), S=S.to(dtype), precision=P),
            WhitenedPosterior.from_natural(P @ m.to(dtype), P),  # carries its precision's factor
        )
        for q in posteriors:
            for A in (AT.to(dtype).mT, AT.to(dtype).mT.contiguous(), AT.to(dtype).mT.clone().requires_grad_(True)):
                proj = Projection(A=A, prior_var=prior_var.to(dtype), prior_mean=torch.zeros(N, dtype=dtype))
                mean, var = ClosedFormStrategy.marginals(proj, q)
                torch.testing.assert_close(var.detach().double(), expected_var, rtol=tol, atol=tol)
                torch.testing.assert_close(mean.detach().double(), expected_mean, rtol=tol, atol=tol)


class UserGP(gpytorch.models.ApproximateGP):
    """A user's own model: their kernel and mean, milgp's strategy in place of VariationalStrategy."""

    def __init__(self, Z: torch.Tensor, kernel: gpytorch.kernels.Kernel, natural: bool = True):
        dist = gpytorch.variational.NaturalVariationalDistribution if natural else gpytorch.variational.CholeskyVariationalDistribution
        super().__init__(ClosedFormStrategy(self, Z, dist(Z.shape[0])))
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = kernel

    def forward(self, x: torch.Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _matern_user_model(seed: int = 0) -> tuple[UserGP, torch.Tensor, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    Z = torch.randn(6, 2, generator=g, dtype=torch.float64)
    model = UserGP(Z, gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5))).to(torch.float64)
    model.covar_module.outputscale = 2.0
    model.covar_module.base_kernel.lengthscale = 0.7
    model.mean_module.constant.data.fill_(-0.4)
    return model, Z, g


def test_a_user_model_starts_at_the_whitened_prior_and_stays_there_under_gpytorch() -> None:
    """q(v) of a new ClosedFormStrategy must be N(0, I), and a GPyTorch call in train mode must not
    re-initialise it with noise (GPyTorch does that for a strategy it thinks uninitialised): the
    closed-form steps read q(v) from the distribution."""
    model, _, g = _matern_user_model()
    q = model.variational_strategy.whitened_posterior()
    assert (q.m == 0).all() and torch.equal(q.S, torch.eye(6, dtype=torch.float64))
    model.train()
    model(torch.randn(5, 2, generator=g, dtype=torch.float64))
    assert (model.variational_strategy.whitened_posterior().m == 0).all()


def test_a_user_model_projection_equals_an_independent_matern_computation() -> None:
    """The strategy builds ``A = L⁻¹K_zx``, the prior variance and mean from the user's ``forward``;
    they must equal the Matérn-3/2 formula written out here (float64), else the closed-form steps
    would fit another prior than the model's."""
    model, Z, g = _matern_user_model()
    x = torch.randn(9, 2, generator=g, dtype=torch.float64)

    def matern(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        r = torch.cdist(a, b) / 0.7
        return 2.0 * (1 + 3**0.5 * r) * torch.exp(-(3**0.5) * r)

    jitter = model.variational_strategy.jitter
    L = torch.linalg.cholesky(matern(Z, Z) + jitter * torch.eye(6, dtype=torch.float64))
    proj = model.variational_strategy.projection(x)
    # GPyTorch's distances (‖a‖² + ‖b‖² − 2aᵀb) and torch.cdist round differently, by ~1e-8 here
    torch.testing.assert_close(proj.A, torch.linalg.solve_triangular(L, matern(Z, x), upper=False), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(proj.prior_var, torch.full((9,), 2.0 + jitter, dtype=torch.float64))
    torch.testing.assert_close(proj.prior_mean, torch.full((9,), -0.4, dtype=torch.float64))


@pytest.mark.parametrize("natural", [True, False])
def test_a_user_model_fast_path_marginals_and_bag_blocks_equal_its_gpytorch_predictive(natural: bool) -> None:
    """For a user's kernel and mean, the strategy's marginals and per-bag blocks must equal what
    GPyTorch predicts with the same model (whitening, jitter and mean agree)."""
    model, _, g = _matern_user_model()
    if not natural:
        model = UserGP(model.variational_strategy.inducing_points, model.covar_module, natural=False).to(torch.float64)
    R = torch.randn(6, 6, generator=g, dtype=torch.float64)
    S = 0.2 * R @ R.mT + 0.3 * torch.eye(6, dtype=torch.float64)
    model.variational_strategy.set_whitened_posterior(
        WhitenedPosterior(m=torch.randn(6, generator=g, dtype=torch.float64), S=S, precision=torch.linalg.inv(S))
    )
    x = torch.randn(8, 2, generator=g, dtype=torch.float64)
    bag_index = torch.tensor([0, 1, 0, 2, 1, 0, 2, 2])
    mu, var = model.variational_strategy.predict_marginals(x)
    mean_pad, cov_pad, _ = model.variational_strategy.bag_covariances(x, Bags(bag_index, 3))
    model.eval()
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        out = model(x)
    torch.testing.assert_close(mu, out.mean, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(var, out.variance, rtol=1e-9, atol=1e-10)
    idx = torch.nonzero(bag_index == 2, as_tuple=True)[0]
    torch.testing.assert_close(cov_pad[2, :3, :3], out.covariance_matrix[idx][:, idx], rtol=1e-8, atol=1e-9)
    torch.testing.assert_close(mean_pad[2, :3], out.mean[idx], rtol=1e-9, atol=1e-10)


def test_a_model_without_the_closed_form_strategy_is_refused_by_name() -> None:
    """GPyTorch's own VariationalStrategy has no projections: the closed-form path must say which
    strategy it needs instead of failing on a missing attribute deep inside a sweep."""

    class PlainGP(gpytorch.models.ApproximateGP):
        def __init__(self, Z: torch.Tensor):
            dist = gpytorch.variational.NaturalVariationalDistribution(Z.shape[0])
            super().__init__(gpytorch.variational.VariationalStrategy(self, Z, dist))

    with pytest.raises(TypeError, match="ClosedFormStrategy.*VariationalStrategy on PlainGP"):
        ClosedFormStrategy.of(PlainGP(torch.zeros(3, 2)))


def test_learned_inducing_locations_are_hyperparameters() -> None:
    """With ``learn_inducing_locations=True`` the Adam steps of Algorithm 1 must move Z: it belongs to
    hyperparameters(), and q(v)'s parameters never do."""
    model = SparseGP(torch.randn(5, 2, dtype=torch.float64), learn_inducing_locations=True)
    hyp = {id(p) for p in model.variational_strategy.hyperparameters()}
    assert id(model.variational_strategy.inducing_points) in hyp
    assert not hyp & {id(p) for p in model.variational_strategy._variational_distribution.parameters()}


@pytest.mark.parametrize("natural", [True, False])
def test_the_strategys_natural_step_writes_the_step_it_returns(natural: bool) -> None:
    """``strategy.natural_step(stats, ρ)`` must equal the step of the q(v) it holds
    (``WhitenedPosterior.natural_step``) and leave exactly that q(v) in the variational
    distribution, for natural and Cholesky storage; otherwise the fast path and GPyTorch's
    predictions would disagree after a step."""
    from milgp.likelihoods import NaturalStatistics

    model, g = fitted_like_model(natural)
    R = torch.randn(7, 7, generator=g, dtype=torch.float64)
    stats = NaturalStatistics(h=torch.randn(7, generator=g, dtype=torch.float64), G=R @ R.mT / 7)
    before = model.variational_strategy.whitened_posterior()
    returned = model.variational_strategy.natural_step(stats, rho=0.4, scale=2.0)
    expected = before.natural_step(stats, rho=0.4, scale=2.0)
    stored = model.variational_strategy.whitened_posterior()
    for q in (returned, stored):
        torch.testing.assert_close(q.m, expected.m, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(q.S, expected.S, rtol=1e-10, atol=1e-12)
    # ρ = 0.4 mixes natural parameters: η₁ = 0.6 S⁻¹m + 0.4·2h, P = 0.6 S⁻¹ + 0.4 (I + 2G)
    P = 0.6 * before.precision + 0.4 * (torch.eye(7, dtype=torch.float64) + 2.0 * stats.G)
    torch.testing.assert_close(stored.precision, P, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(stored.precision @ stored.m, 0.6 * before.precision @ before.m + 0.8 * stats.h, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("kind", ["mean_field", "tril_natural", "delta", "batch"])
def test_variational_distributions_the_closed_form_step_cannot_use_are_refused_when_built(kind: str) -> None:
    """A mean-field, TrilNatural or Delta q(v), or a batch of GPs, was accepted and then failed in
    the first step with an AttributeError or a shape error; it must be a TypeError at construction."""
    M = 5
    Z = torch.randn(M, 2, dtype=torch.float64)
    vd = {
        "mean_field": lambda: gpytorch.variational.MeanFieldVariationalDistribution(M),
        "tril_natural": lambda: gpytorch.variational.TrilNaturalVariationalDistribution(M),
        "delta": lambda: gpytorch.variational.DeltaVariationalDistribution(M),
        "batch": lambda: gpytorch.variational.NaturalVariationalDistribution(M, batch_shape=torch.Size([2])),
    }[kind]()

    class UserGP(gpytorch.models.ApproximateGP):
        def __init__(self):
            super().__init__(ClosedFormStrategy(self, Z, vd))

    with pytest.raises(TypeError, match="ClosedFormStrategy"):
        UserGP()


def test_prior_variance_equals_the_projections_without_projecting() -> None:
    """prior_variance (what the GP head's outside-training share divides by) must be the projection's
    k(x, x) + jitter; otherwise the share would compare the predictive variance with another prior."""
    model, g = fitted_like_model(constant_mean=True)
    x = torch.randn(11, 3, generator=g, dtype=torch.float64)
    strategy = model.variational_strategy
    torch.testing.assert_close(strategy.prior_variance(x), strategy.projection(x).prior_var, rtol=1e-12, atol=0)


@pytest.mark.parametrize("kernel", ["rbf", "linear", "affine"])
def test_sparse_gp_keeps_its_kernel_values_exactly(kernel: str) -> None:
    """A float64 ``SparseGP`` must hold the lengthscale, outputscale and linear variance it is given to
    float64 precision whatever torch's default dtype: GPyTorch's setters turn a Python float into a
    float32 tensor first, which stored 7.8 as 7.8000002 and moved predictions by ~1e-8."""
    m = SparseGP(torch.randn(5, 3, dtype=torch.float64), kernel=kernel, lengthscale=7.8, outputscale=0.2)
    assert abs(float(m.covar_module.outputscale.detach()) - 0.2) < 1e-15
    if kernel == "rbf":
        assert abs(float(m.covar_module.base_kernel.lengthscale.detach()) - 7.8) < 1e-14
    else:
        linear = m.covar_module.base_kernel if kernel == "linear" else m.covar_module.base_kernel.kernels[0]
        assert abs(float(linear.variance.detach()) - 1 / 3) < 1e-15
