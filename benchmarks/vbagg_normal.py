"""Does the Normal VBAgg model disaggregate whatever the unit of the targets?

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.vbagg_normal [--seeds 3]

Three aggregate regression problems built from data that ships with scikit-learn, each bag's
target the (weighted) sum of its instances' values, two thirds of the bags for training:

* ``digits``: ``load_digits`` in random bags of 10, instance value 1 for a 9 (the count of 9s);
* ``swiss_roll``: ``make_swiss_roll`` (1,500 points) in 150 spatial bags (k-means), instance value
  ``2 sin t + 0.3 t``, populations U(0.5, 2): bags of neighbours, as regions are;
* ``diabetes``: ``load_diabetes`` in random bags of 4, the disease-progression score.

Each is fitted by ``VBAggRegressor(likelihood="normal")`` with the targets in their unit and
multiplied by 0.01 and 100 (predictions divided back). Columns: bag R² on the test bags, R² and
correlation of the predicted instance values with the true ones, fit CPU seconds; means over seeds.
Results: ``benchmarks/results/vbagg_normal.json``.
"""
from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
from sklearn.cluster import KMeans
from sklearn.datasets import load_diabetes, load_digits, make_swiss_roll

from benchmarks.common import add_thread_arg, markdown_table, set_threads, write_json
from milgp.estimators import VBAggRegressor

UNITS = (1.0, 0.01, 100.0)

Problem = tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]
"""Bags ``(n_b, d)``, their instances' true values ``(n_b,)`` and populations ``(n_b,)``."""


def digits(seed: int) -> Problem:
    d = load_digits()
    idx = np.random.default_rng(seed).permutation(len(d.data))[:1500]
    x, value = d.data[idx], (d.target[idx] == 9).astype(float)
    parts = range(0, 1500, 10)
    return [x[i : i + 10] for i in parts], [value[i : i + 10] for i in parts], [np.ones(10)] * len(parts)


def swiss_roll(seed: int) -> Problem:
    x, t = make_swiss_roll(1500, noise=0.3, random_state=seed)
    value = 2.0 * np.sin(t) + 0.3 * t
    region = KMeans(150, n_init=1, random_state=seed).fit_predict(x)
    order = [k for k in np.random.default_rng(seed).permutation(150) if (region == k).any()]
    rng = np.random.default_rng(seed + 1)
    return ([x[region == k] for k in order], [value[region == k] for k in order],
            [rng.uniform(0.5, 2.0, int((region == k).sum())) for k in order])


def diabetes(seed: int) -> Problem:
    d = load_diabetes()
    idx = np.random.default_rng(seed).permutation(len(d.data))[:440]
    x, value = d.data[idx], d.target[idx]
    parts = range(0, 440, 4)
    return [x[i : i + 4] for i in parts], [value[i : i + 4] for i in parts], [np.ones(4)] * len(parts)


PROBLEMS = {"digits": digits, "swiss_roll": swiss_roll, "diabetes": diabetes}


def r2(truth: np.ndarray, pred: np.ndarray) -> float:
    return float(1 - ((truth - pred) ** 2).sum() / ((truth - truth.mean()) ** 2).sum())


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    add_thread_arg(p)
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be at least 1")
    set_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    rows = []
    for name, make in PROBLEMS.items():
        for unit in UNITS:
            raw: dict[str, list[float]] = {"bag_r2": [], "instance_r2": [], "instance_corr": [], "cpu": []}
            for seed in range(args.seeds):
                bags, values, weights = make(seed)
                y = np.array([(w * v).sum() for w, v in zip(weights, values)])
                n = 2 * len(bags) // 3
                t0 = time.process_time()
                est = VBAggRegressor(likelihood="normal", random_state=seed).fit(bags[:n], unit * y[:n], weights[:n])
                raw["cpu"].append(time.process_time() - t0)
                bag_pred = est.predict_bags(bags[n:], weights[n:])["y_mean"] / unit
                x_test, v_test = np.concatenate(bags[n:]), np.concatenate(values[n:])
                inst_pred = est.predict(x_test) / unit
                raw["bag_r2"].append(r2(y[n:], bag_pred))
                raw["instance_r2"].append(r2(v_test, inst_pred))
                raw["instance_corr"].append(float(np.corrcoef(v_test, inst_pred)[0, 1]))
            rows.append({
                "data": name, "unit": f"× {unit:g}", "bag R²": f"{np.mean(raw['bag_r2']):.3f}",
                "instance R²": f"{np.mean(raw['instance_r2']):.3f}", "instance corr": f"{np.mean(raw['instance_corr']):.3f}",
                "fit CPU-s": f"{np.mean(raw['cpu']):.1f}", "raw": raw,
            })
            print(markdown_table(rows[-1:], ["data", "unit", "bag R²", "instance R²", "instance corr", "fit CPU-s"]), flush=True)
    print(markdown_table(rows, ["data", "unit", "bag R²", "instance R²", "instance corr", "fit CPU-s"]))
    write_json("vbagg_normal", {"seeds": args.seeds, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
