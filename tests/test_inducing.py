"""Inducing-point initialisation and the median-heuristic lengthscale."""
import numpy as np
import pytest
import torch

from milgp.inducing import (
    bag_mean_inducing, distinct_rows, kmeans_pp_inducing, linear_span_inducing, median_lengthscale, mil_inducing, rows_in,
)
from milgp.models.sparse_gp import SparseGP


def test_split_between_positive_and_negative_bag_instances():
    """M is split ½/½ between instances of positive and negative bags (reference VGPMIL code);
    with well separated groups each half must come from its own group."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=(50, 2)) + 100, rng.normal(size=(80, 2))])
    labels = np.r_[np.ones(50), np.zeros(80)]
    Z = kmeans_pp_inducing(x, labels, 11, seed=0)
    assert Z.shape == (11, 2)
    assert (Z[:, 0] > 50).sum() == 6 and (Z[:, 0] < 50).sum() == 5


def test_one_class_or_non_binary_labels_use_all_instances():
    """With one class (or regression targets) all instances form one group."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(30, 3))
    assert kmeans_pp_inducing(x, np.zeros(30), 7).shape == (7, 3)
    assert kmeans_pp_inducing(x, rng.normal(size=30), 7).shape == (7, 3)


def test_more_inducing_points_than_distinct_instances_are_made_distinct():
    """Asking for more points than distinct instances must still give M distinct points
    (duplicates would make K_zz singular)."""
    x = np.repeat(np.eye(3), 4, axis=0)
    Z = kmeans_pp_inducing(x, np.zeros(12), 6)
    assert Z.shape == (6, 3)
    assert len(np.unique(Z.round(12), axis=0)) == 6


def test_no_two_points_are_equal_across_the_positive_and_negative_groups():
    """An instance value present in positive and in negative bags (a blank slice) is chosen once,
    and where the data hold at least M distinct instances every point is an instance: a group short
    of distinct values leaves its share to the others instead of jittered copies. If this fails,
    both groups seed the same value (two equal inducing points: K_zz singular), or real instances
    are passed over for jittered copies."""
    rng = np.random.default_rng(0)
    blank = np.zeros((30, 4))
    x = np.r_[blank, rng.normal(size=(10, 4)) + 3, blank, rng.normal(size=(10, 4))]
    labels = np.r_[np.ones(40), np.zeros(40)]
    for seed in range(20):
        Z = kmeans_pp_inducing(x, labels, 8, seed=seed)
        assert Z.shape == (8, 4) and distinct_rows(Z) == 8 and rows_in(Z, x).all()
    Z = kmeans_pp_inducing(np.ones((50, 3)), np.r_[np.ones(25), np.zeros(25)], 5)
    assert distinct_rows(Z) == 5 and rows_in(Z, np.ones((1, 3))).sum() == 1
    one_valued = np.r_[np.ones((20, 2)), rng.normal(size=(20, 2))]  # positive bags: one value only
    Z = kmeans_pp_inducing(one_valued, np.r_[np.ones(20), np.zeros(20)], 6)
    assert distinct_rows(Z) == 6 and rows_in(Z, one_valued).all()
    wide = mil_inducing(np.ones((40, 30)), np.repeat(np.arange(8), 5), np.repeat(np.arange(8) % 2, 5).astype(float), 10)
    assert distinct_rows(wide) == len(wide) == 8  # the bag means all equal the one instance value


def test_rows_in_finds_exact_copies_only() -> None:
    """rows_in marks exactly the rows equal to one of the given rows (0.0 equals -0.0; one ulp apart
    does not). If this fails, copies among inducing points go unnoticed or distinct ones are dropped."""
    rows = np.array([[1.0, 2.0], [0.0, 1.0]])
    x = np.array([[0.0, 1.0], [1.0, 2.0], [-0.0, 1.0], [3.0, 3.0], [1.0, np.nextafter(2.0, 3.0)]])
    assert rows_in(x, rows).tolist() == [True, True, True, False, False]
    assert rows_in(x, rows[:0]).tolist() == [False] * 5 and rows_in(x[:0], rows).shape == (0,)


