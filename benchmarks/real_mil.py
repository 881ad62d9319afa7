"""Real MIL data: the estimators' defaults against baselines and the 2017 reference settings.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.real_mil --data-dir ../shared/data/mil [--seeds 3] [--quick]

Every ``*.csv`` in ``--data-dir`` is one data set (one row per instance, no header: column 0 the
bag's label, column 1 the bag id, the rest the features — the layout of the ``mil`` package's
copies of the classic benchmarks; :mod:`benchmarks.mil_csv`). A file that breaks the layout, or
has fewer than 5 bags of a class, is skipped with one line on stderr. Each is judged by stratified 5-fold cross-validation over bags,
repeated with ``--seeds`` shuffles (``StratifiedKFold(5, shuffle=True, random_state=seed)``,
estimator ``random_state = fold``), one torch thread.

Rows:

* logistic regression on instances (each labelled with its bag's label, z-scored, scikit-learn
  defaults) with **max** and with **mean** pooling of the instance probabilities, and logistic
  regression on each bag's **mean instance** (a bag-level embedding baseline);
* the **reference settings**: the VGPMIL model as the published NumPy code runs it (Haußmann et al.,
  CVPR 2017) — RBF kernel with lengthscale ``√D`` and variance 1 on z-scored features, k-means++
  inducing points split between positive and negative bags, ``H = 10¹²``, the undamped
  largest-other-π rule, 50 sweeps, no hyperparameter learning, bag probability = the largest
  instance probability — implemented with milgp's own code;
* ``VGPMILClassifier()`` (``psi="pg"``), ``VGPMILClassifier(psi="gamma")`` (G-VGPMIL) and
  ``ProbitMILClassifier()``, defaults (M = 100).

Columns: bag AUC mean over folds and seeds and the worst fold; accuracy at the estimator's own
threshold (½ on its probability); bag NLL and ECE (10 bins) of the out-of-fold probabilities pooled
over the folds of a seed, averaged over seeds (a 12-bag test fold cannot estimate an ECE), and the
**ECE floor**: the ECE a perfectly calibrated model with those same probabilities would show on that
many bags (:func:`milgp.metrics.calibrated_ece`; on 58 bags it is ≈ 0.13); fit CPU
seconds per fold (``time.process_time``) and their ratio to the reference settings' fit on the
same fold; for every other row, its AUC minus the best logistic-regression row's (by mean AUC) on
the same folds: the mean, a standard error corrected for repeated cross-validation
(:func:`paired_difference`) and the folds won. Results: ``benchmarks/results/real_mil.json`` for
the full run the README shows; other runs are named apart (:func:`result_name`; a run on another
folder than the file records gets the folder's name as a suffix) and never overwrite it
(``--name`` names one outright: ``benchmarks/package_mil.py``).
"""
from __future__ import annotations

import argparse
import time
import warnings
from typing import Any, Callable

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold
from sklearn.preprocessing import StandardScaler

from benchmarks.common import add_thread_arg, markdown_table, name_for_folder, set_threads, write_json
from benchmarks.mil_csv import load_mil_folder
from milgp.estimators import ProbitMILClassifier, VGPMILClassifier
from milgp.metrics import calibrated_ece, expected_calibration_error, log_loss


class LogisticPooling:
    """Logistic regression (penalty ``C``) on z-scored instances labelled with their bag's label; the
    bag probability is the largest (``pool="max"``) or the mean (``pool="mean"``) instance
    probability; or logistic regression on the bags' mean instances (``pool="embedding"``).
    ``basis`` maps the z-scored training rows and their labels to a ``(D, k)`` basis onto which
    every row is projected first (``benchmarks.linear_span``); ``None``: the features as they are."""

    def __init__(self, pool: str, C: float = 1.0, basis: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None):
        self.pool, self.C, self.basis = pool, C, basis

    def _features(self, x: np.ndarray) -> np.ndarray:
        z = self.scaler_.transform(x)
        return z if self.basis_ is None else z @ self.basis_

    def fit(self, bags: list[np.ndarray], y: np.ndarray) -> "LogisticPooling":
        if self.pool == "embedding":
            x, t = np.stack([b.mean(0) for b in bags]), y
        else:
            x, t = np.concatenate(bags), np.repeat(y, [len(b) for b in bags])
        self.scaler_ = StandardScaler().fit(x)
        self.basis_ = None if self.basis is None else self.basis(self.scaler_.transform(x), t)
        self.model_ = LogisticRegression(C=self.C, max_iter=2000).fit(self._features(x), t)
        return self

    def predict_proba(self, bags: list[np.ndarray]) -> np.ndarray:
        if self.pool == "embedding":
            p = self.model_.predict_proba(self._features(np.stack([b.mean(0) for b in bags])))[:, 1]
        else:
            pool = np.max if self.pool == "max" else np.mean
            p = np.array([pool(self.model_.predict_proba(self._features(b))[:, 1]) for b in bags])
        return np.stack([1 - p, p], 1)


