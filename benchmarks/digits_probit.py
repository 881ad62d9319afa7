"""MIL-GP-Probit on the offline digits bags (Wang & Pinar 2021 on the benchmark of ``digits_mil.py``).

Same bags as :mod:`benchmarks.digits_mil` (``load_digits``, positives = digits 2 and 9, balanced
bags of 10, 1–4 positives per positive bag, stratified 70/30 split of bags; its ``make_bags`` is
imported, not copied). Rows: probit VI (orthant bag probabilities) and probit Gibbs at fixed
kernel hyperparameters (median-heuristic lengthscale, unit variance — Wang & Pinar 2021, §4 also fixes
them), probit VI with hyperparameters learned on the collapsed ELBO, and VGPMIL at the same
fixed hyperparameters for reference. Columns: bag AUC,
instance AUC, instance predictive log-likelihood (Wang & Pinar's (2021) calibration measure,
``mean h log p + (1 − h) log(1 − p)``), fit time; Gibbs also reports max split-R̂ / min ESS.

    .venv/bin/python benchmarks/digits_probit.py           # 3 seeds
    .venv/bin/python benchmarks/digits_probit.py --quick   # 1 seed

Prints a markdown table (mean ± std over seeds) and writes ``benchmarks/results/digits_probit.json``.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from digits_mil import make_bags  # noqa: E402

from milgp.data.atomic import atomic_write_text  # noqa: E402
from milgp.estimators import ProbitMILClassifier, VGPMILClassifier  # noqa: E402


def instance_loglik(y: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return float(np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def evaluate(name: str, seed: int, args) -> dict:
    bags, y, inst = make_bags(seed)
    idx_tr, idx_te = train_test_split(np.arange(len(bags)), test_size=args.test_size, stratify=y, random_state=seed)
    tr, te = [bags[i] for i in idx_tr], [bags[i] for i in idx_te]
    # one fixed kernel (RBF, lengthscale √D, variance 1) for VI, Gibbs and VGPMIL alike, and the
    # models' own uncalibrated bag predictions: this compares inference, not model selection
    fixed = dict(
        num_inducing=args.inducing, random_state=seed, max_iter=args.max_iter, calibrate=False,
        kernel="rbf", lengthscale=float(np.sqrt(tr[0].shape[1])), outputscale=1.0,
    )
    probit_rule = dict(bag_rule="orthant", single_instance=False)  # the MIL probit model alone
    if name == "probit-vi":
        clf = ProbitMILClassifier(inference="vi", **fixed, **probit_rule)
    elif name == "probit-gibbs":
        clf = ProbitMILClassifier(
            inference="gibbs", num_samples=args.samples, burn_in=args.burn_in, num_chains=args.chains, **fixed, **probit_rule
        )
    elif name == "probit-vi-learned":
        clf = ProbitMILClassifier(inference="vi", learn_hyperparameters=True, **fixed, **probit_rule)
    else:
        clf = VGPMILClassifier(psi="pg", bag_rule="noisy_or", **fixed)
    t0 = time.perf_counter()
    clf.fit(tr, y[idx_tr])
    fit_time = time.perf_counter() - t0
    p_bag = clf.predict_proba(te)[:, 1]
    p_inst = np.concatenate(clf.predict_instance_proba(te))
    y_inst = np.concatenate([inst[i] for i in idx_te])
    out = {
        "bag_auc": float(roc_auc_score(y[idx_te], p_bag)),
        "inst_auc": float(roc_auc_score(y_inst, p_inst)),
        "inst_loglik": instance_loglik(y_inst, p_inst),
        "fit_time": fit_time,
        "num_train_bags": len(tr),
        "num_test_bags": len(te),
    }
    if name == "probit-gibbs":
        out["max_rhat"] = clf.gibbs_summary_["max_rhat"]
        out["min_ess"] = clf.gibbs_summary_["min_ess"]
        out["gibbs_seconds"] = clf.gibbs_summary_["seconds"]
    if name.startswith("probit-vi"):
        out["outputscale"] = float(clf.model_.covar_module.outputscale)
        out["max_bag_stderr"] = float(clf.predict_bag_proba(te)[1].max())
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one seed instead of three")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--inducing", type=int, default=100)
    parser.add_argument("--samples", type=int, default=1000, help="Gibbs draws kept per chain")
    parser.add_argument("--burn-in", type=int, default=500)
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--test-size", type=float, default=0.3)
    parser.add_argument("--max-iter", type=int, default=200, help="CAVI iterations at fixed hyperparameters (stops at tol)")
    parser.add_argument("--models", nargs="+", default=["probit-vi", "probit-gibbs", "probit-vi-learned", "vgpmil"])
    parser.add_argument("--out", default=None, help="the JSON (default: benchmarks/results/digits_probit[_quick].json)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (small matrices: 1 is fastest)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = list(range(1 if args.quick else args.seeds))
    names = {
        "probit-vi": "MIL-GP-Probit, VI",
        "probit-gibbs": "MIL-GP-Probit, Gibbs",
        "probit-vi-learned": "MIL-GP-Probit, VI, learned hyperparameters",
        "vgpmil": "VGPMIL (reference)",
    }
    rows, raw = [], []
    for name in args.models:
        runs = [evaluate(name, s, args) for s in seeds]
        raw.append({"model": names[name], "runs": runs})
        stat = {k: (float(np.mean([r[k] for r in runs])), float(np.std([r[k] for r in runs]))) for k in runs[0]}
        rows.append((names[name], stat))
        print(f"{names[name]}: " + ", ".join(f"{k}={v[0]:.4g}" for k, v in stat.items()), file=sys.stderr, flush=True)
    lines = [
        f"| model (M = {args.inducing}) | bag AUC | instance AUC | instance log-lik | fit time (s) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, s in rows:
        f = lambda k, d=3: f"{s[k][0]:.{d}f} ± {s[k][1]:.{d}f}"  # noqa: E731
        lines.append(f"| {name} | {f('bag_auc')} | {f('inst_auc')} | {f('inst_loglik')} | {f('fit_time', 1)} |")
    table = "\n".join(lines)
    print(table)
    result = {
        "command": "python benchmarks/digits_probit.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seeds": seeds,
        "settings": vars(args),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "table": table,
        "results": raw,
    }
    out = args.out or Path(__file__).resolve().parent / "results" / f"digits_probit{'_quick' if args.quick else ''}.json"
    atomic_write_text(out, json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
