"""Does VBAggRegressor disaggregate? Digits bags whose target is the count of 9s.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.vbagg_digits [--seeds 3]

scikit-learn's ``load_digits`` in random bags of 10 (150 bags: 100 for training, 50 for testing),
target = how many 9s the bag holds (Poisson, exp link). Rows: the default (kernel variance chosen
by cross-validation), the kernel fixed at variance 1, and the kernel learned on the ELBO
(``learn_hyperparameters=True``). Columns: bag-level R² of the predicted counts on test bags, AUC
of the individual predicted rates for "is a 9" on the held-out digits, the final kernel variance,
fit CPU seconds. Results: ``benchmarks/results/vbagg_digits.json``.
"""
from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
from sklearn.datasets import load_digits
from sklearn.metrics import roc_auc_score

from benchmarks.common import add_thread_arg, markdown_table, set_threads, write_json
from milgp.estimators import VBAggRegressor

ROWS = {
    "default (variance by CV)": {},
    "kernel fixed, variance 1": {"outputscale": 1.0},
    "kernel learned on the ELBO": {"outputscale": 1.0, "learn_hyperparameters": True},
}


def digit_count_bags(seed: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """150 bags of 10 digits and their count of 9s, plus the remaining digits and whether each is a 9."""
    digits = load_digits()
    idx = np.random.default_rng(seed).permutation(len(digits.data))
    x, nine = digits.data[idx], (digits.target[idx] == 9)
    bags = [x[i : i + 10] for i in range(0, 1500, 10)]
    counts = np.array([nine[i : i + 10].sum() for i in range(0, 1500, 10)], dtype=float)
    return bags, counts, x[1500:], nine[1500:].astype(float)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    add_thread_arg(p)
    args = p.parse_args(argv)
    set_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    rows = []
    for name, kw in ROWS.items():
        r2, auc, scale, cpu = [], [], [], []
        for seed in range(args.seeds):
            bags, counts, x_test, nine_test = digit_count_bags(seed)
            t0 = time.process_time()
            est = VBAggRegressor(random_state=seed, **kw).fit(bags[:100], counts[:100])
            cpu.append(time.process_time() - t0)
            r2.append(est.score(bags[100:], counts[100:]))
            auc.append(roc_auc_score(nine_test, est.predict(x_test)))
            scale.append(float(est.model_.covar_module.outputscale.detach()))
        rows.append({
            "model": name, "bag R²": f"{np.mean(r2):.3f} ± {np.std(r2):.3f}", "instance AUC (9?)": f"{np.mean(auc):.3f}",
            "kernel variance": " / ".join(f"{v:.3g}" for v in scale), "fit CPU-s": f"{np.mean(cpu):.1f}",
            "raw": {"r2": r2, "auc": auc, "outputscale": scale, "cpu": cpu},
        })
    print(markdown_table(rows, ["model", "bag R²", "instance AUC (9?)", "kernel variance", "fit CPU-s"]))
    write_json("vbagg_digits", {"seeds": args.seeds, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
