"""Offline MIL benchmark from ``sklearn.datasets.load_digits`` (Castro-Macías et al. 2024, §6.1, with digits for MNIST).

Positive class: digits 2 and 9. Bags of 10 instances, balanced positive/negative bags, each
positive bag holding 1–4 positive instances; instances are sampled *without* replacement (no
instance appears in two bags). Stratified train/test split of bags, several seeds; VGPMIL
(``psi="pg"``) and G-VGPMIL (``psi="gamma"``, the estimator's default ``GammaPsi(α=1, β=1)``) at M ∈ {50, 100, 200}, with the
estimator's defaults unless overridden on the command line.

Bag accuracy is reported twice: at the threshold ½ (``predict``) and at a threshold tuned on the
*training* bags only (the midpoint that maximises training accuracy; no test information). The
second column separates ranking from calibration (the estimators calibrate their bag
probabilities on out-of-bag predictions, so the two should agree). Instance AUC and instance ECE
(10 bins) score ``predict_instance_proba`` against the digits' own labels.

    .venv/bin/python benchmarks/digits_mil.py            # 3 seeds
    .venv/bin/python benchmarks/digits_mil.py --quick    # 1 seed
    .venv/bin/python benchmarks/digits_mil.py --set learn_hyperparameters=False --out /tmp/x.json

Prints a markdown table (mean ± std over seeds) and writes ``benchmarks/results/digits_mil.json``.
"""
from __future__ import annotations

import argparse
import ast
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.decomposition import PCA
from sklearn.metrics import accuracy_score, roc_auc_score
from sklearn.model_selection import train_test_split

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import witness_bags  # noqa: E402
from milgp.data.atomic import atomic_write_text  # noqa: E402
from milgp.estimators import VGPMILClassifier  # noqa: E402
from milgp.metrics import expected_calibration_error  # noqa: E402

POSITIVE_DIGITS = (2, 9)
BAG_SIZE = 10


def make_bags(seed: int, bag_size: int = BAG_SIZE, max_pos: int = 4, pca: int | None = None):
    """Balanced MIL bags from the digits data (:func:`benchmarks.common.witness_bags`), positive
    instances the digits :data:`POSITIVE_DIGITS`, optionally reduced to ``pca`` components.

    Returns ``bags`` (list of ``(bag_size, d)``), ``bag_labels`` ``(B,)``, ``instance_labels``
    (list of ``(bag_size,)``).
    """
    X, digit = load_digits(return_X_y=True)
    X = X.astype(np.float64)
    if pca:
        X = PCA(n_components=pca, random_state=seed).fit_transform(X)
    return witness_bags(X, np.isin(digit, POSITIVE_DIGITS), seed, bag_size, max_pos)


def evaluate(psi: str, num_inducing: int, seed: int, pca: int | None, test_size: float, overrides: dict) -> dict:
    bags, y, inst = make_bags(seed, pca=pca)
    idx_tr, idx_te = train_test_split(np.arange(len(bags)), test_size=test_size, stratify=y, random_state=seed)
    tr = [bags[i] for i in idx_tr]
    te = [bags[i] for i in idx_te]
    clf = VGPMILClassifier(psi=psi, num_inducing=num_inducing, random_state=seed, **overrides)
    t0 = time.perf_counter()
    clf.fit(tr, y[idx_tr])
    fit_time = time.perf_counter() - t0
    p_bag = clf.predict_proba(te)[:, 1]
    threshold = train_tuned_threshold(clf.predict_proba(tr)[:, 1], y[idx_tr])
    p_inst = np.concatenate(clf.predict_instance_proba(te))
    y_inst = np.concatenate([inst[i] for i in idx_te])
    base = clf.model_.covar_module.base_kernel
    ls = base.lengthscale.detach().cpu().numpy().ravel() if clf.model_.kernel == "rbf" else np.array([np.nan])
    return {
        "bag_auc": float(roc_auc_score(y[idx_te], p_bag)),
        "bag_acc": float(accuracy_score(y[idx_te], (p_bag > 0.5).astype(int))),
        "bag_acc_tuned": float(accuracy_score(y[idx_te], (p_bag > threshold).astype(int))),
        "threshold": threshold,
        "inst_auc": float(roc_auc_score(y_inst, p_inst)),
        "inst_ece": expected_calibration_error(p_inst, y_inst),
        "fit_time": fit_time,
        "iterations": clf.fit_result_.iterations,
        "elbo": float(clf.elbo_),
        "outputscale": float(clf.model_.covar_module.outputscale.detach()),
        "lengthscale": float(ls.mean()),
        "linear_kernel": float(clf.model_.kernel in ("linear", "affine")),
        "num_train_bags": len(tr),
        "num_test_bags": len(te),
    }


