"""Why the averaged bag decision lags: out-of-bag against test-fold likelihood, per candidate.

The default estimators fit two families of candidates — the largest-other-π rule (a witness per
positive bag) and single-instance learning — at several kernels, score every (fit, bag rule)
candidate on leave-one-bag-out cavity predictions of the training bags, and average them with
pseudo-BMA+ weights from those scores (docs/core.md, causes 2 and 9). The weights are only as good
as the scores. This benchmark sets each candidate's mean out-of-bag NLL (on the training bags)
beside its NLL on the test fold, so the optimism ``test − out-of-bag`` can be compared between the
families, and rebuilds the average from the same candidates in four ways:

* ``all``: pseudo-BMA+ over every candidate (what the estimator does);
* ``single-instance``, ``largest-other-π``: pseudo-BMA+ within one family only;
* ``equal families``: pseudo-BMA+ within each family, the two mixtures averaged ½ / ½.

Data: every ``*.csv`` of ``--data-dir`` (the layout of ``benchmarks/real_mil.py``) and the digits
bags of ``benchmarks/digits_mil.py`` (bags of 10 holding a 2 or a 9: one witness-type data set with
a known answer), each by the stratified 5-fold CV of ``benchmarks/real_mil.py`` × ``--seeds``
shuffles, estimator ``random_state = fold``, one torch thread.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.candidate_families --data-dir ../shared/data/mil --seeds 10 [--psi gamma]

Prints two markdown tables per data set and writes ``benchmarks/results/candidate_families_<psi>.json``
(``--name``: another name, e.g. for the sets of ``benchmarks/package_mil.py``, whose ``digits.csv``
holds these same digits bags).
"""
from __future__ import annotations

import argparse
import re
import warnings
from typing import Any, Callable

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

from benchmarks.common import add_thread_arg, digits_bags, markdown_table, name_for_folder, set_threads, write_json
from benchmarks.mil_csv import load_mil_folder
from benchmarks.real_mil import FOLDS, cv_folds
from milgp.estimators import VGPMILClassifier
from milgp.metrics import expected_calibration_error, log_loss
from milgp.prediction import AveragedFit, ModelAverage


class RecordingVGPMIL(VGPMILClassifier):
    """``VGPMILClassifier`` that keeps every candidate of its search (``candidates_``), not only
    the members of its average."""

    def _average(self, fits, labels):  # type: ignore[no-untyped-def]
        if not hasattr(self, "candidates_"):  # the first call averages every candidate; later ones subsets
            self.candidates_ = fits
        return super()._average(fits, labels)


def _describe(candidate: Any) -> dict[str, str]:
    """The candidate's family, kernel and bag rule (the max's reference length, the longest
    training bag, varies between folds and is left out of the name)."""
    kernel = candidate.model.covar_module.base_kernel
    kind = {"RBFKernel": "RBF", "LinearKernel": "linear", "AdditiveKernel": "affine"}.get(type(kernel).__name__, type(kernel).__name__)
    lengthscale = f" ℓ {float(kernel.lengthscale.mean()):.3g}" if getattr(kernel, "lengthscale", None) is not None else ""
    return {
        "family": "single-instance" if candidate.single_instance else "largest-other-π",
        "kernel": f"{kind}{lengthscale} s² {float(candidate.model.covar_module.outputscale):.3g}",
        "bag rule": re.sub(r"reference_length=\d+", "reference_length=n₀", repr(candidate.decision.rule)),
    }


def _mixture(cands: list[dict[str, Any]], y_train: np.ndarray, seed: int) -> np.ndarray:
    """The test probabilities of the average the estimator builds from ``cands``
    (:meth:`ModelAverage.from_candidates` on their out-of-bag probabilities)."""
    average = ModelAverage.from_candidates([c["candidate"] for c in cands], torch.as_tensor(y_train), seed)
    test = {id(c["candidate"][2]): c["test"] for c in cands}
    return sum(m.weight * test[id(m.decision)] for m in average.members)


SCHEMES: dict[str, Callable[[list[dict[str, Any]], np.ndarray, int], np.ndarray]] = {
    "all": lambda c, y, s: _mixture(c, y, s),
    "single-instance": lambda c, y, s: _mixture([k for k in c if k["single"]], y, s),
    "largest-other-π": lambda c, y, s: _mixture([k for k in c if not k["single"]], y, s),
    "equal families": lambda c, y, s: 0.5 * _mixture([k for k in c if k["single"]], y, s) + 0.5 * _mixture([k for k in c if not k["single"]], y, s),
}


