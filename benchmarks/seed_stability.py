"""How much the default estimator's bag AUC moves with its ``random_state`` alone.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.seed_stability --data-dir ../shared/data/mil [--offsets 0,100,200,300]

Same folds as ``benchmarks.real_mil`` (``StratifiedKFold(5, shuffle=True, random_state=seed)``,
seeds 0–2) and ``VGPMILClassifier(random_state=k + offset)`` on fold ``k``, once per offset: the
folds and the data stay fixed, only the estimator's own randomness changes (the k-means++ seeding
of the inducing points and the Bayesian bootstrap of the candidates' weights). Prints, per data
set and offset, the bag AUC mean (worst fold) over the 15 folds, then the standard deviation of a
fold's AUC across offsets (averaged over folds) and of the 15-fold mean across offsets; writes
``benchmarks/results/seed_stability.json``.
"""
from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import numpy as np
from sklearn.metrics import roc_auc_score

from benchmarks.common import add_thread_arg, markdown_table, name_for_folder, set_threads, write_json
from benchmarks.mil_csv import load_mil_folder
from benchmarks.real_mil import FOLDS, cv_folds
from milgp.estimators import VGPMILClassifier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--seeds", type=int, default=3, help="shuffles of the 5-fold split")
    parser.add_argument("--offsets", default="0,100,200,300", help="added to the fold index to give random_state")
    add_thread_arg(parser)
    args = parser.parse_args()
    set_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)  # the constant-feature notice, once per fit
    offsets = [int(v) for v in args.offsets.split(",")]
    rows, results = [], {}
    for stem, (bags, y) in load_mil_folder(args.data_dir, min_bags_per_class=FOLDS).items():
        folds = [
            (k, train, test)
            for seed in range(args.seeds)
            for k, (train, test) in enumerate(cv_folds(y, seed))
        ]
        auc = np.zeros((len(offsets), len(folds)))
        for i, offset in enumerate(offsets):
            for j, (k, train, test) in enumerate(folds):
                model = VGPMILClassifier(random_state=k + offset).fit([bags[b] for b in train], y[train])
                auc[i, j] = roc_auc_score(y[test], model.predict_proba([bags[b] for b in test])[:, 1])
            print(f"{stem}: offset {offset}: {auc[i].mean():.3f} ({auc[i].min():.3f})", flush=True)
        rows.append({
            "data": stem,
            "bag AUC per offset": " / ".join(f"{a:.3f}" for a in auc.mean(1)),
            "worst fold per offset": " / ".join(f"{a:.3f}" for a in auc.min(1)),
            "fold AUC sd across offsets": float(auc.std(0, ddof=1).mean()),
            "mean AUC sd across offsets": float(auc.mean(1).std(ddof=1)),
        })
        results[stem] = auc.tolist()
    print(markdown_table(rows))
    payload = {"seeds": args.seeds, "offsets": offsets, "data_dir": str(args.data_dir), "fold_auc": results}
    write_json(name_for_folder("seed_stability", args.data_dir), payload)


if __name__ == "__main__":
    main()