def reference_settings(dim: int, fold: int) -> VGPMILClassifier:
    """The published VGPMIL code's settings, with milgp's implementation."""
    return VGPMILClassifier(
        kernel="rbf", lengthscale=float(np.sqrt(dim)), outputscale=1.0, H=1e12, max_rule="max", damping=1.0,
        bag_rule="max", calibrate=False, bag_size_cap=None, bag_mean_inducing=0.0, max_iter=50, tol=0.0, random_state=fold,
    )


MODELS: dict[str, Callable[[int, int], Any]] = {
    "logistic regression + max pooling": lambda dim, fold: LogisticPooling("max"),
    "logistic regression + mean pooling": lambda dim, fold: LogisticPooling("mean"),
    "logistic regression on bag means": lambda dim, fold: LogisticPooling("embedding"),
    "reference settings (VGPMIL, CVPR 2017 code)": reference_settings,
    "VGPMILClassifier()": lambda dim, fold: VGPMILClassifier(random_state=fold),
    'VGPMILClassifier(psi="gamma")': lambda dim, fold: VGPMILClassifier(psi="gamma", random_state=fold),
    "ProbitMILClassifier()": lambda dim, fold: ProbitMILClassifier(random_state=fold),
}
REFERENCE = "reference settings (VGPMIL, CVPR 2017 code)"
DEFAULT_SEEDS = 3
"""CV shuffles of the full run (the one ``real_mil.json`` holds)."""
COLUMNS = ["model", "bag AUC", "worst fold", "accuracy", "bag NLL", "ECE", "ECE floor", "fit CPU-s", "× reference", "Δ AUC vs best baseline"]
"""The table's columns, in order (the module docstring says what each holds)."""
BASELINES = ("logistic regression + max pooling", "logistic regression + mean pooling", "logistic regression on bag means")
FOLDS = 5


def paired_difference(auc: np.ndarray, baseline: np.ndarray) -> tuple[float, float, int]:
    """Mean of the per-fold AUC differences ``auc − baseline`` ``(J,)`` (the same folds), its
    standard error corrected for the overlap of the training sets of repeated k-fold CV — the
    variance of the differences times ``1/J + n_test/n_train`` with ``n_test/n_train = 1/(k − 1)``
    (Nadeau & Bengio, *Inference for the Generalization Error*, Machine Learning 2003; Bouckaert &
    Frank, *Evaluating the Replicability of Significance Tests for Comparing Learning Algorithms*,
    PAKDD 2004) — and the number of folds on which ``auc`` is higher."""
    d = np.asarray(auc) - np.asarray(baseline)
    se = float(np.sqrt((1.0 / len(d) + 1.0 / (FOLDS - 1)) * d.var(ddof=1))) if len(d) > 1 else float("nan")
    return float(d.mean()), se, int((d > 0).sum())


