"""Initial inducing locations and kernel scales from training instances."""
from __future__ import annotations

import numpy as np
from sklearn.cluster import kmeans_plusplus

__all__ = ["distinct_rows", "kmeans_pp_inducing", "median_lengthscale"]


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
    ``max_points`` instances per group are used for the seeding.
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
    chosen = []
    w_all = np.ones(len(x)) if weights is None else np.asarray(weights, dtype=np.float64)
    for group, count in zip(groups, counts):
        pts, w = x[group], w_all[group]
        if len(pts) > max_points:
            keep = rng.choice(len(pts), max_points, replace=False, p=w / w.sum())
            pts, w = pts[keep], np.ones(max_points)
        # k-means++ never picks a copy of a chosen point (its distance is 0), so copies need no
        # merging; only the count must not exceed the distinct points
        count = min(count, distinct_rows(pts))
        centers, _ = kmeans_plusplus(pts, count, sample_weight=w, random_state=int(rng.integers(2**31 - 1)))
        chosen.append(centers)
    Z = np.concatenate(chosen, 0)
    if len(Z) < num_inducing:  # fewer distinct points than requested: jitter copies apart
        extra = Z[rng.integers(len(Z), size=num_inducing - len(Z))] + 1e-3 * rng.standard_normal((num_inducing - len(Z), x.shape[1]))
        Z = np.concatenate([Z, extra], 0)
    return Z


def distinct_rows(x: np.ndarray) -> int:
    """The number of distinct rows of ``x`` ``(N, D)`` in ``O(N·D)`` (``np.unique(x, axis=0)`` sorts
    whole rows: 3–6 s for 20,000 rows of 2,048 features). Each row's float64 bit patterns are hashed
    by exact wrap-around integer arithmetic, ``Σ_j bits_j · c_j mod 2⁶⁴`` with fixed random odd
    ``c``, so equal rows have equal hashes whatever the summation order; rows are ordered by hash
    and neighbours with equal hashes compared exactly, equal ones counted once (a collision of two
    different rows' hashes, chance about ``N²/2⁶⁵``, could only count one row too many)."""
    if len(x) < 2:
        return len(x)
    values = np.asarray(x, dtype=np.float64)
    multipliers = np.random.default_rng(0).integers(0, 2**64 - 1, size=x.shape[1], dtype=np.uint64, endpoint=True) | np.uint64(1)
    chunks = np.array_split(values, -(-values.size // 2**20))  # + 0.0 maps -0.0 to 0.0 (equal values, equal bits)
    hashes = np.concatenate([np.einsum("nd,d->n", (c + 0.0).view(np.uint64), multipliers) for c in chunks])
    order = np.argsort(hashes)
    pairs = np.nonzero(hashes[order[1:]] == hashes[order[:-1]])[0]  # neighbours to compare exactly
    return len(x) - int((values[order[pairs]] == values[order[pairs + 1]]).all(1).sum())


def median_lengthscale(x: np.ndarray, seed: int = 0, max_points: int = 2000) -> float:
    """Median pairwise Euclidean distance of (a subsample of) ``x`` ``(N, D)``: the usual
    scale-free initial RBF lengthscale."""
    rng = np.random.default_rng(seed)
    x = np.asarray(x, dtype=np.float64)
    if len(x) > max_points:
        x = x[rng.choice(len(x), max_points, replace=False)]
    sq = (x * x).sum(1)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2 * x @ x.T, 0)
    iu = np.triu_indices(len(x), 1)
    med = float(np.sqrt(np.median(d2[iu]))) if len(iu[0]) else 1.0
    return med if med > 0 else 1.0
