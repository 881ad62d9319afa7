"""Inducing-point initialisation and the median-heuristic lengthscale."""
import numpy as np
import pytest

from milgp.inducing import distinct_rows, kmeans_pp_inducing, median_lengthscale


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
