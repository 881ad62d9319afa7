"""How much a linear model loses when its weights are confined to the span of M inducing points.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.linear_span --data-dir ../shared/data/mil [--seeds 3]

A sparse GP with a linear kernel and M inducing points ``Z`` is a linear model whose weights lie in
``span(Z)``. This script measures that restriction on its own, with the benchmark's strongest
instance baseline: logistic regression on z-scored instances labelled with their bag's label, the
bag probability the mean instance probability (``benchmarks.real_mil``'s "logistic regression +
mean pooling" row), fitted on the instances projected onto an orthonormal basis of ``span(Z)``.
``Z``: the estimators' k-means++ seeds (``milgp.inducing.kmeans_pp_inducing``, split between
positive- and negative-bag instances), a uniform draw of training instances, or the top principal
directions, the training bags' mean instances (``milgp.inducing.bag_mean_inducing``), or the
estimators' own points (``milgp.inducing.mil_inducing``: where ``D > M`` a quarter at bag means,
the rest seeds); the full span for comparison, at several penalties ``C``. Same folds as
``benchmarks.real_mil`` (``StratifiedKFold(5, shuffle=True, random_state=seed)``); prints the bag
AUC mean (worst fold) and writes ``benchmarks/results/linear_span.json``.
"""
from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import numpy as np
from sklearn.metrics import roc_auc_score

from benchmarks.common import add_thread_arg, markdown_table, name_for_folder, set_threads, write_json
from benchmarks.mil_csv import load_mil_folder
from benchmarks.real_mil import FOLDS, LogisticPooling, cv_folds
from milgp.inducing import bag_mean_inducing, kmeans_pp_inducing, mil_inducing

SIZES = (100, 300)
PENALTIES = (0.01, 0.1, 1.0, 10.0)


def span_basis(kind: str, m: int, x: np.ndarray, instance_labels: np.ndarray, seed: int, bag_index: np.ndarray) -> np.ndarray:
    """``(D, k)`` orthonormal basis of the span of ``m`` points of the z-scored instances ``x``
    (``bag_index``: each instance's training bag)."""
    if kind == "principal directions":
        return np.linalg.svd(x, full_matrices=False)[2][:m].T
    if kind == "k-means++ seeds":
        z = kmeans_pp_inducing(x, instance_labels, m, seed=seed)
    elif kind == "bag means":
        z = bag_mean_inducing(x, bag_index, m, seed=seed)
    elif kind == "the estimators' mix":
        z = mil_inducing(x, bag_index, instance_labels, m, seed=seed)
    else:
        z = x[np.random.default_rng(seed).choice(len(x), min(m, len(x)), replace=False)]
    return np.linalg.qr(z.T)[0]


def bag_auc(bags: list[np.ndarray], y: np.ndarray, train: np.ndarray, test: np.ndarray, c: float, basis: str | None, m: int, seed: int) -> float:
    """Bag AUC on ``test`` of the benchmark's logistic regression + mean pooling fitted on ``train``,
    its weights in the span of ``m`` points of kind ``basis`` (``None``: all features)."""
    sizes = [len(bags[i]) for i in train]
    span = None if basis is None else partial(span_basis, basis, m, seed=seed, bag_index=np.repeat(np.arange(len(train)), sizes))
    model = LogisticPooling("mean", C=c, basis=span).fit([bags[i] for i in train], y[train])
    return float(roc_auc_score(y[test], model.predict_proba([bags[i] for i in test])[:, 1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--seeds", type=int, default=3)
    add_thread_arg(parser)
    args = parser.parse_args()
    set_threads(args.threads)
    variants = [("full span", None, 0, c) for c in PENALTIES] + [
        (f"{kind}, M = {m}", kind, m, 1.0)
        for kind in ("k-means++ seeds", "uniform draw", "principal directions", "bag means", "the estimators' mix") for m in SIZES
    ]
    rows, results = [], {}
    for stem, (bags, y) in load_mil_folder(args.data_dir, min_bags_per_class=FOLDS).items():
        folds = [
            (seed, k, train, test)
            for seed in range(args.seeds)
            for k, (train, test) in enumerate(cv_folds(y, seed))
        ]
        for name, basis, m, c in variants:
            aucs = [bag_auc(bags, y, train, test, c, basis, m, k) for _, k, train, test in folds]
            label = name if basis is not None else f"{name}, C = {c:g}"
            rows.append({"data": stem, "weights in": label, "bag AUC": float(np.mean(aucs)), "worst fold": float(np.min(aucs))})
            results.setdefault(stem, {})[label] = aucs
            print(f"{stem}: {label}: {np.mean(aucs):.3f} ({np.min(aucs):.3f})", flush=True)
    print(markdown_table(rows))
    payload = {"seeds": args.seeds, "data_dir": str(args.data_dir), "fold_auc": results}
    write_json(name_for_folder("linear_span", args.data_dir), payload)


if __name__ == "__main__":
    main()
