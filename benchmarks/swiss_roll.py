"""Swiss-roll aggregate-count experiment of Law et al. 2018, §4.1 (VBAgg-Poisson vs Appendix-B baselines).

Data (as in the paper): ``Σ_a N_a`` points on sklearn's swiss roll, bag sizes ``N_a`` from a
negative binomial with mean 150 and sd 50, points ordered by their z coordinate and poured into
the bags in turn (covariate-dependent bagging), the manifold embedded in R¹⁸ by a random
orthogonal rotation; the colour ``t`` of a point is its rate ``λ_i``, ``y_i ~ Poisson(λ_i)`` and
only ``y_a = Σ_i y_i`` is observed. Metrics on the training individuals (whose labels are never
used): average Poisson NLL of ``y_i`` under the predicted mean rate, MSE against the true ``λ_i``,
and the coverage of the central 50/80/90% posterior intervals of ``λ_i``.

    python benchmarks/swiss_roll.py            # full run
    python benchmarks/swiss_roll.py --quick    # smoke run
"""
from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import numpy as np
from scipy.stats import ortho_group, poisson
from sklearn.datasets import make_swiss_roll

from milgp.baselines import BagPixelRegressor, ConstantRateRegressor
from milgp.data.atomic import atomic_write_text
from milgp.estimators import VBAggRegressor

LEVELS = (0.5, 0.8, 0.9)


def make_data(n_bags: int, seed: int, mean: float = 150, sd: float = 50, dim: int = 18):
    rng = np.random.default_rng(seed)
    p = mean / sd**2
    r = mean * p / (1 - p)
    sizes = np.maximum(rng.negative_binomial(r, p, n_bags), 1)
    X3, t = make_swiss_roll(int(sizes.sum()), random_state=seed)
    order = np.argsort(X3[:, 2])
    X3, t = X3[order], t[order]
    Q = ortho_group.rvs(dim, random_state=seed)
    X = np.concatenate([X3, np.zeros((len(X3), dim - 3))], 1) @ Q.T
    counts = rng.poisson(t)
    edges = np.cumsum(sizes)[:-1]
    bags = np.split(X, edges)
    y = np.array([c.sum() for c in np.split(counts, edges)])
    return bags, y, X, t, counts, sizes


def evaluate(pred, lam, counts, quantiles=None):
    out = {"nll": float(-poisson.logpmf(counts, np.maximum(pred, 1e-12)).mean()), "mse": float(np.mean((pred - lam) ** 2))}
    if quantiles is not None:
        for k, c in enumerate(LEVELS):
            lo, hi = quantiles[:, 2 * k], quantiles[:, 2 * k + 1]
            out[f"cov{int(c * 100)}"] = float(np.mean((lam >= lo) & (lam <= hi)))
    return out


def run(n_bags_list, seeds, num_inducing, max_iter, out_path):
    qlev = [v for c in LEVELS for v in ((1 - c) / 2, (1 + c) / 2)]
    rows = []
    for n_bags in n_bags_list:
        for seed in seeds:
            bags, y, X, lam, counts, sizes = make_data(n_bags, seed)
            const = ConstantRateRegressor().fit(bags, y)
            rows.append({"method": "constant", "n_bags": n_bags, "seed": seed, "N": int(sizes.sum()), "seconds": 0.0,
                         **evaluate(np.concatenate(const.predict_in_bags(bags)), lam, counts)})
            fits = {
                "VBAgg-exp": lambda: VBAggRegressor("poisson", "exp", num_inducing=num_inducing, max_iter=max_iter, random_state=seed),
                "VBAgg-square": lambda: VBAggRegressor("poisson", "square", num_inducing=num_inducing, max_iter=max_iter, random_state=seed),
                "bag-pixel": lambda: BagPixelRegressor("poisson", "exp", num_inducing=min(num_inducing, n_bags), max_iter=max_iter, random_state=seed),
            }
            for name, make in fits.items():
                t0 = time.perf_counter()
                est = make().fit(bags, y)
                secs = time.perf_counter() - t0
                res = evaluate(est.predict(X), lam, counts, est.predict_quantiles(X, qlev))
                rows.append({"method": name, "n_bags": n_bags, "seed": seed, "N": int(sizes.sum()), "seconds": secs, **res})
                print(f"  n_bags={n_bags} seed={seed} {name:13s} nll={res['nll']:.3f} mse={res['mse']:.3f} "
                      f"cov90={res.get('cov90', float('nan')):.2f} ({secs:.0f}s)", flush=True)
    summary = summarise(rows)
    atomic_write_text(out_path, json.dumps({"rows": rows, "summary": summary, "config": {
        "n_bags": n_bags_list, "seeds": seeds, "num_inducing": num_inducing, "max_iter": max_iter,
        "bag_size_mean": 150, "bag_size_sd": 50, "dim": 18}}, indent=2))
    print(markdown(summary))
    return summary


def summarise(rows):
    keys = ["nll", "mse", "cov50", "cov80", "cov90", "seconds"]
    out = []
    for n_bags in sorted({r["n_bags"] for r in rows}):
        for method in ["constant", "bag-pixel", "VBAgg-exp", "VBAgg-square"]:
            sel = [r for r in rows if r["n_bags"] == n_bags and r["method"] == method]
            if not sel:
                continue
            entry = {"n_bags": n_bags, "method": method, "runs": len(sel)}
            for k in keys:
                vals = [r[k] for r in sel if k in r]
                if vals:
                    entry[k] = float(np.mean(vals))
                    entry[k + "_sd"] = float(np.std(vals))
            out.append(entry)
    return out


def markdown(summary):
    lines = ["| bags | method | indiv. NLL | indiv. MSE | cover 50% | cover 80% | cover 90% | fit s |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda e, k, d=3: (f"{e[k]:.{d}f} ± {e[k + '_sd']:.{d}f}" if k in e else "—")
    for e in summary:
        lines.append(f"| {e['n_bags']} | {e['method']} | {fmt(e, 'nll')} | {fmt(e, 'mse')} | {fmt(e, 'cov50', 2)} | "
                     f"{fmt(e, 'cov80', 2)} | {fmt(e, 'cov90', 2)} | {e['seconds']:.0f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one small configuration (smoke run)")
    parser.add_argument("--n-bags", type=int, nargs="+", default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--num-inducing", type=int, default=None)
    parser.add_argument("--max-iter", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "swiss_roll.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.quick:
        n_bags, seeds, M, it = [30], [0], 30, 25
        if args.out == parser.get_default("out"):
            args.out = args.out.with_name("swiss_roll_quick.json")
    else:
        n_bags, seeds, M, it = [50, 100], [0, 1], 30, 25
    run(args.n_bags or n_bags, args.seeds or seeds, args.num_inducing or M, args.max_iter or it, args.out)


if __name__ == "__main__":
    main()