def cv_folds(y: np.ndarray, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The benchmark's ``(train, test)`` bag indices of shuffle ``seed``: stratified ``FOLDS``-fold CV."""
    return list(StratifiedKFold(FOLDS, shuffle=True, random_state=seed).split(np.zeros(len(y)), y))


def evaluate(bags: list[np.ndarray], y: np.ndarray, seeds: list[int], models: list[str]) -> list[dict[str, Any]]:
    """Cross-validated rows for one data set."""
    dim = bags[0].shape[1]
    per_model = {m: {"auc": [], "acc": [], "nll": [], "ece": [], "ece_floor": [], "cpu": [], "ratio": []} for m in models}
    for seed in seeds:
        oof = {m: np.zeros(len(y)) for m in models}
        for fold, (tr, te) in enumerate(cv_folds(y, seed)):
            btr, bte = [bags[i] for i in tr], [bags[i] for i in te]
            cpu = {}
            for m in models:
                t0 = time.process_time()
                est = MODELS[m](dim, fold).fit(btr, y[tr])
                cpu[m] = time.process_time() - t0
                p = est.predict_proba(bte)[:, 1]
                oof[m][te] = p
                per_model[m]["auc"].append(roc_auc_score(y[te], p))
                per_model[m]["acc"].append(float(((p > 0.5) == y[te]).mean()))
                per_model[m]["cpu"].append(cpu[m])
            for m in models:
                if REFERENCE in cpu:
                    per_model[m]["ratio"].append(cpu[m] / cpu[REFERENCE])
        for m in models:
            per_model[m]["nll"].append(log_loss(oof[m], y))
            per_model[m]["ece"].append(expected_calibration_error(oof[m], y))
            per_model[m]["ece_floor"].append(calibrated_ece(oof[m], seed=seed))
    rows = []
    for m in models:
        r = per_model[m]
        rows.append(
            {
                "model": m,
                "bag AUC": f"{np.mean(r['auc']):.3f}",
                "worst fold": f"{np.min(r['auc']):.3f}",
                "accuracy": f"{np.mean(r['acc']):.3f}",
                "bag NLL": f"{np.mean(r['nll']):.3f}",
                "ECE": f"{np.mean(r['ece']):.3f}",
                "ECE floor": f"{np.mean(r['ece_floor']):.3f}",
                "fit CPU-s": f"{np.mean(r['cpu']):.2f}",
                "× reference": f"{np.mean(r['ratio']):.2f}" if r["ratio"] else "",
                "raw": {k: [float(v) for v in vals] for k, vals in r.items()},
            }
        )
    baselines = [m for m in BASELINES if m in per_model]
    if baselines:
        best = max(baselines, key=lambda m: np.mean(per_model[m]["auc"]))
        for row in rows:
            if row["model"] not in BASELINES:
                mean, se, won = paired_difference(per_model[row["model"]]["auc"], per_model[best]["auc"])
                row["Δ AUC vs best baseline"] = f"{mean:+.3f} ± {se:.3f} ({won}/{len(per_model[best]['auc'])})"
    return rows


def result_name(quick: bool, seeds: int, models: list[str]) -> str:
    """The JSON's name: ``real_mil`` for every row at the default shuffles, ``real_mil_quick``,
    ``real_mil_<n>_shuffles`` and a ``_subset`` suffix for fewer rows otherwise."""
    name = "real_mil" + ("_quick" if quick else "" if seeds == DEFAULT_SEEDS else f"_{seeds}_shuffles")
    return name + ("" if set(models) == set(MODELS) else "_subset")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", required=True, help="folder of MIL CSV files (label, bag id, features...)")
    p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help="CV shuffles (seeds 0..n-1)")
    p.add_argument("--models", nargs="*", default=list(MODELS), help="rows to run (default: all)")
    p.add_argument("--quick", action="store_true", help="one seed")
    p.add_argument("--name", default=None, help="the JSON's name in benchmarks/results (default: result_name's)")
    add_thread_arg(p)
    args = p.parse_args(argv)
    set_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown or not args.models:
        raise SystemExit(f"unknown model rows {unknown or 'none given'}; choose from {list(MODELS)}")
    if args.seeds < 1:
        raise SystemExit(f"--seeds must be at least 1, got {args.seeds}")
    seeds = [0] if args.quick else list(range(args.seeds))
    results = {}
    for stem, (bags, y) in load_mil_folder(args.data_dir, min_bags_per_class=FOLDS).items():
        print(f"\n### {stem} — {len(bags)} bags ({int(y.sum())} positive), {sum(map(len, bags))} instances, "
              f"{bags[0].shape[1]} features; {FOLDS}-fold CV × {len(seeds)} seed(s)\n", flush=True)
        rows = evaluate(bags, y, seeds, args.models)
        print(markdown_table(rows, COLUMNS), flush=True)
        results[stem] = rows
    name = args.name or name_for_folder(result_name(args.quick, args.seeds, args.models), args.data_dir)
    write_json(name, {"seeds": seeds, "data_dir": str(args.data_dir), "datasets": results})
    return results


if __name__ == "__main__":
    main()
