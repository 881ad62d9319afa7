"""MIL data sets the defaults were never developed on: bags built from the data that ships with
scikit-learn, judged exactly as ``benchmarks/real_mil.py`` judges the development folder.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.package_mil [--seeds 3] [--out DIR]

The estimators' defaults were chosen on four classic MIL benchmarks; this is a check that they
hold elsewhere. Each set is written as a CSV in ``real_mil``'s layout (label, bag id, features)
to ``--out`` (default: a temporary folder; one holding other CSV files is refused) and run through
:func:`benchmarks.real_mil.main` (every row, 5-fold CV over bags × ``--seeds`` shuffles); the JSON is
``benchmarks/results/package_mil.json`` (``package_mil_<n>_shuffles.json`` for other ``--seeds``).
Bags are drawn once (seed 0), no instance in two bags, of two kinds: *witness* bags
(:func:`benchmarks.common.witness_bags`: balanced, a positive bag holds 1 to ``k`` positive
instances among negatives, a negative bag none — the standard MIL assumption) and *proportion*
bags (:func:`benchmarks.common.proportion_bags`: a positive bag holds 40–60 % positive instances,
a negative bag 10–30 % — the label is the share, the collective assumption):

* ``breast_cancer``: Wisconsin diagnostic breast cancer (569 × 30), positive instances the
  malignant samples; witness bags of 8, 1–3 witnesses;
* ``breast_cancer_noise``: the same bags with 970 standard-normal features appended (1,000
  features, 3 % of them informative: wider than the ``M = 100`` inducing points);
* ``breast_cancer_proportion``: proportion bags of 8 from the same samples;
* ``wine``: the wine recognition data (178 × 13), positive instances cultivar 0; witness bags of
  5, 1–2 witnesses;
* ``digits``: the 8 × 8 digits (1,797 × 64), positive instances 2s and 9s; witness bags of 10,
  1–4 witnesses (the bags of ``benchmarks/digits_mil.py``, seed 0);
* ``digits_proportion``: proportion bags of 10 from the same digits;
* ``digits_wide``: the witness digits bags seen through one fixed random ReLU layer (64 → 1,024
  features, pixels scaled to ``[0, 1]``, weights ``N(0, 1/64)``, biases ``N(0, 1)``), a stand-in
  for wide learned features.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
from sklearn.datasets import load_breast_cancer, load_digits, load_wine

from benchmarks import real_mil
from benchmarks.common import add_thread_arg, proportion_bags, witness_bags

NOISE_FEATURES = 970
WIDE_FEATURES = 1024


def _noise(x: np.ndarray) -> np.ndarray:
    return np.hstack([x, np.random.default_rng(1).standard_normal((x.shape[0], NOISE_FEATURES))])


def _relu_layer(x: np.ndarray) -> np.ndarray:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((x.shape[1], WIDE_FEATURES)) / np.sqrt(x.shape[1])
    return np.maximum(x / 16.0 @ w + rng.standard_normal(WIDE_FEATURES), 0.0)  # digits' pixels are 0..16


MakeBags = Callable[[np.ndarray, np.ndarray], tuple[list[np.ndarray], np.ndarray, list[np.ndarray]]]
SETS: dict[str, tuple[Callable[..., Any], Callable[[np.ndarray], np.ndarray], MakeBags, Callable[[np.ndarray], np.ndarray] | None]] = {
    # name: (loader, positive rows of the targets, bags of the rows (seed 0), feature map of the rows)
    "breast_cancer": (load_breast_cancer, lambda t: t == 0, lambda x, p: witness_bags(x, p, 0, 8, 3), None),
    "breast_cancer_noise": (load_breast_cancer, lambda t: t == 0, lambda x, p: witness_bags(x, p, 0, 8, 3), _noise),
    "breast_cancer_proportion": (load_breast_cancer, lambda t: t == 0, lambda x, p: proportion_bags(x, p, 0, 8), None),
    "wine": (load_wine, lambda t: t == 0, lambda x, p: witness_bags(x, p, 0, 5, 2), None),
    "digits": (load_digits, lambda t: np.isin(t, (2, 9)), lambda x, p: witness_bags(x, p, 0, 10, 4), None),
    "digits_proportion": (load_digits, lambda t: np.isin(t, (2, 9)), lambda x, p: proportion_bags(x, p, 0, 10), None),
    "digits_wide": (load_digits, lambda t: np.isin(t, (2, 9)), lambda x, p: witness_bags(x, p, 0, 10, 4), _relu_layer),
}


def write_sets(out: Path) -> list[Path]:
    """Every set of :data:`SETS` as ``out/<name>.csv`` (label, bag id, features; one row an instance)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, (load, positive, make_bags, features) in SETS.items():
        x, target = load(return_X_y=True)
        x = x.astype(np.float64) if features is None else features(x.astype(np.float64))
        bags, labels, _ = make_bags(x, positive(target))
        rows = [np.column_stack([np.full(len(b), y), np.full(len(b), i), b]) for i, (b, y) in enumerate(zip(bags, labels))]
        path = out / f"{name}.csv"
        np.savetxt(path, np.vstack(rows), delimiter=",", fmt="%.10g")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=real_mil.DEFAULT_SEEDS, help="CV shuffles (seeds 0..n-1)")
    p.add_argument("--out", type=Path, default=None, help="folder for the CSVs (default: a temporary one)")
    add_thread_arg(p)
    args = p.parse_args(argv)
    if args.out is not None and args.out.is_dir():
        others = sorted(f.name for f in args.out.iterdir() if f.suffix.lower() == ".csv" and f.stem not in SETS)
        if others:
            raise SystemExit(f"--out {args.out} holds other CSV files ({', '.join(others)}), which would be judged "
                             "with these sets: give an empty folder")
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        write_sets(out)
        name = "package_mil" if args.seeds == real_mil.DEFAULT_SEEDS else f"package_mil_{args.seeds}_shuffles"
        return real_mil.main(["--data-dir", str(out), "--seeds", str(args.seeds), "--threads", str(args.threads), "--name", name])


if __name__ == "__main__":
    main()
