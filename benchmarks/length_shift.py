"""Bag rules under a change of bag length, with new instances (scikit-learn's digits).

A CT scan re-sliced at a quarter of the slice thickness is the same patient with four times as
many slices: new, similar images, not copies. The bag-rule study of docs/core.md repeated every
instance of a test bag ten times; this one builds the longer bags from digits the model has
never seen, so the instances are distinct and the rules see more draws.

Digits 2 and 9 are the positive instances (as ``benchmarks/digits_mil.py``); no digit is in two
bags. Per seed: the estimator is fitted on 60 bags of 10 (half positive, 1–4 positive digits
each) and predicts four test sets drawn from the digits left over:

* ``same``: 40 bags of 10 with 1–4 positive digits (the training kind);
* ``re-sliced ×4``: 20 bags of 40 with 4–16 (the same fraction of positives, four times the
  instances: a scan at a quarter of the slice thickness);
* ``extended ×4``: 20 bags of 40 with 1–4 (the same witnesses among four times the negatives: a
  scan covering more of the body);
* ``halved``: 40 bags of 5 with 1–2.

Rows: the three MIL classifiers at their defaults (``bag_rule="auto"``, the rule chosen and
calibrated on out-of-bag predictions) and ``VGPMILClassifier`` with each rule fixed, among them the max at the training
bags' resolution (``MaxRule(reference_length=10)``, the form ``"auto"`` scores). Cells: bag AUC (mean over seeds),
accuracy at ½, ECE of the predictions pooled over seeds, and the share of negative bags called
positive at ½.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.length_shift            # 5 seeds
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.length_shift --quick    # 1 seed

Prints a markdown table and writes ``benchmarks/results/length_shift.json``.
"""
from __future__ import annotations

import argparse
import warnings
from typing import Any, Callable

import numpy as np
from sklearn.datasets import load_digits
from sklearn.metrics import roc_auc_score

from benchmarks.common import add_thread_arg, markdown_table, set_threads, write_json
from milgp.estimators import ProbitMILClassifier, VGPMILClassifier
from milgp.metrics import expected_calibration_error
from milgp.prediction import BagRule, MaxRule

POSITIVE_DIGITS = (2, 9)
TRAIN = (60, 10, (1, 4))
"""Training bags: count, length, positive digits per positive bag (inclusive range)."""
TESTS: dict[str, tuple[int, int, tuple[int, int]]] = {
    "same": (40, 10, (1, 4)),
    "re-sliced ×4": (20, 40, (4, 16)),
    "extended ×4": (20, 40, (1, 4)),
    "halved": (40, 5, (1, 2)),
}
DEFAULTS: dict[str, Callable[[int], Any]] = {
    "VGPMILClassifier() (auto)": lambda seed: VGPMILClassifier(random_state=seed),
    'VGPMILClassifier(psi="gamma") (auto)': lambda seed: VGPMILClassifier(psi="gamma", random_state=seed),
    "ProbitMILClassifier() (auto)": lambda seed: ProbitMILClassifier(random_state=seed),
}
RULES: dict[str, str | BagRule] = {
    "max": "max",
    f"max at the training resolution (reference length {TRAIN[1]})": MaxRule(reference_length=TRAIN[1]),
    "top_k_mean": "top_k_mean",
    "mean": "mean",
    "noisy_or": "noisy_or",
    "joint_max": "joint_max",
}


def draw_bags(
    x: np.ndarray, pos: list[int], neg: list[int], n_bags: int, size: int, witnesses: tuple[int, int], rng: np.random.Generator
) -> tuple[list[np.ndarray], np.ndarray]:
    """``n_bags`` bags of ``size`` instances, every second one positive with ``witnesses`` positive
    digits; the instances are taken (popped) from the index pools ``pos`` and ``neg``."""
    bags, labels = [], []
    for b in range(n_bags):
        k = int(rng.integers(witnesses[0], witnesses[1] + 1)) if b % 2 else 0
        if k > len(pos) or size - k > len(neg):
            raise ValueError(f"the digits do not hold {n_bags} bags of {size}")
        idx = [pos.pop() for _ in range(k)] + [neg.pop() for _ in range(size - k)]
        bags.append(x[rng.permutation(idx)])
        labels.append(b % 2)
    return bags, np.asarray(labels)


def one_seed(seed: int) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
    """``{(rule, test set): (probabilities, labels)}`` of one seed."""
    rng = np.random.default_rng(seed)
    x, digit = load_digits(return_X_y=True)
    x = x.astype(np.float64)
    is_pos = np.isin(digit, POSITIVE_DIGITS)
    pos, neg = list(rng.permutation(np.flatnonzero(is_pos))), list(rng.permutation(np.flatnonzero(~is_pos)))
    train, y_train = draw_bags(x, pos, neg, *TRAIN, rng)
    tests = {}
    for name, spec in TESTS.items():  # each test set from the digits the training bags left, drawn afresh
        tests[name] = draw_bags(x, list(rng.permutation(pos)), list(rng.permutation(neg)), *spec, rng)
    out = {}
    models = {**DEFAULTS, **{rule: (lambda s, r=bag_rule: VGPMILClassifier(bag_rule=r, random_state=s)) for rule, bag_rule in RULES.items()}}
    for rule, make in models.items():
        est = make(seed).fit(train, y_train)
        for name, (bags, y) in tests.items():
            out[(rule, name)] = (est.predict_proba(bags)[:, 1], y)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="one seed")
    add_thread_arg(p)
    args = p.parse_args(argv)
    set_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    seeds = [0] if args.quick else list(range(args.seeds))
    runs = [one_seed(s) for s in seeds]
    rows, raw = [], {}
    for rule in [*DEFAULTS, *RULES]:
        row: dict[str, Any] = {"bag rule": rule}
        for name in TESTS:
            per_seed = [run[(rule, name)] for run in runs]
            p_all = np.concatenate([q for q, _ in per_seed])
            y_all = np.concatenate([y for _, y in per_seed])
            auc = float(np.mean([roc_auc_score(y, q) for q, y in per_seed]))
            acc = float(np.mean([np.mean((q > 0.5) == y) for q, y in per_seed]))
            ece = expected_calibration_error(p_all, y_all)
            false_pos = float(np.mean(p_all[y_all == 0] > 0.5))
            row[name] = f"{auc:.3f} / {acc:.2f} / {ece:.3f} / {false_pos:.2f}"
            raw[f"{rule} | {name}"] = {"auc": auc, "accuracy": acc, "ece": ece, "negatives_above_half": false_pos}
        rows.append(row)
    print("cells: bag AUC / accuracy at ½ / ECE / share of negative bags above ½\n")
    print(markdown_table(rows))
    write_json("length_shift", {"quick": args.quick, "seeds": seeds, "train": TRAIN, "tests": TESTS, "rows": rows, "raw": raw})
    return raw


if __name__ == "__main__":
    main()
