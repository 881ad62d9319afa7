"""Initial inducing locations and kernel scales from training instances."""
from __future__ import annotations

import numpy as np
from sklearn.cluster import kmeans_plusplus

__all__ = ["kmeans_pp_inducing", "median_lengthscale"]


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
        unique, inverse = np.unique(pts, axis=0, return_inverse=True)
        w_unique = np.bincount(inverse.reshape(-1), weights=w, minlength=len(unique))
        count = min(count, len(unique))
        centers, _ = kmeans_plusplus(unique, count, sample_weight=w_unique, random_state=int(rng.integers(2**31 - 1)))
        chosen.append(centers)
    Z = np.concatenate(chosen, 0)
    if len(Z) < num_inducing:  # fewer distinct points than requested: jitter copies apart
        extra = Z[rng.integers(len(Z), size=num_inducing - len(Z))] + 1e-3 * rng.standard_normal((num_inducing - len(Z), x.shape[1]))
        Z = np.concatenate([Z, extra], 0)
    return Z


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
