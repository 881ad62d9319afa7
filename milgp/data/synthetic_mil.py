"""A synthetic MIL set of Gaussian clusters, one of them the positive concept (benchmarks and tests)."""
from __future__ import annotations

import numpy as np

__all__ = ["synthetic_mil"]


def synthetic_mil(
    num_instances: int = 100_000,
    dim: int = 10,
    bag_sizes: tuple[int, int] = (10, 50),
    num_clusters: int = 8,
    witness_rate: float = 0.2,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Synthetic MIL set: instances from Gaussian clusters, one cluster is the positive concept.

    Returns ``(x (N, D) float64, bag_index (N,), bag_labels (B,), instance_labels (N,))``. Bags hold
    ``bag_sizes[0]..bag_sizes[1]`` instances; half the bags are positive, with a fraction
    ``witness_rate`` (at least one) of their instances drawn from the positive cluster.
    """
    rng = np.random.default_rng(seed)
    centers = rng.normal(0.0, 2.5, size=(num_clusters, dim))
    sizes = []
    total = 0
    while total < num_instances:
        s = int(rng.integers(bag_sizes[0], bag_sizes[1] + 1))
        s = min(s, num_instances - total) if num_instances - total >= bag_sizes[0] else s
        sizes.append(s)
        total += s
    sizes[-1] -= total - num_instances  # the last bag holds what is left (at least one instance)
    sizes_a = np.asarray(sizes)
    B = len(sizes_a)
    bag_labels = (rng.random(B) < 0.5).astype(np.float64)
    bag_index = np.repeat(np.arange(B), sizes_a)
    n = len(bag_index)
    starts = np.concatenate([[0], np.cumsum(sizes_a)[:-1]])
    n_wit = np.maximum(1, np.round(witness_rate * sizes_a).astype(int))
    offs = np.arange(n) - starts[bag_index]
    inst = ((offs < n_wit[bag_index]) & (bag_labels[bag_index] > 0)).astype(np.float64)
    cluster = np.where(inst > 0, 0, rng.integers(1, num_clusters, size=n))
    x = centers[cluster] + rng.normal(0.0, 1.0, size=(n, dim))
    # shuffle instances within the flat layout (bag_index still says which bag)
    perm = rng.permutation(n)
    return x[perm], bag_index[perm], bag_labels, inst[perm]
