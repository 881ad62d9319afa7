"""Initial inducing locations and kernel scales from training instances."""
from __future__ import annotations

import numpy as np
from scipy.sparse import csr_matrix
from sklearn.cluster import kmeans_plusplus

__all__ = ["bag_mean_inducing", "distinct_rows", "kmeans_pp_inducing", "linear_span_inducing", "median_lengthscale", "mil_inducing", "rows_in"]


def kmeans_pp_inducing(
    x: np.ndarray,
    instance_bag_labels: np.ndarray,
    num_inducing: int,
    seed: int = 0,
    max_points: int = 20000,
    weights: np.ndarray | None = None,
) -> np.ndarray:
    """``(M, D)`` inducing points by k-means++ seeding, split between instances of positive and of
    negative bags in proportion ½ / ½ (as the VGPMIL reference code does), or over all instances
    when ``instance_bag_labels`` has one class (regression targets, one-class data).

    ``weights`` ``(N,)`` weight the instances in the seeding and the subsampling (e.g. the bag-size
    cap's ``min(1, n̄/n_b)``, so that one very long bag does not claim most inducing points). At most
    ``max_points`` instances per group are used for the seeding. No two points are equal: a group
    seeds among its instances that equal no point chosen before, a group with too few distinct
    instances leaves its share to the other instances, and only when ``x`` has fewer than ``M``
    distinct rows are copies jittered apart.
    """
    rng = np.random.default_rng(seed)
    x = np.asarray(x, dtype=np.float64)
    if num_inducing < 1:
        raise ValueError(f"num_inducing must be at least 1, got {num_inducing}")
    labels = np.asarray(instance_bag_labels)
    groups = [np.nonzero(labels > 0.5)[0], np.nonzero(labels <= 0.5)[0]]
    if min(len(g) for g in groups) == 0 or not np.isin(labels, (0, 1)).all():
        groups = [np.arange(len(x))]
    counts = [num_inducing // len(groups)] * len(groups)
    counts[0] += num_inducing - sum(counts)
    w_all = np.ones(len(x)) if weights is None else np.asarray(weights, dtype=np.float64)
    Z = x[:0]
    # the groups' shares, then whatever they could not fill from all instances not yet chosen
    for group, count in [*zip(groups, counts), (np.arange(len(x)), None)]:
        count = num_inducing - len(Z) if count is None else count
        if count == 0:  # num_inducing = 1: the one point comes from the first group
            continue
        group = group[~rows_in(x[group], Z)]  # k-means++ never picks a copy within a group (distance 0)
        pts, w = x[group], w_all[group]
        if len(pts) > max_points:
            keep = rng.choice(len(pts), max_points, replace=False, p=w / w.sum())
            pts, w = pts[keep], np.ones(max_points)
        count = min(count, distinct_rows(pts))
        if count:
            centers, _ = kmeans_plusplus(pts, count, sample_weight=w, random_state=int(rng.integers(2**31 - 1)))
            Z = np.concatenate([Z, centers], 0)
    if len(Z) < num_inducing:  # fewer distinct points than requested: jitter copies apart
        extra = Z[rng.integers(len(Z), size=num_inducing - len(Z))] + 1e-3 * rng.standard_normal((num_inducing - len(Z), x.shape[1]))
        Z = np.concatenate([Z, extra], 0)
    return Z


def linear_span_inducing(dim: int, affine: bool = False) -> np.ndarray:
    """``(D, D)`` inducing points ``√D·e_i`` (``(D + 1, D)`` with the origin for ``affine``) that
    span a linear kernel's whole function space: ``s² xᵀx'/D`` is a linear function of ``x`` (with a
    constant for ``s² (xᵀx'/D + 1)``), so on these points the sparse GP is the exact Bayesian linear
    model, whatever other inducing points would be placed, at ``(D + 1)²`` instead of ``M²`` work
    per instance where ``D + 1 < M``. The linear kernel's ``K_zz`` is ``s²·I``.
    """
    if dim < 1:
        raise ValueError(f"dim must be at least 1, got {dim}")
    basis = np.sqrt(dim) * np.eye(dim)
    return np.concatenate([basis, np.zeros((1, dim))]) if affine else basis


def bag_mean_inducing(
    x: np.ndarray, bag_index: np.ndarray, count: int, seed: int = 0, exclude: np.ndarray | None = None
) -> np.ndarray:
    """``(k, D)`` inducing points at the bags' mean instances, ``k ≤ count``: every distinct bag
    mean when there are at most ``count``, else ``count`` of them by k-means++ seeding. Means equal
    to a row of ``exclude`` ``(K, D)`` (the other inducing points: a bag of one instance is its own
    mean) are dropped, so no two inducing points coincide. ``x`` ``(N, D)``, ``bag_index`` ``(N,)``
    with values ``0..B−1``.

    Why: a linear-kernel sparse GP has its weights in the span of its inducing points, and on wide
    features the span of ``M`` instances misses the directions that separate the bags, which the
    bags' means span (docs/core.md, cause 10).
    """
    x = np.asarray(x, dtype=np.float64)
    bag_index = np.asarray(bag_index)
    sizes = np.bincount(bag_index)
    membership = csr_matrix((np.ones(len(bag_index)), (bag_index, np.arange(len(bag_index)))), shape=(len(sizes), len(x)))
    means = (membership @ x)[sizes > 0] / sizes[sizes > 0, None]  # a sparse product, faster than np.add.at
    count = min(count, distinct_rows(means))
    if count < 1:
        return means[:0]
    rng = np.random.default_rng(seed)
    chosen, _ = kmeans_plusplus(means, count, random_state=int(rng.integers(2**31 - 1)))
    if exclude is not None and len(exclude):
        chosen = chosen[~rows_in(chosen, exclude)]
    return chosen


def mil_inducing(
    x: np.ndarray,
    bag_index: np.ndarray,
    instance_bag_labels: np.ndarray,
    num_inducing: int,
    bag_mean_share: float = 0.25,
    seed: int = 0,
    weights: np.ndarray | None = None,
) -> np.ndarray:
    """``(≤ M, D)`` inducing points of the MIL estimators, ``M = min(num_inducing, N)``. Where the
    features outnumber them (``D > M``), ``⌊bag_mean_share · M⌋`` (at most one per bag) sit at the
    bags' mean instances (:func:`bag_mean_inducing`: the span a linear kernel lacks) and the rest
    at instances (:func:`kmeans_pp_inducing`, ``weights`` as there); with ``D ≤ M`` all are
    instances, whose span is already all of ``ℝ^D``, so bag means would only thin out the
    instance points that resolve witnesses. Fewer than ``M`` only where a bag mean equals an
    instance point. ``bag_mean_share = 0``: instances only.
    """
    if not 0 <= bag_mean_share < 1:
        raise ValueError(f"bag_mean_inducing must be in [0, 1), got {bag_mean_share!r}")
    M = min(num_inducing, len(x))
    at_means = min(int(np.max(bag_index)) + 1, int(bag_mean_share * M)) if x.shape[1] > M else 0
    Z = kmeans_pp_inducing(x, instance_bag_labels, M - at_means, seed=seed, weights=weights)
    return np.concatenate([Z, bag_mean_inducing(x, bag_index, at_means, seed=seed, exclude=Z)])


def _row_hashes(values: np.ndarray) -> np.ndarray:
    """``(N,)`` hashes of the rows of ``values`` ``(N, D)`` float64: ``Σ_j bits_j · c_j mod 2⁶⁴`` of
    their bit patterns (fixed random odd ``c``; ``+ 0.0`` maps ``−0.0`` to ``0.0``: equal values,
    equal hashes), in chunks of about 2²⁰ entries."""
    multipliers = np.random.default_rng(0).integers(0, 2**64 - 1, size=values.shape[1], dtype=np.uint64, endpoint=True) | np.uint64(1)
    chunks = np.array_split(values, max(1, -(-values.size // 2**20)))
    return np.concatenate([np.einsum("nd,d->n", (c + 0.0).view(np.uint64), multipliers) for c in chunks])


def distinct_rows(x: np.ndarray) -> int:
    """The number of distinct rows of ``x`` ``(N, D)`` in ``O(N·D)`` (``np.unique(x, axis=0)`` sorts
    whole rows). Rows with equal hashes (:func:`_row_hashes`) are compared exactly (a collision of
    two different rows' hashes, chance about ``N²/2⁶⁵``, could only count one row too many)."""
    if len(x) < 2:
        return len(x)
    values = np.asarray(x, dtype=np.float64)
    hashes = _row_hashes(values)
    order = np.argsort(hashes)
    pairs = np.nonzero(hashes[order[1:]] == hashes[order[:-1]])[0]  # neighbours to compare exactly
    return len(x) - int((values[order[pairs]] == values[order[pairs + 1]]).all(1).sum())


def rows_in(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``(N,)`` whether each row of ``x`` ``(N, D)`` equals a row of ``rows`` ``(K, D)`` (``0.0`` and
    ``−0.0`` equal) in ``O((N + K)·D)``: a row whose hash (:func:`_row_hashes`) one of ``rows`` has
    is compared exactly with it (two different ``rows`` of one hash, chance about ``K²/2⁶⁵``, could
    only miss a copy of one of them)."""
    x, rows = np.asarray(x, dtype=np.float64), np.asarray(rows, dtype=np.float64)
    if len(rows) == 0:
        return np.zeros(len(x), dtype=bool)
    hashes = _row_hashes(rows)
    order = np.argsort(hashes)
    hx = _row_hashes(x)
    match = order[np.minimum(np.searchsorted(hashes[order], hx), len(rows) - 1)]
    found = hashes[match] == hx
    found[found] = (x[found] == rows[match[found]]).all(1)
    return found


def median_lengthscale(x: np.ndarray, seed: int = 0, max_points: int = 2000) -> float:
    """Median pairwise Euclidean distance of (a subsample of) ``x`` ``(N, D)``: the usual
    scale-free initial RBF lengthscale. The points are centred before ``‖x‖² + ‖y‖² − 2x·y``, which
    would otherwise lose the distances to rounding under a large common offset; a non-finite
    feature is refused (``ValueError`` naming its row)."""
    rng = np.random.default_rng(seed)
    x = np.asarray(x, dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(x).all(1))
    if len(bad):
        raise ValueError(f"x row {int(bad[0])} is not finite ({len(bad)} of {len(x)} rows); median_lengthscale needs finite features")
    if len(x) > max_points:
        x = x[rng.choice(len(x), max_points, replace=False)]
    x = x - x.mean(0) if len(x) else x
    sq = (x * x).sum(1)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2 * x @ x.T, 0)
    iu = np.triu_indices(len(x), 1)
    med = float(np.sqrt(np.median(d2[iu]))) if len(iu[0]) else 1.0
    return med if med > 0 else 1.0