def test_distinct_rows_counts_exact_copies_only():
    """The count of distinct rows equals ``np.unique``'s: copies scattered through the array are
    counted once (0.0 and -0.0 are equal), rows one ulp apart in a single coordinate twice. A count
    that merged near copies, or missed copies that are not neighbours in the input, would fail."""
    rng = np.random.default_rng(4)
    base = rng.normal(size=(50, 300))
    near, column = base[:10].copy(), rng.integers(300, size=10)
    near[np.arange(10), column] = np.nextafter(near[np.arange(10), column], np.inf)
    x = np.concatenate([base, base[rng.integers(50, size=120)], near])
    x = x[rng.permutation(len(x))]
    assert distinct_rows(x) == len(np.unique(x, axis=0)) == 60
    assert distinct_rows(np.repeat(np.eye(3), 4, axis=0)) == 3
    assert distinct_rows(np.array([[0.0, 1.0], [-0.0, 1.0]])) == 1  # equal values, different bits
    assert distinct_rows(x[:1]) == 1 and distinct_rows(x[:0]) == 0


def test_deterministic_given_seed_and_rejects_bad_m():
    """Same seed → same Z; M < 1 raises."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(40, 2))
    lab = np.r_[np.ones(20), np.zeros(20)]
    np.testing.assert_array_equal(kmeans_pp_inducing(x, lab, 5, seed=3), kmeans_pp_inducing(x, lab, 5, seed=3))
    with pytest.raises(ValueError, match="num_inducing"):
        kmeans_pp_inducing(x, lab, 0)


def test_median_lengthscale():
    """The median pairwise distance: √2 for the corners of a unit square's diagonal pairs mix,
    1.0 for a degenerate (single point) input, scale-equivariant."""
    x = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert median_lengthscale(x) == pytest.approx(1.0)  # distances 1,1,1,1,√2,√2 → median 1
    assert median_lengthscale(np.zeros((5, 2))) == 1.0
    assert median_lengthscale(3 * x) == pytest.approx(3.0)


def test_median_lengthscale_is_translation_invariant_and_refuses_non_finite_features() -> None:
    """Under a common offset of 1e8 the median distance is the offset-free one (scipy's pdist), and
    a NaN feature is a one-line ValueError naming its row. If this fails, features far from the
    origin get a lengthscale made of rounding error (2.83 for a true 2.18), or NaN features are
    silently given the lengthscale 1."""
    from scipy.spatial.distance import pdist

    x = np.random.default_rng(0).normal(size=(200, 3))
    reference = np.sqrt(np.median(pdist(x, "sqeuclidean")))
    assert median_lengthscale(x) == pytest.approx(reference, rel=1e-12)
    assert median_lengthscale(x + 1e8) == pytest.approx(reference, rel=1e-6)
    x[7, 1] = np.nan
    with pytest.raises(ValueError, match=r"^x row 7 is not finite \(1 of 200 rows\)"):
        median_lengthscale(x)


def test_bag_mean_points_are_bag_means_without_copies():
    """Every returned point is the mean of one bag, no two are equal, and a mean equal to an
    excluded point (a bag of one instance is its own mean) is dropped: a copy among the inducing
    points would make K_zz singular."""
    rng = np.random.default_rng(5)
    sizes = np.r_[1, 1, rng.integers(2, 6, size=8)]
    bag_index = np.repeat(np.arange(10), sizes)
    x = rng.normal(size=(len(bag_index), 4))
    means = np.stack([x[bag_index == b].mean(0) for b in range(10)])
    Z = bag_mean_inducing(x, bag_index, 20, seed=0)
    assert len(Z) == 10 and len(np.unique(Z, axis=0)) == 10
    assert all(np.isclose(means, z, atol=1e-12, rtol=0).all(1).any() for z in Z)
    kept = bag_mean_inducing(x, bag_index, 20, seed=0, exclude=x[:2])  # the two one-instance bags
    assert len(kept) == 8 and not any((kept == row).all(1).any() for row in x[:2])


def test_bag_mean_points_seed_among_the_means_when_there_are_more_bags():
    """With more bags than asked for, ``count`` distinct means are chosen, reproducibly."""
    rng = np.random.default_rng(6)
    bag_index = np.repeat(np.arange(40), 3)
    x = rng.normal(size=(120, 2))
    Z = bag_mean_inducing(x, bag_index, 7, seed=1)
    assert Z.shape == (7, 2) and len(np.unique(Z, axis=0)) == 7
    np.testing.assert_array_equal(Z, bag_mean_inducing(x, bag_index, 7, seed=1))
    assert bag_mean_inducing(x, bag_index, 0).shape == (0, 2)


def test_bag_means_span_what_instances_miss_on_wide_features():
    """On features wider than M, a linear model restricted to the span of M instance seeds cannot
    reach the direction that separates the bags' means; with the bag means among the points it
    can. If the bag-mean points were not bag means, or were dropped, the residual would stay large."""
    rng = np.random.default_rng(7)
    B, n, D = 30, 8, 400
    y = np.r_[np.ones(15), np.zeros(15)]
    direction = rng.normal(size=D)
    x = rng.normal(size=(B * n, D)) + 0.3 * np.repeat(y, n)[:, None] * direction
    bag_index = np.repeat(np.arange(B), n)
    means = np.stack([x[bag_index == b].mean(0) for b in range(B)])
    contrast = means[y == 1].mean(0) - means[y == 0].mean(0)  # logistic regression's first step
    labels = np.repeat(y, n)

    def residual(Z: np.ndarray) -> float:
        q = np.linalg.qr(Z.T)[0]
        return float(np.linalg.norm(contrast - q @ (q.T @ contrast)) / np.linalg.norm(contrast))

    instances = mil_inducing(x, bag_index, labels, 20, bag_mean_share=0.0, seed=0)
    mixed = mil_inducing(x, bag_index, labels, 20, bag_mean_share=0.5, seed=0)
    assert residual(instances) > 0.6
    assert residual(mixed) < residual(instances) - 0.2


def test_mil_inducing_splits_m_between_instances_and_bag_means_on_wide_features():
    """With more features than points (D > M), ``⌊share·M⌋`` points are bag means (at most one per
    bag) and the rest the instance seeds of ``kmeans_pp_inducing``; with D ≤ M, or share 0, all
    are exactly ``kmeans_pp_inducing``'s; a share of 1 leaves no instance point and is refused."""
    rng = np.random.default_rng(8)
    bag_index = np.repeat(np.arange(6), 5)
    labels = np.repeat(np.r_[1, 0, 1, 0, 1, 0], 5)
    x = rng.normal(size=(30, 25))
    np.testing.assert_array_equal(mil_inducing(x, bag_index, labels, 12, 0.0, seed=2), kmeans_pp_inducing(x, labels, 12, seed=2))
    Z = mil_inducing(x, bag_index, labels, 12, 0.25, seed=2)
    np.testing.assert_array_equal(Z[:9], kmeans_pp_inducing(x, labels, 9, seed=2))
    assert len(Z) == 12 and len(np.unique(Z, axis=0)) == 12
    assert len(mil_inducing(x, bag_index, labels, 20, 0.5, seed=2)) == 20  # 10 wanted at means, 6 bags: 14 seeds + 6
    narrow = x[:, :12]  # D = 12 = M: twelve generic instances already span every direction
    np.testing.assert_array_equal(mil_inducing(narrow, bag_index, labels, 12, 0.25, seed=2), kmeans_pp_inducing(narrow, labels, 12, seed=2))
    with pytest.raises(ValueError, match="bag_mean_inducing"):
        mil_inducing(x, bag_index, labels, 12, 1.0)


@pytest.mark.parametrize("kernel", ["linear", "affine"])
def test_linear_span_points_make_a_linear_kernel_exact(kernel):
    """On the points of ``linear_span_inducing`` a linear (affine) kernel's sparse GP must be the
    exact Bayesian linear model: no prior variance left outside the span at any input
    (``k(x, x) − aᵀa = 0``), so the estimators may fit their linear candidates there in place of
    ``M`` instance points. Without the origin the affine kernel's intercept would be missing, and
    ``K_zz`` of the linear kernel is ``s²·I``."""
    dim = 5
    Z = torch.as_tensor(linear_span_inducing(dim, affine=kernel == "affine"))
    assert Z.shape == (dim + (kernel == "affine"), dim)
    model = SparseGP(Z, kernel=kernel, outputscale=3.0)
    x = torch.randn(40, dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 4
    with torch.no_grad():
        proj = model.variational_strategy.projection(x)
        outside = proj.prior_var - proj.A.square().sum(0)  # the jitter's share only
        assert float((outside / proj.prior_var).abs().max()) < 1e-5
        if kernel == "linear":
            K = model.covar_module(Z).to_dense()
            torch.testing.assert_close(K, 3.0 * torch.eye(dim, dtype=torch.float64))
        else:  # the basis alone leaves the intercept outside the span
            lin = SparseGP(torch.as_tensor(linear_span_inducing(dim)), kernel="affine", outputscale=3.0)
            short = lin.variational_strategy.projection(x)
            assert float(((short.prior_var - short.A.square().sum(0)) / short.prior_var).max()) > 1e-2
    with pytest.raises(ValueError, match="dim"):
        linear_span_inducing(0)