def train_tuned_threshold(p_train: np.ndarray, y_train: np.ndarray) -> float:
    """The decision threshold on bag probabilities ``(B,)`` that maximises training accuracy:
    the midpoint between consecutive sorted training probabilities (ties: the one nearest ½)."""
    p = np.sort(np.unique(p_train))
    candidates = np.concatenate([[p[0] / 2], (p[1:] + p[:-1]) / 2, [(p[-1] + 1) / 2]]) if len(p) else np.array([0.5])
    acc = np.array([np.mean((p_train > t) == y_train) for t in candidates])
    best = np.flatnonzero(acc == acc.max())
    return float(candidates[best[np.argmin(np.abs(candidates[best] - 0.5))]])


def _parse_overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one seed instead of three")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--pca", type=int, default=None, help="PCA components (default: raw 64 features)")
    parser.add_argument("--inducing", type=int, nargs="+", default=[50, 100, 200])
    parser.add_argument("--psi", nargs="+", default=["pg", "gamma"])
    parser.add_argument("--test-size", type=float, default=0.3)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="VGPMILClassifier overrides")
    parser.add_argument("--out", default=None, help="the JSON (default: benchmarks/results/digits_mil[_quick].json)")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    seeds = list(range(1 if args.quick else args.seeds))
    overrides = _parse_overrides(args.set)
    names = {"pg": "VGPMIL", "gamma": "G-VGPMIL"}
    rows, raw = [], []
    for psi in args.psi:
        for M in args.inducing:
            runs = [evaluate(psi, M, s, args.pca, args.test_size, overrides) for s in seeds]
            raw.append({"model": names.get(psi, psi), "psi": psi, "num_inducing": M, "runs": runs})
            stat = {k: (float(np.mean([r[k] for r in runs])), float(np.std([r[k] for r in runs]))) for k in runs[0]}
            rows.append((names.get(psi, psi), M, stat))
            print(
                f"{names.get(psi, psi):9s} M={M:3d} bagAUC={stat['bag_auc'][0]:.3f} bagAcc={stat['bag_acc'][0]:.3f} "
                f"instAUC={stat['inst_auc'][0]:.3f} time={stat['fit_time'][0]:.1f}s it={stat['iterations'][0]:.0f} "
                f"v={stat['outputscale'][0]:.3g} l={stat['lengthscale'][0]:.3g}",
                file=sys.stderr,
                flush=True,
            )
    lines = [
        "| model | M | bag AUC | bag accuracy (½) | bag accuracy (train-tuned threshold) | instance AUC | instance ECE | fit time (s) |",
        "| --- | ---: | --- | --- | --- | --- | --- | --- |",
    ]
    for name, M, s in rows:
        f = lambda k, d=3: f"{s[k][0]:.{d}f} ± {s[k][1]:.{d}f}"  # noqa: E731
        lines.append(f"| {name} | {M} | {f('bag_auc')} | {f('bag_acc')} | {f('bag_acc_tuned')} | {f('inst_auc')} | {f('inst_ece')} | {f('fit_time', 2)} |")
    table = "\n".join(lines)
    print(table)
    result = {
        "command": "python benchmarks/digits_mil.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seeds": seeds,
        "pca": args.pca,
        "test_size": args.test_size,
        "overrides": overrides,
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "table": table,
        "results": raw,
    }
    out = args.out or Path(__file__).resolve().parent / "results" / f"digits_mil{'_quick' if args.quick else ''}.json"
    atomic_write_text(out, json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