def one_fold(bags: list[np.ndarray], y: np.ndarray, train: np.ndarray, test: np.ndarray, fold: int, psi: str) -> list[dict[str, Any]]:
    """Every candidate of the default fit on ``train``: its name, family, calibrated out-of-bag
    probabilities of the training bags and calibrated probabilities of the ``test`` bags."""
    est = RecordingVGPMIL(psi=psi, random_state=fold).fit([bags[i] for i in train], y[train])
    x, bag_struct = est._features([bags[i] for i in test])
    out = []
    with torch.no_grad():
        for c in est.candidates_:
            alone = ModelAverage([AveragedFit(c.model, c.likelihood, c.decision, 1.0)])
            p = alone.bag_probability(x, bag_struct, est._generator(x))[0]
            out.append({"name": tuple(_describe(c).items()), "single": c.single_instance, "candidate": (c.model, c.likelihood, c.decision),
                        "oob": c.decision.heldout_proba.double().cpu().numpy(), "test": p.double().cpu().numpy()})
    return out


def evaluate(bags: list[np.ndarray], y: np.ndarray, seeds: list[int], psi: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(candidate rows, scheme rows)`` of one data set."""
    per_candidate: dict[tuple[tuple[str, str], ...], dict[str, list[float]]] = {}
    per_scheme = {s: {"auc": [], "nll": [], "ece": []} for s in SCHEMES}
    for seed in seeds:
        oof = {s: np.zeros(len(y)) for s in SCHEMES}
        for fold, (tr, te) in enumerate(cv_folds(y, seed)):
            cands = one_fold(bags, y, tr, te, fold, psi)
            for c in cands:
                r = per_candidate.setdefault(c["name"], {"oob": [], "test": [], "auc": []})
                r["oob"].append(log_loss(c["oob"], y[tr]))
                r["test"].append(log_loss(c["test"], y[te]))
                r["auc"].append(roc_auc_score(y[te], c["test"]))
            for s, scheme in SCHEMES.items():
                p = scheme(cands, y[tr], fold)
                oof[s][te] = p
                per_scheme[s]["auc"].append(roc_auc_score(y[te], p))
        for s in SCHEMES:
            per_scheme[s]["nll"].append(log_loss(oof[s], y))
            per_scheme[s]["ece"].append(expected_calibration_error(oof[s], y))
    candidate_rows = [
        {**dict(name), "out-of-bag NLL": f"{np.mean(r['oob']):.3f}", "test NLL": f"{np.mean(r['test']):.3f}",
         "optimism": f"{np.mean(r['test']) - np.mean(r['oob']):+.3f}", "test bag AUC": f"{np.mean(r['auc']):.3f}"}
        for name, r in per_candidate.items()
    ]
    scheme_rows = [
        {"average over": s, "bag AUC": f"{np.mean(r['auc']):.3f}", "worst fold": f"{np.min(r['auc']):.3f}",
         "bag NLL": f"{np.mean(r['nll']):.3f}", "ECE": f"{np.mean(r['ece']):.3f}"}
        for s, r in per_scheme.items()
    ]
    return candidate_rows, scheme_rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", required=True, help="folder of MIL CSV files (label, bag id, features...)")
    p.add_argument("--seeds", type=int, default=3, help="CV shuffles (seeds 0..n-1)")
    p.add_argument("--psi", default="pg", choices=("pg", "gamma"))
    p.add_argument("--name", default=None, help="the JSON's name in benchmarks/results (default: candidate_families_<psi>)")
    add_thread_arg(p)
    args = p.parse_args(argv)
    set_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    sets = load_mil_folder(args.data_dir, min_bags_per_class=FOLDS)
    sets["digits"] = digits_bags(seed=0)
    results = {}
    for name, (bags, y) in sets.items():
        candidates, schemes = evaluate(bags, np.asarray(y, dtype=np.float64), list(range(args.seeds)), args.psi)
        print(f"\n## {name} (psi={args.psi}, {args.seeds} shuffles)\n\n{markdown_table(candidates)}\n\n{markdown_table(schemes)}", flush=True)
        results[name] = {"candidates": candidates, "averages": schemes}
    write_json(args.name or name_for_folder(f"candidate_families_{args.psi}", args.data_dir),
               {"seeds": args.seeds, "data_dir": str(args.data_dir), "results": results})
    return results


if __name__ == "__main__":
    main()
